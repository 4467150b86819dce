"""The C++ CPU kernels of every kernel backend this machine runs against the torch path they
replace: paged decode attention on ragged contexts over scattered pool blocks, its input
validation, the tiled prefill attention against a float64 reference, the build/cache protocol,
and greedy tokens of the whole engine on each backend."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.checkpoints import hf_greedy, load_hf, make_tiny_llama
from tests.conftest import KERNEL_ISAS
from tierserve import LLM, SamplingParams
from tierserve.runtime import envs
from tierserve.workers.attention import AttentionMetadata, _decode, paged_attention
from tierserve.workers.backends import cpu as cpu_backends
from tierserve.workers.backends.cpu import CpuKernelBackend
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.backends.kernels import KernelLibrary, build_dir_for
from tierserve.workers.backends.stack import KernelLayerStack

COMPILER = os.environ.get("CXX", "c++")
pytestmark = pytest.mark.skipif(shutil.which(COMPILER) is None,
                                reason=f"no C++ compiler ({COMPILER}) to build the CPU kernels")

LENS = [1, 15, 16, 17, 300]


def _decode_batch(dtype, group: int, head_dim: int, *, kv_heads: int = 2, block_size: int = 16,
                  seed: int = 0, lens: list[int] = LENS):
    """q (a strided slice, as the model's fused qkv gives it), K/V pools with each sequence's
    blocks scattered over them, and the step's AttentionMetadata."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = 2 * sum(counts) + 3
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = [ids[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(lens))]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    heads = kv_heads * group
    q = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=g).to(dtype)[:, :heads]
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, lens)]
    attn = AttentionMetadata.build(slot_mapping=slots, query_lens=[1] * len(lens), seq_lens=lens,
                                   block_tables=tables, num_decodes=len(lens),
                                   block_size=block_size)
    return q, k_cache, v_cache, attn


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Work items are claimed by the threads; a single sequence decoded alone takes one KV head
    per item (too few items otherwise), a batch all KV heads of a context part."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_kernel_matches_torch_path(kernels, threads, dtype, atol, group, head_dim):
    q, k_cache, v_cache, attn = _decode_batch(dtype, group, head_dim)
    scale = head_dim ** -0.5
    expected = _decode(q, k_cache, v_cache, attn, scale)
    got = paged_attention(q, None, None, (k_cache, v_cache), attn, scale, kernels,
                          kv_written=True).view(expected.shape)
    direct = kernels.paged_attention(q, k_cache, v_cache, *attn.decode_tables(), scale)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)
    assert torch.equal(got, direct)


def _causal_reference(q, k, v, scale: float, window: int = 0) -> torch.Tensor:
    """float64 causal attention of q [L, H, D] over k, v [S, KV, D], query i at S - L + i."""
    L, heads, _ = q.shape
    S, kv_heads, _ = k.shape
    group = heads // kv_heads
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("lhd,shd->hls", q.double(), keys) * scale
    pos, key = torch.arange(S - L, S).unsqueeze(1), torch.arange(S).unsqueeze(0)
    hidden = (key > pos) | ((key <= pos - window) if window else torch.zeros_like(key > pos))
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    return torch.einsum("hls,shd->lhd", probs, values).float()


@pytest.mark.parametrize("L,S,heads,kv_heads,head_dim,window", [
    (512, 512, 9, 3, 64, 0),    # SmolLM2's layer: a fresh 512-token prompt
    (37, 37, 4, 2, 32, 0),      # a ragged last query tile and key tile
    (20, 90, 6, 3, 64, 0),      # a chunk after a 70-token cached prefix
    (100, 100, 8, 8, 16, 0),    # no GQA, the smallest head dim
    (70, 150, 4, 1, 128, 33),   # a sliding window, one KV head
    (1, 1, 2, 1, 64, 0),
    (5, 5, 2, 2, 64, 3),
])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_kernel_matches_float64_reference(kernels, threads, L, S, heads, kv_heads,
                                                  head_dim, window, dtype, atol):
    g = torch.Generator().manual_seed(L + S)
    # q and k as slices of wider rows, as the fused qkv projection gives them.
    q = torch.randn(L, heads + 2, head_dim, generator=g).to(dtype)[:, :heads]
    k = torch.randn(S, kv_heads * 2, head_dim, generator=g).to(dtype)[:, ::2]
    v = torch.randn(S, kv_heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    got = kernels.prefill_attention(q, k, v, scale, window)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), _causal_reference(q, k, v, scale, window),
                               atol=atol, rtol=0)


