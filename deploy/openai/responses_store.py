"""Stored responses (`store: true`, OpenAI's default): what `GET /v1/responses/{id}` returns and
what `previous_response_id` continues, in this server's memory, bounded by bytes (the least
recently used go first), each under its client's namespace (its key's tenant, else its
address), so that no client reads or continues another's."""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import msgspec

__all__ = ["StoredResponse", "ResponseStore"]


class StoredResponse(NamedTuple):
    response: dict
    # The conversation a later turn continues: its history, input and output as chat
    # messages, without its instructions (OpenAI does not carry those over).
    messages: list[dict]
    nbytes: int


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def put(self, namespace: str, response: dict, messages: list[dict]) -> None:
        """Keeps a response; one larger than the whole store is not kept."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(messages))
        key = (namespace, response["id"])
        self.delete(namespace, response["id"])
        if size > self.max_bytes:
            return
        self._items[key] = StoredResponse(response, messages, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes

    def get(self, namespace: str, rid: str) -> StoredResponse | None:
        item = self._items.get((namespace, rid))
        if item is not None:
            self._items.move_to_end((namespace, rid))
        return item

    def delete(self, namespace: str, rid: str) -> bool:
        item = self._items.pop((namespace, rid), None)
        if item is not None:
            self.nbytes -= item.nbytes
        return item is not None

    def __len__(self) -> int:
        return len(self._items)
