"""LoRA adapters (enable_lora, LoRARequest, lora_modules): a request run with a PEFT adapter
gives the greedy tokens of transformers with that adapter merged into the weights, beside
requests of other adapters and of the base model in the same steps, under chunked prefill,
prefix hits, preemption and TP=2; adapters never share KV; a bad adapter fails its own request
alone; the scheduler runs at most max_loras adapters at once."""
import json
import shutil

import pytest

import httpx
import openai

from tests.checkpoints import (
    add_tiny_tokenizer, hf_greedy, load_hf, load_hf_with_lora, make_lora_adapter,
    make_tiny_llama,
)
from tests.http_thread import MODEL, Server
from tests.sched_driver import make_scheduler
from tierserve import LLM, AsyncLLM, LoRARequest, SamplingParams
from tierserve.runtime.lora import LoRAModules
from tierserve.scheduler.params import LoRARef
from tierserve.workers.backends.stack import KernelLayerStack

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(10, 47)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A tiny Llama, two adapters (every projection at rank 8; q and v at rank 4, rsLoRA) and
    transformers' greedy tokens for each prompt with each adapter merged (None: the base)."""
    root = tmp_path_factory.mktemp("lora")
    base = add_tiny_tokenizer(make_tiny_llama(root / "base"))
    paths = {"all": make_lora_adapter(base, root / "all"),
             "qv": make_lora_adapter(base, root / "qv", targets=("q_proj", "v_proj"), rank=4,
                                     seed=1, std=0.3, use_rslora=True)}
    models = {None: load_hf(base), **{k: load_hf_with_lora(base, p) for k, p in paths.items()}}
    refs = {k: [hf_greedy(m, p, GREEDY.max_tokens) for p in PROMPTS] for k, m in models.items()}
    assert refs["all"] != refs[None] and refs["qv"] != refs[None], "the adapters change nothing"
    requests = {"all": LoRARequest("all", 1, str(paths["all"])),
                "qv": LoRARequest("qv", 2, str(paths["qv"])), None: None}
    return {"base": base, "root": root, "paths": paths, "refs": refs, "requests": requests}


def _tokens(llm, prompts, adapters) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=adapters)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs]


def _mixed(lora):
    """Every prompt with every adapter and the base, in one batch, adapters interleaved."""
    keys = [k for p in PROMPTS for k in ("all", None, "qv")]
    prompts = [p for p in PROMPTS for _ in range(3)]
    want = [lora["refs"][k][PROMPTS.index(p)] for p, k in zip(prompts, keys)]
    return prompts, [lora["requests"][k] for k in keys], want


@pytest.mark.parity
def test_adapters_equal_peft_merged_in_one_batch(lora, backend, monkeypatch):
    """Mixed steps run layer by layer (the adapters stacked); steps of one adapter alone run
    it in the kernel backends' layer stack (counted), with the same tokens."""
    stacked = []
    run = KernelLayerStack.run

    def counting(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        stacked.append(out is not None and bool(kwargs.get("lora", args[6:7] or [None])[0]))
        return out

    monkeypatch.setattr(KernelLayerStack, "run", counting)
    prompts, adapters, want = _mixed(lora)
    with LLM(str(lora["base"]), cpu_isa=backend.name, block_size=4, enable_lora=True,
             max_loras=2) as llm:
        assert _tokens(llm, prompts, adapters) == want
        for key in ("all", "qv"):
            assert _tokens(llm, PROMPTS, lora["requests"][key]) == lora["refs"][key]
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert any(stacked) == (backend.name != "torch"), stacked


def test_layer_stack_runs_adapters_bitwise_as_the_layers(lora, kernels):
    """The kernel backends' layer stack takes steps with adapters (one on every row, or
    several and the base model) and gives the layer-by-layer path's logprobs bit for bit."""
    prompts, adapters, _ = _mixed(lora)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    with LLM(str(lora["base"]), cpu_isa=kernels.name, block_size=4, enable_lora=True,
             max_loras=2, enable_prefix_caching=False) as llm:
        model = llm.engine.executor.worker.model.model
        runs = []
        for stack in (True, False):
            model.use_layer_stack = stack
            outs = [o for batch, loras in ((prompts, adapters), (PROMPTS, lora["requests"]["all"]))
                    for o in llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                          use_tqdm=False, lora_request=loras)]
            runs.append([[sorted((t, lp.logprob) for t, lp in step.items())
                          for step in o.outputs[0].logprobs] for o in outs])
        assert runs[0] == runs[1]


