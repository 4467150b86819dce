"""The sampling defaults a model ships (vLLM's `--generation-config`).

A request leaves a sampling field unset; the engine's defaults fill it, and SamplingParams'
own (vLLM's) fill the rest. The defaults come from `generation_config`:

- "auto": the model's own: `generation_config.json` in an HF folder; a GGUF file's
  `general.sampling.*` metadata (llama.cpp's keys); for the default model, whose GGUF carries
  none, the values its model card recommends.
- "vllm": none (SamplingParams' defaults: temperature 1, no top-p / top-k, 16 tokens).
- a folder: its `generation_config.json`.

Only the fields vLLM takes from a generation config are read: temperature, top_p, top_k,
min_p, repetition_penalty and max_new_tokens (as max_tokens).
"""
from __future__ import annotations

import os

from tierserve.scheduler.params import SamplingParams
from tierserve.workers.model.config_files import read_json_object

__all__ = ["generation_defaults", "generation_overrides", "sampling_params_with",
           "generation_eos_ids", "GENERATION_CONFIG_HELP"]

GENERATION_CONFIG_HELP = (
    "where unset sampling parameters come from: auto: the model's generation_config.json "
    "(a GGUF's general.sampling.* metadata); vllm: vLLM's defaults (temperature 1, 16 "
    "tokens); or a folder holding a generation_config.json")

_HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "min_p": "min_p", "repetition_penalty": "repetition_penalty",
              "max_new_tokens": "max_tokens"}
_GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                "general.sampling.penalty_repeat": "repetition_penalty"}
_INT_FIELDS = ("top_k", "max_tokens")


def generation_overrides(values: dict) -> dict:
    """vLLM's override_generation_config: generation-config fields (their names: temperature,
    top_p, top_k, min_p, repetition_penalty, max_new_tokens) that replace the model's."""
    if not isinstance(values, dict):
        raise ValueError(f"override_generation_config must be a dict, got {values!r}")
    unknown = sorted(set(values) - set(_HF_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown field(s) {', '.join(unknown)}; "
                         f"it takes {', '.join(_HF_FIELDS)}")
    typed = _typed({_HF_FIELDS[k]: v for k, v in values.items()})
    try:
        SamplingParams(**typed)
    except ValueError as e:
        raise ValueError(f"override_generation_config: {e}") from None
    return dict(values)


def generation_defaults(source: str, model_path: str, overrides: dict | None = None) -> dict:
    """The sampling defaults `source` gives for the model at `model_path`, with `overrides`
    (generation_overrides') replacing theirs (a ValueError names a folder without a readable
    generation_config.json, or values SamplingParams refuses)."""
    defaults = _source_defaults(source, model_path)
    if overrides:
        defaults.update(_typed({_HF_FIELDS[k]: v for k, v in overrides.items()}))
    return defaults


def generation_eos_ids(source: str, model_path: str) -> tuple[int, ...] | None:
    """The end-of-sequence ids the generation config names (an instruct model's end of turn
    beside the tokenizer's eos), which every request stops at, as vLLM's do; None where no
    generation_config.json names any (then config.json's count). "vllm" still reads the
    model's, as vLLM does: it sets sampling defaults aside, not the model's special tokens."""
    folder = model_path if source in ("auto", "vllm") else source
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isdir(folder) or not os.path.isfile(path):
        return None
    value = read_json_object(path, "generation_config").get("eos_token_id")
    if value is None:
        return None
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"generation_config: eos_token_id must be a token id or a list of "
                         f"them, got {value!r}")
    return tuple(ids)


def _source_defaults(source: str, model_path: str) -> dict:
    if source == "vllm":
        return {}
    if source == "auto":
        if os.path.isdir(model_path):
            path = os.path.join(model_path, "generation_config.json")
            defaults = _read_hf(path) if os.path.isfile(path) else {}
        else:
            defaults = _read_gguf(model_path) or _default_model_record(model_path)
    else:
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"generation_config: {source!r} holds no generation_config.json "
                             f"(give 'auto', 'vllm' or such a folder)")
        defaults = _read_hf(path)
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"generation_config: the defaults from {source!r} are not valid "
                         f"sampling parameters: {e}") from None
    return defaults


def _read_hf(path: str) -> dict:
    raw = read_json_object(path, "generation_config")
    return _typed({ours: raw[theirs] for theirs, ours in _HF_FIELDS.items()
                   if raw.get(theirs) is not None})


def _default_model_record(path: str) -> dict:
    from tierserve.workers.model.loader import DEFAULT_GENERATION_CONFIG, default_model_path
    try:
        is_default = os.path.samefile(path, default_model_path())
    except OSError:
        return {}
    return dict(DEFAULT_GENERATION_CONFIG) if is_default else {}


def _read_gguf(path: str) -> dict:
    from tierserve.workers.model.gguf_file import open_gguf
    fields = open_gguf(path).fields
    return _typed({ours: fields[key] for key, ours in _GGUF_FIELDS.items() if key in fields})


def _typed(values: dict) -> dict:
    """JSON and GGUF numbers as SamplingParams takes them (ints for counts, else floats)."""
    out = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"generation_config: {name} must be a number, got {value!r}")
        out[name] = int(value) if name in _INT_FIELDS else float(value)
    return out


def sampling_params_with(defaults: dict, **given) -> SamplingParams:
    """SamplingParams of the fields given (None: unset), unset ones from `defaults`."""
    fields = dict(defaults)
    fields.update({k: v for k, v in given.items() if v is not None})
    return SamplingParams(**fields)
