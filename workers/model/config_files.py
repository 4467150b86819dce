"""A checkpoint's ModelConfig, from a Hugging Face folder's config.json or a GGUF file's
metadata, without torch: what reads a model's shape (the engine's process, `tierserve
analyze`) imports this, not the loader."""
from __future__ import annotations

import json
import os

from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.gguf_file import GGUFFile, open_gguf

__all__ = ["load_model_config", "read_json_object"]


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in file `path`; ValueError naming `what` (the file's role) where it
    cannot be read or holds no object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: {path} is not a JSON object")
    return value


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_model_config(path: str) -> ModelConfig:
    """Config of an HF model folder (config.json) or a .gguf file (its metadata)."""
    path = os.fspath(path)
    if _is_gguf(path):
        return _gguf_config(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")
    with open(config_file, encoding="utf-8") as f:
        return ModelConfig.from_hf_config(json.load(f))


def _gguf_file(path: str) -> GGUFFile:
    """Config and weight loading (and the tokenizer, in the same process) share one parse; tensor
    data stays memory-mapped."""
    return open_gguf(path)


def _gguf_config(path: str) -> ModelConfig:
    gguf_file = _gguf_file(path)
    arch = gguf_file.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2, "
                         f"qwen3)")
    tensors = {t.name: t for t in gguf_file.tensors}
    if "rope_freqs.weight" in tensors:
        raise NotImplementedError(f"{path}: GGUF rope frequency factors (llama3 rope scaling) are not supported")
    hidden = int(gguf_file.get(f"{arch}.embedding_length"))
    heads = int(gguf_file.get(f"{arch}.attention.head_count"))
    head_dim = int(gguf_file.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(gguf_file.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise NotImplementedError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    eos = gguf_file.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(gguf_file.get(f"{arch}.vocab_size", tensors["token_embd.weight"].shape[0])),
        hidden_size=hidden,
        intermediate_size=int(gguf_file.get(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(gguf_file.get(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(gguf_file.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(gguf_file.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_file.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(gguf_file, arch),
        max_position_embeddings=int(gguf_file.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        attention_output_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=gguf_file.get(f"{arch}.attention.sliding_window"),
        bos_token_id=gguf_file.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _gguf_rope_scaling(gguf_file: GGUFFile, arch: str):
    kind = gguf_file.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return (("factor", float(gguf_file.get(f"{arch}.rope.scaling.factor"))), ("rope_type", "linear"))
    raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported")