@pytest.mark.parametrize("case", ["short_keys", "fp16", "mixed", "heads"])
def test_prefill_kernel_rejects_bad_inputs(kernels, case):
    q, k = torch.randn(8, 4, 64), torch.randn(8, 2, 64)
    if case == "short_keys":
        k = k[:5]
    elif case == "fp16":
        q, k = q.half(), k.half()
    elif case == "mixed":
        k = k.bfloat16()
    else:
        k = torch.randn(8, 3, 64)
    with pytest.raises(RuntimeError, match="prefill_attention"):
        kernels.prefill_attention(q, k, k.clone(), 0.125)


@pytest.mark.parametrize("max_context,kernel_rows", [(384, 56), (30, 3)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_attends_prefill_tokens_like_sdpa(kernels, threads, dtype, atol, max_context,
                                                 kernel_rows, monkeypatch):
    """A mixed step: 2 decodes, a chunk continuing a cached 37-token prefix, a fresh prompt
    (is_causal) and a one-token prompt; the kernel, token by token over each causal context,
    against the torch path's per-chunk SDPA. With a context limit of 30, the two longer chunks
    take the tiled prefill kernel and the decode kernel the other 3 rows."""
    monkeypatch.setattr(cpu_backends, "KERNEL_PREFILL_MAX_CONTEXT", max_context)
    g = torch.Generator().manual_seed(7)
    block_size, kv_heads, group, head_dim = 8, 2, 3, 64
    query_lens, seq_lens = [1, 1, 20, 33, 1], [12, 50, 57, 33, 1]
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + 5
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = [ids[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, q, n in zip(tables, query_lens, seq_lens) for p in range(n - q, n)]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tokens, heads = sum(query_lens), kv_heads * group
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    # This step's K/V as the pool holds them (the fused rotary op wrote them there).
    k = k_cache.view(-1, kv_heads, head_dim)[slots].clone()
    v = v_cache.view(-1, kv_heads, head_dim)[slots].clone()
    attn = AttentionMetadata.build(slot_mapping=slots, query_lens=query_lens, seq_lens=seq_lens,
                                   block_tables=tables, num_decodes=2, block_size=block_size)
    scale = head_dim ** -0.5
    expected = paged_attention(q, k, v, (k_cache, v_cache), attn, scale, torch_backend(),
                               kv_written=True)
    calls = _spy(monkeypatch, "paged_attention")
    tiled = _spy(monkeypatch, "prefill_attention")
    got = paged_attention(q, k, v, (k_cache, v_cache), attn, scale, kernels, kv_written=True)
    # One call for the kernel's rows, reading the step's block tables in place.
    calls = [(args[1].shape[0], args[4] is attn.block_tables) for args in calls]
    assert calls == [(kernel_rows, True)]
    # Chunks past the limit take the tiled prefill kernel.
    assert len(tiled) == (2 if max_context == 30 else 0)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 37, 200])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_kernel_splits_long_contexts(kernels, threads, dtype, atol, window):
    """Contexts past the kernel's part length are split into an even number of parts merged
    afterwards (1000 tokens: 8 parts; 580: 6 of unequal whole tiles; 300: 4); with a sliding
    window the parts start at the window's first token."""
    q, k_cache, v_cache, attn = _decode_batch(dtype, 3, 64, kv_heads=3, seed=4,
                                              lens=[1000, 580, 300, 17])
    expected = _decode(q, k_cache, v_cache, attn, 0.125, window)
    got = kernels.paged_attention(q, k_cache, v_cache, *attn.decode_tables(), 0.125, window)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_output_is_batch_invariant(kernels, dtype):
    """A sequence's output depends on its own context only: bitwise the same alone, in a batch
    and on any number of threads (the split of a long context depends on its length alone)."""
    q, k_cache, v_cache, attn = _decode_batch(dtype, 3, 64, seed=5)
    tables, lens = attn.decode_tables()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = kernels.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)
        torch.set_num_threads(1)
        for i in range(len(LENS)):
            alone = kernels.paged_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                            lens[i : i + 1], 0.125)
            assert torch.equal(alone[0], batch[i]), f"sequence {i} ({LENS[i]} tokens)"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_bf16_scores_by_dot_product_where_the_cpu_has_it(kernels, threads, head_dim):
    """AVX-512 builds score bf16 rows with AVX512_BF16's dot product where the CPU has it (head
    dims in whole 32-value registers; 80 keeps the widening path), else by widening them: both
    match the torch path, and the switch reports which the CPU runs."""
    has_dot = kernels.name != "avx2" and "avx512_bf16" in kernels.features.flags
    q, k_cache, v_cache, attn = _decode_batch(torch.bfloat16, 3, head_dim, kv_heads=3, seed=6,
                                              lens=[1000, 300, 17, 1])
    expected = _decode(q, k_cache, v_cache, attn, head_dim ** -0.5).float()
    try:
        for dot in (False, True):
            assert kernels.ops.set_bf16_dot(dot) == (dot and has_dot)
            got = kernels.paged_attention(q, k_cache, v_cache, *attn.decode_tables(),
                                          head_dim ** -0.5)
            torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=0)
    finally:
        kernels.ops.set_bf16_dot(True)


