"""Tokenizer loading (Hugging Face folder or GGUF file) behind one small wrapper.

A GGUF file carries its tokenizer in metadata (tokenizer.ggml.*: model type, tokens, merges,
special ids, chat template). transformers' converter turns that into a fast tokenizer; it is fed
the metadata parsed by workers.model.gguf_file (shared with the weight loader, so a process
parses the file once) rather than letting AutoTokenizer re-parse the file through
gguf.GGUFReader, which takes seconds. Building still costs a few hundred milliseconds, so the converted tokenizer is
saved under `cache_dir` keyed by the file's absolute path, size and mtime (plus the transformers
version, whose conversion may change) and later loads read the saved tokenizer.json instead.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from tierserve.runtime import envs
from tierserve.workers.model.gguf_file import GGUFFile, open_gguf

__all__ = ["Tokenizer", "load_tokenizer", "load_model_tokenizer", "gguf_cache_folder"]

logger = logging.getLogger(__name__)

# Bump when what is written to the cache changes shape.
_CACHE_FORMAT = 1

# GGUF architectures whose tokenizer AutoTokenizer(gguf_file=...) builds as a plain
# TokenizersBackend around transformers' converter output, so building that from the shared parse
# yields the same tokenizer. Other architectures map to a dedicated class (qwen2: Qwen2Tokenizer)
# and still go through AutoTokenizer.
_DIRECT_ARCHITECTURES = frozenset({"llama"})

# tokenizer_config kwarg -> metadata key of its token id, as transformers' get_gguf_tokenizer reads them.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


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

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for, plus one (a SentencePiece token
        decoded alone drops its leading space): a text of B bytes has at least
        B / max_token_bytes tokens, which bounds a prompt's length before it is tokenized. A
        token that is part of a character decodes alone to U+FFFD, 3 bytes: never too few."""
        ids = [[i] for i in range(self.vocab_size)]
        if self._backend is not None:
            texts = self._backend.decode_batch(ids, skip_special_tokens=False)
        else:
            texts = [self.decode(i, skip_special_tokens=False) for i in ids]
        return max((len(t.encode("utf-8", "replace")) for t in texts), default=0) + 1

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
                            add_generation_prompt: bool = True, **options: Any) -> list[int]:
        """Render the conversation with the model's template (render_chat's options) and
        tokenize it. The template writes any BOS / role markers itself, so no special tokens
        are added on top."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **options),
                           add_special_tokens=False)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    *, continue_final_message: bool = False, chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict] | None = None) -> str:
        """The conversation as the template writes it: answered next (a generation prompt
        after it), or its last message continued; chat_template replaces the model's,
        chat_template_kwargs reach the template as variables (e.g. enable_thinking), and
        tools as its `tools` (a template that takes none ignores them)."""
        if not (chat_template or self.chat_template):
            raise ValueError(f"tokenizer {self.source!r} has no chat template; send a plain "
                             "prompt, pass chat_template, or a model that ships one")
        return self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           chat_template=chat_template, tools=tools,
                                           **(chat_template_kwargs or {}))


def load_tokenizer(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Load from a Hugging Face model folder or a .gguf file, never touching the network.

    cache_dir: where converted GGUF tokenizers are kept (the runtime passes ~/.cache/tierserve or
    $TIERSERVE_CACHE_DIR); None converts every time.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return Tokenizer(_auto_tokenizer().from_pretrained(path, local_files_only=True), path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return Tokenizer(_load_gguf(os.path.abspath(path), cache_dir), path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer at {path!r}")
    raise ValueError(f"{path!r} is neither a model folder nor a .gguf file")


def tokenizer_json_file(path: str | os.PathLike, cache_dir: str | os.PathLike | None
                        ) -> str | None:
    """The tokenizer.json a loaded tokenizer came from (a model folder's, or a GGUF file's
    cached conversion); None when there is none."""
    path = os.fspath(path)
    if os.path.isdir(path):
        folder = path
    elif path.endswith(".gguf") and cache_dir is not None and os.path.isfile(path):
        folder = gguf_cache_folder(path, cache_dir)
    else:
        return None
    found = os.path.join(folder, "tokenizer.json")
    return os.path.abspath(found) if os.path.isfile(found) else None


def gguf_cache_folder(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike) -> str:
    """Where the converted tokenizer of this exact file (path, size, mtime) is cached."""
    gguf_path = os.path.abspath(os.fspath(gguf_path))
    st = os.stat(gguf_path)
    key = json.dumps([_CACHE_FORMAT, gguf_path, st.st_size, st.st_mtime_ns,
                      _transformers_version()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(os.fspath(cache_dir), "tokenizers", digest)


def _load_gguf(gguf_path: str, cache_dir: str | os.PathLike | None) -> PreTrainedTokenizerBase:
    if cache_dir is None:
        return _convert_gguf(gguf_path)
    folder = gguf_cache_folder(gguf_path, cache_dir)
    if os.path.isdir(folder):
        try:
            return _cached_class(folder).from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # a damaged entry is rebuilt, never fatal
            logger.warning("ignoring unreadable tokenizer cache %s: %s", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    hf = _convert_gguf(gguf_path)
    _store(hf, folder, gguf_path)
    return hf


def _transformers_version() -> str:
    # transformers is imported where a tokenizer is loaded, not with this module: an engine
    # loads it on a thread of its own while its weights load (runtime/engine_setup.py).
    from importlib.metadata import version
    return version("transformers")


def _auto_tokenizer() -> type:
    # Imported on first use: importing AutoTokenizer has transformers index every model package,
    # which a GGUF tokenizer loaded from the cache never needs.
    from transformers import AutoTokenizer
    return AutoTokenizer


def _cached_class(folder: str) -> type:
    """The class a cache entry was saved from, when it is the plain TokenizersBackend that the
    direct conversion builds; otherwise AutoTokenizer, which maps the entry's class itself."""
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        name = json.load(f).get("tokenizer_class")
    if name == "TokenizersBackend":
        try:
            from transformers import TokenizersBackend
            return TokenizersBackend
        except ImportError:
            pass
    return _auto_tokenizer()


