"""vLLM's engine arguments that are not tierserve options, so that code and command lines
written for vLLM run unchanged where they ask for what tierserve does anyway.

A value that asks for tierserve's own behaviour is accepted and dropped (`kv_cache_dtype="auto"`,
`trust_remote_code=True`: no checkpoint code ever runs here); `distributed_executor_backend=
"ray"` becomes `distributed=True`; any other value is a ValueError saying what tierserve does
and which option to use instead. EngineConfig.from_kwargs applies it, so `LLM(...)`, `serve`
and every CLI command (whose flags for these come from VLLM_ARGS too) share it. `revision` and
`download_dir` pick a model named by its Hub id in the local cache (runtime/hub_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VLLM_ARGS", "VllmArg", "resolve_vllm_args"]


@dataclass(frozen=True)
class VllmArg:
    accepts: tuple    # the values that ask for what tierserve does
    meaning: str      # what tierserve does: the refusal's reason and the flag's help
    kind: type        # the value's type (the CLI flag's)


VLLM_ARGS: dict[str, VllmArg] = {
    "kv_cache_dtype": VllmArg(("auto",), "the KV cache is kept in the model's dtype "
                              "(dtype)", str),
    "enable_chunked_prefill": VllmArg((True,), "prompts are always prefilled in chunks of at "
                                      "most max_num_batched_tokens", bool),
    "pipeline_parallel_size": VllmArg((1,), "a model is split by tensor parallelism only "
                                      "(tensor_parallel_size)", int),
    "tokenizer_mode": VllmArg(("auto",), "the model's own tokenizer is used (its "
                              "tokenizer.json, or the GGUF file's)", str),
    "trust_remote_code": VllmArg((False, True), "no code from a checkpoint ever runs: the "
                                 "architectures are tierserve's own", bool),
    "disable_log_stats": VllmArg((True,), "the engine logs no periodic stats: stats(), "
                                 "`tierserve status` and /metrics report them", bool),
    "max_logprobs": VllmArg((20,), "a request's logprobs and prompt_logprobs are at most 20",
                            int),
    "swap_space": VllmArg((0, 0.0), "a preempted request's KV goes to the CPU tier "
                          "(kv_offload_cpu_bytes) or is recomputed (preemption_mode)", float),
    "cpu_offload_gb": VllmArg((0, 0.0), "the weights stay in the device's memory", float),
    "distributed_executor_backend": VllmArg((None, "ray"), "tensor-parallel ranks run as Ray "
                                            "actors: 'ray' means distributed=True", str),
}


def _accepted(value, accepts: tuple) -> bool:
    # By type as well as value: True == 1, and pipeline_parallel_size=True is no size.
    return any(value == a and (type(value) is type(a) or
                               {type(value), type(a)} == {int, float}) for a in accepts)


def resolve_vllm_args(options: dict) -> dict:
    """`options` without vLLM's names in VLLM_ARGS; ValueError for a value tierserve does not
    do, naming what it does instead."""
    out = {k: v for k, v in options.items() if k not in VLLM_ARGS}
    for name in options.keys() & VLLM_ARGS.keys():
        value, arg = options[name], VLLM_ARGS[name]
        if not _accepted(value, arg.accepts):
            allowed = " or ".join(repr(a) for a in arg.accepts if not isinstance(a, float))
            raise ValueError(f"{name}={value!r} is not supported (only {allowed}): "
                             f"{arg.meaning}")
        if name == "distributed_executor_backend" and value == "ray":
            if out.get("distributed") is False:
                raise ValueError("distributed_executor_backend='ray' contradicts "
                                 "distributed=False")
            out["distributed"] = True
    return out