def test_decode_kernel_small_blocks_and_tiny_head_dim(kernels, threads):
    """block_size 4 puts several blocks in one kernel tile; head_dim 16 is the tiny models'."""
    q, k_cache, v_cache, attn = _decode_batch(torch.float32, 2, 16, block_size=4, seed=1)
    expected = _decode(q, k_cache, v_cache, attn, 0.25)
    got = kernels.paged_attention(q, k_cache, v_cache, *attn.decode_tables(), 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_decode_kernel_reads_rows_of_a_larger_table(kernels, threads):
    """With rows, query i reads row rows[i] of a table with more rows than queries (the
    worker's persistent table): the same output as a table of exactly those rows."""
    q, k_cache, v_cache, attn = _decode_batch(torch.float32, 2, 64, seed=2)
    tables, lens = attn.decode_tables()
    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, k_cache.shape[0], (3 * len(LENS), tables.shape[1] + 4), generator=g,
                        dtype=torch.int32)
    rows = torch.randperm(big.shape[0], generator=g)[: len(LENS)].to(torch.int32)
    big[rows.long(), : tables.shape[1]] = tables
    expected = kernels.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)
    got = kernels.paged_attention(q, k_cache, v_cache, big, lens, 0.125, rows=rows)
    assert torch.equal(got, expected)


def _bad_rows(value, dtype=torch.int32):
    def mutate(args):
        args["rows"] = torch.arange(len(LENS), dtype=dtype)
        args["rows"][2] = value
    return mutate


