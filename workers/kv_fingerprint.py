"""The KV fingerprint: one digest of everything a block's KV depends on besides its tokens.

SSD entries are named by it (workers/tier_ssd.py), so an engine only ever reads KV that its own
model would have computed: the same weights (by their bytes, not their file names or dates), the
model-config fields that change the KV, the KV dtype, the block size, the block hash (algorithm
and seed) and the entry format. A copied or moved checkpoint has the same fingerprint; a changed
weight or config field has another. The TP size is not in it: an entry names its head range.

Hashing the weights reads every byte once (xxh3-128); the digest of each file is cached under
the cache dir by absolute path, size, mtime and ctime (ctime cannot be set back by a user), so
later starts only stat the files.
"""
from __future__ import annotations

import json
import logging
import os
import threading

import xxhash

from tierserve.workers.model.config import ModelConfig
from tierserve.workers.tier_ssd import FORMAT_VERSION

__all__ = ["kv_fingerprint", "weights_digest", "weight_files", "KV_CONFIG_FIELDS"]

log = logging.getLogger("tierserve.kv_fingerprint")

# ModelConfig fields that change a block's KV (every layer's K and V depend on the layers
# below them, so anything in the stack up to the last layer's K/V projection counts). Not in
# it: tie_word_embeddings, token ids, max_position_embeddings (rope scaling carries what RoPE
# reads of it).
KV_CONFIG_FIELDS = (
    "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "attention_bias", "attention_output_bias", "mlp_bias", "sliding_window",
    "layer_types",
)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_CHUNK = 16 << 20
_CACHE_FILE = "weights-xxh3.json"
_cache_lock = threading.Lock()


def weight_files(model_path: str) -> list[str]:
    """The files holding the weights: a .gguf file, or a folder's weight files (sorted)."""
    if os.path.isfile(model_path):
        return [os.path.abspath(model_path)]
    return sorted(os.path.abspath(os.path.join(model_path, f)) for f in os.listdir(model_path)
                  if f.endswith(_WEIGHT_SUFFIXES))


def _file_key(path: str) -> str:
    st = os.stat(path)
    return f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _hash_file(path: str) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _load_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: str, cache: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir: the digest is computed again next time
        log.warning("could not cache the weights' digest in %s: %s", path, e)
        try:
            os.remove(tmp)
        except OSError:
            pass


def weights_digest(model_path: str, cache_dir: str | None) -> str:
    """xxh3-128 over the digests of the weight files' bytes (in name order)."""
    files = weight_files(model_path)
    if not files:
        raise ValueError(f"{model_path!r} holds no weight files")
    cache_path = os.path.join(cache_dir, "kv-fingerprint", _CACHE_FILE) if cache_dir else None
    with _cache_lock:
        cache = _load_cache(cache_path) if cache_path else {}
        digests, changed = [], False
        for path in files:
            key = _file_key(path)
            digest = cache.get(key)
            if digest is None:
                digest = cache[key] = _hash_file(path)
                changed = True
            digests.append(digest)
        if changed and cache_path:
            # Entries of files that no longer exist with these stats are dropped.
            live = {k: v for k, v in cache.items() if _still(k)}
            _save_cache(cache_path, live)
    return xxhash.xxh3_128_hexdigest("\n".join(digests).encode())


def _still(key: str) -> bool:
    path = key.split("|", 1)[0]
    try:
        return _file_key(path) == key
    except OSError:
        return False


def kv_fingerprint(model_path: str, config: ModelConfig, *, dtype: str, block_size: int,
                   hash_id: str, cache_dir: str | None, quantization: str | None = None) -> str:
    """The fingerprint (hex) of the KV this model computes with these settings (weights
    quantized at load compute other KV than the stored ones)."""
    fields = {name: getattr(config, name) for name in KV_CONFIG_FIELDS}
    what = {"format": FORMAT_VERSION, "weights": weights_digest(model_path, cache_dir),
            "config": fields, "dtype": dtype, "block_size": block_size, "hash": hash_id}
    if quantization is not None:
        what["quantization"] = quantization
    blob = json.dumps(what, sort_keys=True, default=repr)
    return xxhash.xxh3_128_hexdigest(blob.encode())