def test_chunked_prefill_prefix_hits_and_preemption(lora):
    """Small steps chunk the prompts; a tiny pool preempts; the second pass finds each
    adapter's own blocks cached (and only its own: the tokens still equal the reference)."""
    prompts, adapters, want = _mixed(lora)
    with LLM(str(lora["base"]), block_size=4, enable_lora=True, max_loras=2,
             max_num_batched_tokens=16, long_prefill_token_threshold=8, num_kv_blocks=40,
             max_model_len=64) as llm:
        for _ in range(2):
            assert _tokens(llm, prompts, adapters) == want
        assert llm.stats()["num_preemptions"] > 0


def test_adapters_never_share_kv(lora):
    """The same prompt under the base model, one adapter, then the other: no hit across them;
    the same prompt with the same adapter again: a hit, and the same tokens."""
    prompt = PROMPTS[1]
    with LLM(str(lora["base"]), block_size=4, enable_lora=True) as llm:
        cached = []
        for key in (None, "all", "qv", "all"):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False,
                               lora_request=lora["requests"][key])[0]
            assert list(out.outputs[0].token_ids) == lora["refs"][key][1]
            cached.append(out.num_cached_tokens)
        assert cached[:3] == [0, 0, 0] and cached[3] > 0, cached


def test_tiers_keep_adapters_apart(lora, tmp_path):
    """An adapter's blocks, flushed to the SSD tier at shutdown, come back in a second engine
    on that folder for that adapter alone (its digest is the same in every process), never
    for the base model or the other adapter."""
    cpu_block = 2 * 3 * 4 * 2 * 16 * 4  # K and V, 3 layers, 4 tokens, 2 KV heads of 16, fp32
    options = dict(block_size=4, num_kv_blocks=40, max_model_len=64, enable_lora=True,
                   kv_offload_cpu_bytes=20 * cpu_block, kv_offload_ssd_path=str(tmp_path),
                   kv_offload_ssd_bytes=400 * cpu_block)
    prompt = {"prompt_token_ids": PROMPTS[1]}

    def run(llm, key):
        out = llm.generate([prompt], GREEDY, use_tqdm=False,
                           lora_request=lora["requests"][key])[0]
        assert list(out.outputs[0].token_ids) == lora["refs"][key][1], key
        return out.num_cached_tokens

    with LLM(str(lora["base"]), **options) as llm:
        assert run(llm, "all") == 0
    with LLM(str(lora["base"]), **options) as llm:
        assert run(llm, None) == 0 and run(llm, "qv") == 0
        assert run(llm, "all") > 0
        assert llm.stats()["tier_loads"] > 0


def test_one_loaded_adapter_at_a_time(lora, tmp_path):
    """max_loras=1, max_cpu_loras=1: two adapters' requests take turns, each rank reloading
    the one it dropped; an adapter copied to a new folder is the same digest, same tokens."""
    copy = shutil.copytree(lora["paths"]["qv"], tmp_path / "qv-copy")
    with LLM(str(lora["base"]), block_size=4, enable_lora=True, max_loras=1) as llm:
        prompts, adapters, want = _mixed(lora)
        assert _tokens(llm, prompts, adapters) == want
        again = LoRARequest("qv-copy", 3, str(copy))
        assert _tokens(llm, PROMPTS, again) == lora["refs"]["qv"]


