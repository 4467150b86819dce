"""The server's one frozen, validated configuration (`tierserve api-server`'s flags)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tierserve.deploy.openai.connections import ConnectionLimits
from tierserve.deploy.openai.reasoning import REASONING_PARSERS
from tierserve.deploy.openai.tenants import KeyTable
from tierserve.deploy.openai.tool_parsers import TOOL_CALL_PARSERS

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_queued_requests: int = 256
    max_body_bytes: int = 1 << 20
    # API keys and their tenants; None: no authentication, the client's cache_salt as sent.
    keys: KeyTable | None = field(default=None, compare=False)
    # A request body must arrive whole within this long (else 408).
    body_timeout_s: float = 30.0
    # A request head's deadline and the cap on connections per client address.
    connections: ConnectionLimits = ConnectionLimits()
    # The chat template of chat requests that send none (None: the model's).
    chat_template: str | None = None
    # Whether a request may send a chat_template of its own (vLLM's flag): a template is code
    # the server runs, so by default a request's is refused.
    trust_request_chat_template: bool = False
    # Stored responses (Responses API, `store: true`) kept in memory, least recently used out.
    response_store_bytes: int = 64 << 20
    # Chat's reasoning apart from its answer (deploy/openai/reasoning.py), or None.
    reasoning_parser: str | None = None
    # How the model writes tool calls for `auto` (deploy/openai/tool_parsers.py).
    tool_call_parser: str = "hermes"
    # LoRA adapters may be added and removed at run time (deploy/openai/lora_admin.py).
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.max_queued_requests < 1 or self.max_body_bytes < 1:
            raise ValueError("max_queued_requests and max_body_bytes must be >= 1")
        if not self.body_timeout_s > 0:
            raise ValueError("body_timeout_s must be > 0")
        if self.response_store_bytes < 0:
            raise ValueError("response_store_bytes must be >= 0")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
