"""LoRA adapters added and removed while the server runs (vLLM's routes and bodies):

  POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}
  POST /v1/unload_lora_adapter  {"lora_name": ...}

Only with `--allow-runtime-lora-updating` (an adapter is a folder on the server's machine: who
may call these may make the server read any such folder), and only with a key where the server
has keys. An adapter is checked before it is added, against the model the engine reported
(lora_files.read_adapter, the engine's own check), so a bad one is a 400 here and never a
request's error later. Its id is a hash of its name and folder: the same in every server of
a deployment, so the engine sees one id per folder however many servers add it. A removed
adapter's requests in flight finish; the ranks drop its weights when they need the room.
"""
from __future__ import annotations

import os

import xxhash
from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tierserve.deploy.openai.errors import ApiError, BadField
from tierserve.runtime.lora import LoRARequest
from tierserve.workers.model.lora_files import read_adapter

__all__ = ["LoadLoRARequest", "UnloadLoRARequest", "lora_admin_routes", "runtime_lora_id"]


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


def runtime_lora_id(name: str, path: str) -> int:
    """A runtime adapter's id: in [2^62, 2^63), clear of lora_modules' 1, 2, ..."""
    return (1 << 62) | (xxhash.xxh64(f"{name}\0{path}".encode()).intdigest() & ((1 << 62) - 1))


def load(server, body: LoadLoRARequest) -> PlainTextResponse:
    check = server.lora_check
    if check is None:
        raise ApiError(400, "the engine was started without enable_lora", "lora_name")
    name = body.lora_name
    if not name or name == server.config.served_model_name or name in server.adapters:
        raise BadField("lora_name", f"the LoRA adapter {name!r} has already been loaded"
                       if name else "lora_name must be a non-empty string")
    path = os.path.abspath(os.path.expanduser(body.lora_path))
    try:
        read_adapter(path, num_layers=check["num_layers"],
                     shapes={k: tuple(v) for k, v in check["shapes"].items()},
                     max_rank=check["max_lora_rank"])
    except ValueError as e:
        raise BadField("lora_path", str(e)) from None
    server.adapters[name] = LoRARequest(name, runtime_lora_id(name, path), path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


def unload(server, body: UnloadLoRARequest) -> PlainTextResponse:
    if server.adapters.pop(body.lora_name, None) is None:
        raise ApiError(404, f"the LoRA adapter {body.lora_name!r} cannot be found",
                       "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def lora_admin_routes(app: FastAPI, server, auth: Depends) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest, tenant=auth):
        return load(server, body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest, tenant=auth):
        return unload(server, body)