def _bad_adapter(lora, tmp_path, name: str, edit) -> LoRARequest:
    path = shutil.copytree(lora["paths"]["qv"], tmp_path / name)
    edit(path)
    return LoRARequest(name, 50 + len(name), str(path))


def _config_edit(**changes):
    def edit(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return edit


def test_bad_adapters_fail_their_request_alone(lora, tmp_path):
    other = make_tiny_llama(tmp_path / "wide", hidden_size=96, num_heads=6, num_kv_heads=2)
    bad = {
        "no folder": (LoRARequest("gone", 40, str(tmp_path / "gone")), "adapter_config.json"),
        "rank": (_bad_adapter(lora, tmp_path, "r64", _config_edit(r=64)), "above max_lora_rank"),
        "dora": (_bad_adapter(lora, tmp_path, "dora", _config_edit(use_dora=True)), "DoRA"),
        "shape": (LoRARequest("wide", 41, str(make_lora_adapter(other, tmp_path / "wide-a"))),
                  "expected a float tensor of shape"),
        "not safetensors": (_bad_adapter(
            lora, tmp_path, "pickle",
            lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x00" * 4)),
            "not a safetensors file"),
        "id reused": (LoRARequest("other", 1, str(lora["paths"]["qv"])), "needs an id of its own"),
    }
    with LLM(str(lora["base"]), block_size=4, enable_lora=True, max_lora_rank=16) as llm:
        good = lora["requests"]["all"]
        for case, (request, message) in bad.items():
            outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, use_tqdm=False,
                                lora_request=[good, request])
            assert outs[0].error is None and list(outs[0].outputs[0].token_ids) == \
                lora["refs"]["all"][0], case
            assert outs[1].error is not None and message in outs[1].error, (case, outs[1].error)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    with LLM(str(lora["base"]), block_size=4) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=good)[0]
        assert "enable_lora" in out.error


def test_options_are_checked(lora):
    with pytest.raises(ValueError, match="needs enable_lora"):
        LLM(str(lora["base"]), lora_modules={"all": str(lora["paths"]["all"])})
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(lora["base"]), enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="is not a folder"):
        LLM(str(lora["base"]), enable_lora=True, lora_modules={"x": "/nonexistent"})
    with pytest.raises(ValueError, match="lora_modules: .* above max_lora_rank 4"):
        LLM(str(lora["base"]), enable_lora=True, max_lora_rank=4,
            lora_modules={"all": str(lora["paths"]["all"])})
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    # The command line's words, vLLM's two forms; ids in order from 1.
    words = [f"all={lora['paths']['all']}",
             json.dumps({"name": "qv", "path": str(lora["paths"]["qv"])})]
    modules = LoRAModules.parse(words).modules
    assert [(m.lora_name, m.lora_int_id) for m in modules] == [("all", 1), ("qv", 2)]
    for bad, why in ((["all"], "not name=folder"), (['{"name": "x"}'], "needs name and path")):
        with pytest.raises(ValueError, match=why):
            LoRAModules.parse(bad)


