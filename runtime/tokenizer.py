"""Tokenizer loading (Hugging Face folder or GGUF file) behind one small wrapper.

A GGUF file carries its tokenizer in metadata (tokenizer.ggml.*: model type, tokens, merges,
special ids, chat template). transformers converts it, but reading the metadata of a GGUF with a
49k-entry vocabulary through gguf.GGUFReader takes seconds, so the converted tokenizer is saved
under `cache_dir` keyed by the file's absolute path, size and mtime (plus the transformers
version, whose conversion may change) and later loads read the saved tokenizer.json instead.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Sequence

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

__all__ = ["Tokenizer", "load_tokenizer", "gguf_cache_folder"]

logger = logging.getLogger(__name__)

# Bump when what is written to the cache changes shape.
_CACHE_FORMAT = 1


class Tokenizer:
    """The runtime's view of a tokenizer: ids in, text out, and the chat template."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, source: str = "") -> None:
        self.hf = hf_tokenizer
        self.source = source
        # The Rust tokenizer when there is one: decode is called per generated token, and the
        # transformers wrapper adds several microseconds of Python per call.
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: list[int] = list(hf_tokenizer.all_special_ids)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Plain concatenation of the tokens' text: no clean_up_tokenization_spaces, which is lossy
        and would make incremental decoding disagree with decoding the whole sequence."""
        ids = list(ids)
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Render the conversation with the model's template and tokenize it. The template writes
        any BOS / role markers itself, so no special tokens are added on top."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs),
                           add_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.source!r} has no chat template; send a plain "
                             "prompt or pass a model that ships one")
        return self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **template_kwargs)


def load_tokenizer(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Load from a Hugging Face model folder or a .gguf file, never touching the network.

    cache_dir: where converted GGUF tokenizers are kept (the runtime passes ~/.cache/tierserve or
    $TIERSERVE_CACHE_DIR); None converts every time.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return Tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True), path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return Tokenizer(_load_gguf(os.path.abspath(path), cache_dir), path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer at {path!r}")
    raise ValueError(f"{path!r} is neither a model folder nor a .gguf file")


def gguf_cache_folder(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike) -> str:
    """Where the converted tokenizer of this exact file (path, size, mtime) is cached."""
    gguf_path = os.path.abspath(os.fspath(gguf_path))
    st = os.stat(gguf_path)
    key = json.dumps([_CACHE_FORMAT, gguf_path, st.st_size, st.st_mtime_ns,
                      transformers.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(os.fspath(cache_dir), "tokenizers", digest)


def _load_gguf(gguf_path: str, cache_dir: str | os.PathLike | None) -> PreTrainedTokenizerBase:
    if cache_dir is None:
        return _convert_gguf(gguf_path)
    folder = gguf_cache_folder(gguf_path, cache_dir)
    if os.path.isdir(folder):
        try:
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # a damaged entry is rebuilt, never fatal
            logger.warning("ignoring unreadable tokenizer cache %s: %s", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    hf = _convert_gguf(gguf_path)
    _store(hf, folder, gguf_path)
    return hf


def _convert_gguf(gguf_path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                         gguf_file=os.path.basename(gguf_path),
                                         local_files_only=True)


def _store(hf: PreTrainedTokenizerBase, folder: str, gguf_path: str) -> None:
    """Write to a temporary sibling, then rename: a reader (another process or TP rank) sees a
    complete entry or none. Failing to cache only costs time, so errors are logged, not raised."""
    parent = os.path.dirname(folder)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        hf.save_pretrained(tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"gguf": gguf_path, "transformers": transformers.__version__}, f)
        os.rename(tmp, folder)
        tmp = None
    except OSError as exc:
        if not os.path.isdir(folder):  # losing the race to another writer is fine
            logger.warning("could not cache tokenizer in %s: %s", folder, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