def _convert_gguf(gguf_path: str) -> PreTrainedTokenizerBase:
    gguf_file = open_gguf(gguf_path)
    converter = _gguf_converter()
    if converter is not None and _direct_conversion_applies(gguf_file):
        return _build_gguf_tokenizer(gguf_file, *converter)
    return _auto_tokenizer().from_pretrained(os.path.dirname(gguf_path),
                                             gguf_file=os.path.basename(gguf_path),
                                             local_files_only=True)


def _gguf_converter():
    """(GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer, TokenizersBackend), or None on a
    transformers without this layout (before 5.x); those convert through AutoTokenizer."""
    try:
        from transformers import TokenizersBackend
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        return None
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer, TokenizersBackend


def _direct_conversion_applies(gguf_file: GGUFFile) -> bool:
    # transformers reads a llama file named after Mistral as a mistral model, with another class.
    name = str(gguf_file.get("general.name", "")).lower()
    return gguf_file.get("general.architecture") in _DIRECT_ARCHITECTURES and "mistral" not in name


def _build_gguf_tokenizer(gguf_file: GGUFFile, mapping: dict, convert: Callable,
                          backend_cls: type) -> PreTrainedTokenizerBase:
    """What TokenizersBackend.from_pretrained(folder, gguf_file=...) builds, without its parse."""
    architecture, tokenizer_dict, tokenizer_config = _gguf_tokenizer_inputs(gguf_file, mapping)
    backend, extra_kwargs = convert(architecture, tokenizer_dict)
    kwargs = {**tokenizer_config, **extra_kwargs}
    return backend_cls(tokenizer_object=backend,
                       name_or_path=os.path.dirname(gguf_file.path), **kwargs)


def _gguf_tokenizer_inputs(gguf_file: GGUFFile, mapping: dict) -> tuple[str, dict, dict]:
    """(architecture, tokenizer dict, tokenizer_config kwargs) exactly as transformers'
    get_gguf_tokenizer derives them; numeric arrays become lists, as its reader returns them."""
    fields = gguf_file.fields
    grouped = {
        group: {name: _plain(fields[f"tokenizer.{key}"])
                for key, name in renames.items() if f"tokenizer.{key}" in fields}
        for group, renames in mapping.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary without the flag
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = fields.get(key)
        config[name] = None if token_id is None else tokenizer["tokens"][token_id]
    return fields["general.architecture"], tokenizer, config


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


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
            json.dump({"gguf": gguf_path, "transformers": _transformers_version()}, f)
        os.rename(tmp, folder)
        tmp = None
    except OSError as exc:
        if not os.path.isdir(folder):  # losing the race to another writer is fine
            logger.warning("could not cache tokenizer in %s: %s", folder, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model_tokenizer(path: str) -> Tokenizer | None:
    """None for a checkpoint folder that ships no tokenizer (prompts must be token ids)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: prompts must be token ids", path)
        return None
    return load_tokenizer(path, cache_dir=envs.cache_dir())