def test_scheduler_runs_at_most_max_loras_adapters():
    """Head of line: a request of a third adapter waits while two others run, and runs once
    one of theirs finishes; base-model requests are never held."""
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.max_loras = sched._admission.max_loras = 2
    refs = [LoRARef(i, f"a{i}", f"/a{i}", digest=100 + i) for i in (1, 2, 3)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, ref in enumerate([refs[0], refs[1], refs[0], refs[2], None]):
        sched.add_request(f"r{i}", [1, 2, 3, 4 + i], params, lora=ref)
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r0", "r1", "r2"]
    assert [n.lora.digest for n in out.scheduled_new_reqs] == [101, 102, 101]
    sched.finish_requests(["r1"], sched.requests["r1"].status.FINISHED_ABORTED)
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r3", "r4"]


@pytest.mark.usefixtures("ray_session")
def test_tp2_on_ray(lora):
    """Each rank holds its shard of an adapter (B's rows of a column-parallel projection, A's
    columns of a row-parallel one, whose partial deltas join the all-reduce)."""
    prompts, adapters, want = _mixed(lora)
    with LLM(str(lora["base"]), tensor_parallel_size=2, block_size=4, enable_lora=True,
             max_loras=2) as llm:
        assert _tokens(llm, prompts, adapters) == want


def test_http_model_names_pick_adapters(lora):
    """lora_modules over HTTP (vLLM's): /v1/models lists each adapter with the base model as
    its parent; a body's model field runs its adapter; an unknown name is a 404."""
    modules = {k: str(p) for k, p in lora["paths"].items()}
    engine = AsyncLLM(str(lora["base"]), block_size=4, enable_lora=True, max_loras=2,
                      lora_modules=modules)
    try:
        with Server(engine) as srv:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="-", max_retries=0)
            cards = {m.id: m for m in client.models.list().data}
            assert set(cards) == {MODEL, "all", "qv"}
            assert cards["qv"].parent == MODEL and cards["qv"].root == modules["qv"]
            tok = engine.tokenizer
            for name in ("all", "qv", MODEL):
                reply = client.completions.create(
                    model=name, prompt=PROMPTS[2], max_tokens=GREEDY.max_tokens,
                    temperature=0, extra_body={"ignore_eos": True})
                want = lora["refs"][None if name == MODEL else name][2]
                assert reply.model == name
                assert reply.choices[0].text == tok.decode(want, skip_special_tokens=True)
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                client.completions.create(model="nope", prompt="a", max_tokens=2)
            metrics = httpx.get(srv.base + "/metrics").text
            assert 'tierserve:lora_requests_info{max_lora="2",running_lora_adapters="",' \
                   'waiting_lora_adapters=""} 1.0' in metrics, metrics
    finally:
        engine.shutdown()


def test_adapters_added_and_removed_at_run_time(lora):
    """--allow-runtime-lora-updating (vLLM's routes): an added adapter serves by its name; a
    bad one, a taken name or an unknown one is refused; removed, its name is a 404. Without
    the flag the routes do not exist."""
    engine = AsyncLLM(str(lora["base"]), block_size=4, enable_lora=True, max_loras=2)
    try:
        with Server(engine) as srv:
            assert httpx.post(srv.base + "/v1/load_lora_adapter", json={
                "lora_name": "qv", "lora_path": str(lora["paths"]["qv"])}).status_code == 404
        with Server(engine, allow_runtime_lora_updating=True) as srv:
            def post(route, **body):
                return httpx.post(f"{srv.base}/v1/{route}_lora_adapter", json=body)
            reply = post("load", lora_name="qv", lora_path=str(lora["paths"]["qv"]))
            assert reply.status_code == 200 and "added" in reply.text, reply.text
            for body, status, why in (
                    (dict(lora_name="qv", lora_path=str(lora["paths"]["all"])), 400, "already"),
                    (dict(lora_name="x", lora_path=str(lora["root"] / "none")), 400,
                     "adapter_config.json"),
                    (dict(lora_name="y"), 400, "lora_path")):
                reply = post("load", **body)
                assert reply.status_code == status and why in reply.text, reply.text
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="-", max_retries=0)
            assert "qv" in {m.id for m in client.models.list().data}
            reply = client.completions.create(model="qv", prompt=PROMPTS[0], temperature=0,
                                              max_tokens=GREEDY.max_tokens,
                                              extra_body={"ignore_eos": True})
            tok = engine.tokenizer
            assert reply.choices[0].text == tok.decode(lora["refs"]["qv"][0],
                                                       skip_special_tokens=True)
            assert post("unload", lora_name="qv").status_code == 200
            assert post("unload", lora_name="qv").status_code == 404
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="qv", prompt="a", max_tokens=2)
    finally:
        engine.shutdown()
