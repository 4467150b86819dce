"""LoRA adapters as users name them (vLLM's LoRARequest, the lora_modules option) and as the
engine admits them (AdapterCatalog, at its door).

An adapter is a PEFT folder. Its digest, an xxh64 of its two files, is what keys its KV in the
prefix cache and the SSD tier and what the ranks load it by, so two folders never share KV
and an adapter rewritten in place is a new adapter; the user's lora_int_id only names it.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

import xxhash

from tierserve.scheduler.params import LoRARef
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.lora_files import (
    adapter_weights_file, projection_shapes, read_adapter,
)

__all__ = ["LoRARequest", "LoRAModules", "AdapterCatalog", "adapter_catalog", "lora_ref",
           "adapter_digest"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, id (> 0; one id is one folder for an engine's life) and
    folder (PEFT's adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or not 0 < self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be an int > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the adapter's folder, got {self.lora_path!r}")


def lora_ref(request: LoRARequest | None) -> LoRARef | None:
    """The wire form of a user's LoRARequest (None: the base model)."""
    if request is None:
        return None
    if not isinstance(request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
    return LoRARef(request.lora_int_id, request.lora_name,
                   os.path.abspath(os.path.expanduser(request.lora_path)))


@dataclass(frozen=True)
class LoRAModules:
    """The lora_modules option: named adapters, {name: folder}, numbered 1, 2, ... in order;
    an HTTP request's `model` picks one by name."""

    modules: tuple[LoRARequest, ...]

    @classmethod
    def parse(cls, value) -> "LoRAModules":
        """From {name: folder}, or from the command line's words (vLLM's): name=folder, or
        a JSON object {"name": ..., "path": ...}."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(w, str) for w in value):
            value = dict(map(_module_word, value))
        if not isinstance(value, dict) or not value:
            raise ValueError("lora_modules must be a non-empty dict {name: adapter folder}, "
                             f"got {value!r}")
        found = []
        for i, (name, path) in enumerate(value.items(), start=1):
            if not isinstance(path, str) or not os.path.isdir(os.path.expanduser(path)):
                raise ValueError(f"lora_modules: {name!r}: {path!r} is not a folder")
            found.append(LoRARequest(name, i, os.path.abspath(os.path.expanduser(path))))
        return cls(tuple(found))

    def named(self, name: str) -> LoRARequest | None:
        return next((m for m in self.modules if m.lora_name == name), None)


def _module_word(word: str) -> tuple[str, str]:
    if word.lstrip().startswith("{"):
        try:
            entry = json.loads(word)
        except ValueError as e:
            raise ValueError(f"lora_modules: {word!r} is not JSON: {e}") from None
        if not isinstance(entry, dict) or not {"name", "path"} <= set(entry):
            raise ValueError(f"lora_modules: {word!r} needs name and path")
        return entry["name"], entry["path"]
    name, sep, path = word.partition("=")
    if not sep or not name:
        raise ValueError(f"lora_modules: {word!r} is not name=folder")
    return name, path


class AdapterCatalog:
    """The engine's door for adapters: each one's folder checked against the model (every
    tensor's name and shape, the options the layers run) and digested once per content; an id
    that comes back with another folder, or a folder that no longer checks, is refused."""

    def __init__(self, model: ModelConfig, max_lora_rank: int) -> None:
        self.num_layers = model.num_hidden_layers
        self.shapes = projection_shapes(model.hidden_size, model.num_attention_heads,
                                        model.num_key_value_heads, model.head_dim,
                                        model.intermediate_size)
        self.max_rank = max_lora_rank
        self._paths: dict[int, str] = {}  # lora_id -> folder
        self._checked: dict[str, tuple] = {}  # folder -> its files' stats when checked

    def describe(self) -> dict:
        """What another process needs to check an adapter as this door does (read_adapter's
        arguments): the server checks one it is asked to add."""
        return {"num_layers": self.num_layers, "shapes": {k: list(v) for k, v in
                                                           self.shapes.items()},
                "max_lora_rank": self.max_rank}

    def admit(self, ref: LoRARef) -> LoRARef:
        """The ref with its digest; ValueError for a bad adapter or a reused id."""
        if not isinstance(ref, LoRARef) or type(ref.lora_id) is not int or ref.lora_id <= 0 \
                or not isinstance(ref.path, str) or not isinstance(ref.name, str):
            raise ValueError(f"lora must name an adapter by an int id > 0 and a folder, got "
                             f"{ref!r}")
        path = os.path.abspath(ref.path)
        known = self._paths.get(ref.lora_id)
        if known is not None and known != path:
            raise ValueError(f"lora_int_id {ref.lora_id} is the adapter in {known!r}; "
                             f"{ref.name!r} in {path!r} needs an id of its own")
        digest = self._digest(path)
        self._paths[ref.lora_id] = path
        return LoRARef(ref.lora_id, ref.name, path, digest)

    def _digest(self, path: str) -> int:
        stats = _file_stats(path)
        checked = self._checked.get(path)
        if checked != stats:
            read_adapter(path, num_layers=self.num_layers, shapes=self.shapes,
                         max_rank=self.max_rank)
            self._checked[path] = stats
        return adapter_digest(path)


def _files(path: str) -> tuple[str, str]:
    return os.path.join(path, "adapter_config.json"), adapter_weights_file(path)


def _file_stats(path: str) -> tuple:
    try:
        return tuple((s.st_size, s.st_mtime_ns) for s in map(os.stat, _files(path)))
    except OSError as e:
        raise ValueError(f"LoRA adapter {path!r}: {e.strerror or e}: "
                         f"{os.path.basename(e.filename or '')}") from None


_digests: dict[str, tuple[tuple, int]] = {}  # folder -> (its files' stats, digest)
_digests_lock = threading.Lock()


def adapter_digest(path: str) -> int:
    """The digest of the adapter in folder `path` (> 0), read once per content per process:
    what the engine keys the adapter's KV by, and what a router hashes its prompts with."""
    stats = _file_stats(path)
    with _digests_lock:
        cached = _digests.get(path)
    if cached is not None and cached[0] == stats:
        return cached[1]
    h = xxhash.xxh64()
    for file in _files(path):
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    digest = (h.intdigest() & (2**63 - 1)) or 1  # 0 stands for the base model on the ranks
    with _digests_lock:
        _digests[path] = (stats, digest)
    return digest


def adapter_catalog(config, model: ModelConfig) -> AdapterCatalog | None:
    """An engine's LoRA door (None: enable_lora is off), with its lora_modules checked
    through it: a bad one is a ValueError naming the option."""
    if not config.enable_lora:
        return None
    catalog = AdapterCatalog(model, config.max_lora_rank)
    try:
        for m in config.lora_modules.modules if config.lora_modules else ():
            catalog.admit(lora_ref(m))
    except ValueError as e:
        raise ValueError(f"lora_modules: {e}") from None
    return catalog
