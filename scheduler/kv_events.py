"""The KV event stream's wire form (docs/kv_events.md documents it for other consumers).

Each engine publishes, per step, one `KVEventBatch`: the block hashes that entered (`stored`)
and left (`removed`) each tier since the batch before (kvcache/events.py records them), and the
replica's load. Batches of one engine instance (an `epoch`, drawn at random when it starts)
carry consecutive sequence numbers from 0. A `KVSnapshot` holds every hash of every tier as of
batch `seq` (the next batch is seq + 1): a consumer that sees a gap, or a new epoch (the engine
restarted), asks for one and applies only the batches after it.

Hashes are kvcache's BlockHasher chain (invariant 2): the consumer hashes a prompt with the
same algorithm, seed and block size and the cache salt in the first block, so a salted prompt
only ever matches blocks of its own tenant. The engine's `info()` gives those settings.
"""
from __future__ import annotations

from typing import Union

import msgspec

from tierserve.kvcache.events import NUM_TIERS, KVTier
from tierserve.scheduler.messages import MalformedFrameError

__all__ = ["KV_EVENTS_VERSION", "KVTier", "NUM_TIERS", "ReplicaLoad", "KVEventBatch", "KVSnapshot", "KVEventFrame",
           "KVEventCodec"]

# Raised when a field changes meaning; a consumer refuses versions it does not know.
KV_EVENTS_VERSION = 1

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class ReplicaLoad(msgspec.Struct, **_WIRE):
    """What a router needs of a replica's load, as of the end of a step."""

    num_running: int = 0
    num_waiting: int = 0  # waiting for admission or for SSD loads
    # Prompt tokens not computed yet, of waiting and running requests (a waiting request's
    # prefix cached on the device now left out).
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    # Requests this engine instance was ever given: with the requests a router sent it, how
    # many are still on their way.
    requests_added: int = 0
    # Measured: prompt tokens computed per second (0: not measured yet), and the seconds to
    # bring one block back from the CPU tier and from SSD (0: not measured / no such tier).
    prefill_tokens_per_s: float = 0.0
    cpu_block_s: float = 0.0
    ssd_block_s: float = 0.0


class KVEventBatch(msgspec.Struct, tag=1, **_WIRE):
    version: int
    epoch: int
    seq: int
    # Per tier (kvcache.KVTier: device, cpu, ssd), 16-byte block hashes.
    stored: list[list[bytes]] = []
    removed: list[list[bytes]] = []
    load: ReplicaLoad = msgspec.field(default_factory=ReplicaLoad)


class KVSnapshot(msgspec.Struct, tag=2, **_WIRE):
    version: int
    epoch: int
    seq: int
    # Per tier, every block hash the tier holds.
    tiers: list[list[bytes]] = []
    load: ReplicaLoad = msgspec.field(default_factory=ReplicaLoad)


KVEventFrame = Union[KVEventBatch, KVSnapshot]


class KVEventCodec:
    """One encoder and one decoder for the stream's frames."""

    __slots__ = ("_encoder", "_decoder")

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KVEventFrame)

    def encode(self, frame: KVEventBatch | KVSnapshot) -> bytes:
        return self._encoder.encode(frame)

    def decode(self, data: bytes | memoryview) -> KVEventBatch | KVSnapshot:
        try:
            frame = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            raise MalformedFrameError(f"malformed KV event frame ({len(data)} bytes): {e}") \
                from e
        if frame.version != KV_EVENTS_VERSION:
            raise MalformedFrameError(f"KV event frame version {frame.version}; this consumer "
                                      f"reads version {KV_EVENTS_VERSION}")
        return frame
