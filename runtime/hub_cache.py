"""A model named by its Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`), found where
Hugging Face's tools downloaded it: tierserve never downloads, but a model already in the
local Hub cache (`huggingface-cli download`, transformers, vLLM) is served by its id, as
vLLM serves it offline.

The cache's layout (huggingface_hub's): `<cache>/models--ORG--NAME/refs/REVISION` holds a
commit hash, and `<cache>/models--ORG--NAME/snapshots/HASH/` the files of that commit.
"""
from __future__ import annotations

import os
import re

from tierserve.runtime import envs

__all__ = ["resolve_hub_ids", "looks_like_hub_id", "hub_id_of", "HUB_ARGS"]

# vLLM's engine arguments consumed here, with their CLI help.
HUB_ARGS = {
    "revision": "the revision (branch, tag or commit) of a model named by its Hugging Face Hub "
                "id, found in the local Hub cache (default: main)",
    "download_dir": "the Hugging Face Hub cache a model named by its Hub id is found in "
                    "(default: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)",
}

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and not name.startswith(".")


def resolve_hub_ids(options: dict) -> dict:
    """`options` with a `model` and `tokenizer` that name a Hub id (and no existing path)
    replaced by their snapshot folder in the local Hub cache, at vLLM's `revision` (default
    main) under vLLM's `download_dir` (default the Hub cache); both are consumed here. A Hub
    id that is not in the cache is a ValueError saying how to get it."""
    options = dict(options)
    revision = options.pop("revision", None)
    cache = options.pop("download_dir", None) or envs.hf_hub_cache()
    resolved = False
    for name in ("model", "tokenizer"):
        value = options.get(name)
        if isinstance(value, str) and not os.path.exists(value) and looks_like_hub_id(value):
            options[name] = snapshot_folder(value, revision or "main", cache)
            resolved = True
    if revision is not None and not resolved:
        raise ValueError(f"revision={revision!r} applies to a model named by its Hugging Face "
                         f"Hub id, found in the local Hub cache; model is a path")
    return options


def snapshot_folder(repo_id: str, revision: str, cache: str) -> str:
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    commit = revision if _COMMIT.fullmatch(revision) else _read_ref(repo, revision)
    folder = os.path.join(repo, "snapshots", commit) if commit else None
    if folder is None or not os.path.isdir(folder):
        raise ValueError(
            f"model: {repo_id!r} is no path here, and the Hugging Face Hub cache ({cache}) "
            f"holds no snapshot of it at revision {revision!r}; tierserve downloads nothing: "
            f"fetch it first (`huggingface-cli download {repo_id}`), or pass a local folder "
            f"or GGUF file")
    return folder


def _read_ref(repo: str, revision: str) -> str | None:
    try:
        with open(os.path.join(repo, "refs", revision), encoding="utf-8") as f:
            commit = f.read().strip()
    except OSError:
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def hub_id_of(path: str) -> str | None:
    """The Hub id of a snapshot folder of the Hub cache (`.../models--ORG--NAME/snapshots/
    HASH`), else None."""
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/", 1)
    return None