BAD_ROWS = {
    "row past table": (_bad_rows(len(LENS)), "rows\\[2\\] = 5 is not a row"),
    "negative row": (_bad_rows(-1), "rows\\[2\\] = -1"),
    "int64 rows": (_bad_rows(2, torch.int64), "rows must be"),
    "rows per query": (lambda a: a.update(rows=torch.arange(2, dtype=torch.int32)), "rows must be"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_decode_kernel_rejects_bad_rows(kernels, case):
    mutate, message = BAD_ROWS[case]
    args = _valid_inputs()
    args["rows"] = torch.arange(len(LENS), dtype=torch.int32)
    kernels.paged_attention(**args)
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.paged_attention(**args)


def _valid_inputs():
    q, k_cache, v_cache, attn = _decode_batch(torch.float32, 2, 64)
    block_tables, seq_lens = attn.decode_tables()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=seq_lens, scale=0.125)


def _bad_table(args):
    args["block_tables"] = args["block_tables"].clone()
    args["block_tables"][4, 2] = args["k_cache"].shape[0]


def _negative_block(args):
    args["block_tables"] = args["block_tables"].clone()
    args["block_tables"][0, 0] = -1


def _bad_len(value):
    def mutate(args):
        args["seq_lens"] = args["seq_lens"].clone()
        args["seq_lens"][1] = value
    return mutate


def _head_dim_40(args):
    nb, bs, kvh, _ = args["k_cache"].shape
    args["k_cache"], args["v_cache"] = torch.zeros(nb, bs, kvh, 40), torch.zeros(nb, bs, kvh, 40)
    args["q"] = torch.zeros(args["q"].shape[0], args["q"].shape[1], 40)


BAD_INPUTS = {
    "half dtype": (lambda a: a.update(q=a["q"].half(), k_cache=a["k_cache"].half(),
                                      v_cache=a["v_cache"].half()), "float32 or bfloat16"),
    "mixed dtypes": (lambda a: a.update(q=a["q"].bfloat16()), "share a dtype"),
    "strided pool": (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2).contiguous()
                                        .transpose(1, 2)), "contiguous"),
    "pool shapes differ": (lambda a: a.update(v_cache=a["v_cache"][:-1]), "!= k_cache"),
    "head_dim mismatch": (lambda a: a.update(q=a["q"][..., :32]), "head_dim"),
    "unsupported head_dim": (_head_dim_40, "unsupported head_dim 40"),
    "heads not a multiple": (lambda a: a.update(q=a["q"][:, :3]), "multiple of kv_heads"),
    "int64 tables": (lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
    "table rows": (lambda a: a.update(block_tables=a["block_tables"][:-1]), "block_tables"),
    "2-d q": (lambda a: a.update(q=a["q"][0]), "q must be"),
    "zero length": (_bad_len(0), "seq_lens\\[1\\] = 0"),
    "length past table": (_bad_len(10_000), "seq_lens\\[1\\] = 10000"),
    "block id past pool": (_bad_table, "block_tables\\[4, 2\\]"),
    "negative block id": (_negative_block, "block_tables\\[0, 0\\] = -1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_decode_kernel_rejects_bad_inputs(kernels, case):
    mutate, message = BAD_INPUTS[case]
    args = _valid_inputs()
    kernels.paged_attention(**args)  # the unmutated inputs are accepted
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.paged_attention(**args)


def test_concurrent_cold_builds_share_one_compile(tmp_path):
    """Two builders at once (TP ranks) into an empty folder holding a dead builder's torch baton:
    one compiles, the other waits and reuses it, and neither waits on the stale baton. The lock
    is the same whatever the ISA: one compile (avx2's, the quickest) shows it. Where the user
    cache has no avx2 folder yet (a fresh machine), the folder is the cache's own, so that this
    compile is the session's avx2 build (conftest runs this test first); else a fresh one."""
    if "avx2" not in KERNEL_ISAS:
        pytest.skip("this CPU (or TIERSERVE_CPU_ISA) runs no avx2 kernels")
    build_dir = build_dir_for(envs.cache_dir(), "avx2")
    try:
        build_dir.mkdir(parents=True)
    except FileExistsError:  # built, or being built: a cold folder of this test's own
        build_dir = tmp_path / "kernels"
        build_dir.mkdir()
    (build_dir / "lock").touch()
    isa = "avx2"
    cmd = [sys.executable, "-m", "tierserve.workers.backends.kernels", str(build_dir), isa]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    library = (build_dir / (build_dir / "ready").read_text()).resolve()
    assert {out.strip().splitlines()[-1] for out in outs} == {str(library)}
    assert library.is_file() and not (build_dir / "lock").exists()
    # .ninja_log: one "start end mtime output hash" line per command ninja ran.
    outputs = [line.split("\t")[3] for line in (build_dir / ".ninja_log").read_text().splitlines()
               if not line.startswith("#")]
    assert outputs.count("kernels.o") == 1


def test_build_dir_names_every_source_header_and_isa(tmp_path, monkeypatch):
    """An edit to any compiled file, shared header included, must lead to a fresh build folder:
    a stale cached library would otherwise keep serving the old code. Each ISA variant has a
    folder of its own, named after it."""
    from tierserve.workers.backends import kernels as kmod

    csrc = tmp_path / "csrc"
    shutil.copytree(kmod._CSRC, csrc)
    monkeypatch.setattr(kmod, "_CSRC", csrc)
    names = kmod._SOURCES + kmod._HEADERS
    assert "vec.h" in names
    assert {p.name for p in csrc.iterdir() if p.suffix in (".cpp", ".h")} == set(names)
    folders = {isa: build_dir_for(tmp_path, isa) for isa in kmod.ISA_CFLAGS}
    assert len(set(folders.values())) == len(folders)
    assert all(f"-{isa}-" in folder.name for isa, folder in folders.items())
    seen = {build_dir_for(tmp_path, "avx2")}
    for name in names:
        with open(csrc / name, "a") as f:
            f.write("\n// edited\n")
        seen.add(build_dir_for(tmp_path, "avx2"))
    assert len(seen) == len(names) + 1
    with pytest.raises(ValueError, match="no kernel variant"):
        build_dir_for(tmp_path, "sse2")


def test_cached_library_loads_at_once(kernels):
    """A variant already in the cache loads before start_build returns, background or not:
    whether an engine runs the kernels never depends on a loading thread's timing."""
    fresh = KernelLibrary(kernels.name)
    assert not fresh.available and not fresh.wait(0)
    fresh.start_build(envs.cache_dir())
    assert fresh.available and not fresh.building
    assert fresh.ops.build_isa() == kernels.name
    assert fresh.ops.panel_width() == kernels.panel_width == 2 * fresh.ops.vector_lanes()
    assert kernels.attends(torch.bfloat16, 64) and kernels.attends(torch.float32, 64)
    assert not kernels.attends(torch.float16, 64)
    assert not kernels.attends(torch.float32, 40)


def test_failed_build_falls_back_with_one_warning(kernels, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/bin/false")
    fresh = KernelLibrary(kernels.name)
    with caplog.at_level(logging.WARNING, logger="tierserve.kernels"):
        fresh.start_build(tmp_path / "broken", sync=True)
        fresh.start_build(tmp_path / "broken", sync=True)
    assert not fresh.available and not fresh.wait(0)
    assert "kernel build failed" in fresh.error
    assert len(caplog.records) == 1 and "using the torch path" in caplog.records[0].getMessage()
    assert not list((tmp_path / "broken").glob("kernels/*/ready"))


def _spy(monkeypatch, name: str) -> list:
    """Records the arguments (self first) of every call of CpuKernelBackend.`name`, which still
    runs, on any backend object, the engine's own included."""
    calls = []
    original = getattr(CpuKernelBackend, name)

    def spy(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(CpuKernelBackend, name, spy)
    return calls


@pytest.mark.parity
def test_engine_greedy_tokens_unchanged_with_kernel(kernels, tmp_path, monkeypatch):
    path = make_tiny_llama(tmp_path / "llama")
    hf = load_hf(path)
    prompts = [[(7 * i + 3) % 380 + 3 for i in range(n)] for n in (5, 40, 17, 3, 61)]
    references = [hf_greedy(hf, p, 10) for p in prompts]
    spied = _spy(monkeypatch, "paged_attention")
    stacked = []
    run = KernelLayerStack.run
    monkeypatch.setattr(KernelLayerStack, "run", lambda self, hidden, *a: stacked.append(
        (hidden.shape[0], run(self, hidden, *a) is not None)) or run(self, hidden, *a))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(path), block_size=4, cpu_isa=kernels.name) as llm:
        assert llm.stats()["cpu_backend"] == kernels.name
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references
    # The prompts' tokens through the kernels (each layer's, or the layer stack's: the same
    # kernels in one call), then 9 decode steps over the whole batch of 5 through the stack.
    assert {args[0].name for args in spied} <= {kernels.name}
    assert any(args[1].shape[0] > len(prompts) for args in spied) \
        or any(rows > len(prompts) and took for rows, took in stacked)
    assert stacked.count((len(prompts), True)) >= 9


@pytest.mark.parity
def test_engine_greedy_steps_skip_full_logits(kernels, tmp_path, monkeypatch):
    """Where the backend has the greedy head, plain greedy steps take the LM head's exact greedy
    route (no full fp32 logits) and give transformers' tokens; a step with a logprobs request
    computes the logits. Elsewhere the route is never taken."""
    path = make_tiny_llama(tmp_path / "llama")
    hf = load_hf(path)
    prompts = [[(5 * i + 2) % 380 + 3 for i in range(n)] for n in (9, 33, 4)]
    references = [hf_greedy(hf, p, 8) for p in prompts]
    routes = _spy(monkeypatch, "greedy_tokens")
    int8_routes = _spy(monkeypatch, "int8_greedy_tokens")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), block_size=4, cpu_isa=kernels.name) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == references
        if not kernels.greedy_head_route:
            assert routes == [] and int8_routes == []
            return
        # The int8 pass, where the CPU has it, takes every step; else the Q8_0 pass.
        assert len(int8_routes if kernels.int8_head else routes) >= 8
        assert (routes if kernels.int8_head else int8_routes) == []
        int8_routes.clear()
        routes.clear()
        with_logprobs = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
        out = llm.generate([prompts[0]], with_logprobs, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == references[0][:3]
        assert routes == [] and int8_routes == []
