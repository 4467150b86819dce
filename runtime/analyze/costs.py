"""What a hit saves, in seconds: prefill time per token against the copy time per block.

A prompt token found in the device pool saves its prefill; one found in the CPU tier saves its
prefill less the block's copy into the pool; one on SSD, less the read and the copy. Rates come
from the engine's own measurements (`--profile`, or the header of the engine's log) or are
fitted to a log's TTFTs (TTFT = base + uncached tokens / prefill rate, least squares); where
nothing is known the replay says it assumed them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Costs", "TtftFit", "ASSUMED"]


@dataclass(frozen=True)
class Costs:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # one sequence's output tokens per second
    cpu_block_s: float = 0.0  # one block, CPU tier -> device pool
    ssd_block_s: float = 0.0  # one block, SSD -> CPU tier (then cpu_block_s more)
    ssd_write_block_s: float = 0.0  # one block written back to SSD (0: as ssd_block_s)
    ttft_base_s: float = 0.0  # the TTFT of a request with nothing to prefill
    source: str = "assumed"

    def duration(self, uncached_tokens: int, output_tokens: int) -> float:
        """A request's time from arrival to its last token, alone on the engine."""
        return (self.ttft_base_s + uncached_tokens / self.prefill_tokens_per_s
                + max(output_tokens - 1, 0) / self.decode_tokens_per_s)

    def ttft_saved(self, hit_tokens: list[int] | tuple[int, ...], block_size: int) -> float:
        """Seconds of prefill saved by (device, CPU, SSD) hit tokens, net of their copies."""
        device, cpu, ssd = hit_tokens
        per_token = 1.0 / self.prefill_tokens_per_s
        return ((device + cpu + ssd) * per_token - cpu / block_size * self.cpu_block_s
                - ssd / block_size * (self.ssd_block_s + self.cpu_block_s))

    def with_copies(self, block_bytes: int, copy_bytes_per_s: float, ssd_bytes_per_s: float,
                    ssd_write_bytes_per_s: float = 0.0) -> "Costs":
        """The copy costs of a block of `block_bytes` at these bandwidths (0: keep)."""
        changes = {}
        for name, rate in (("cpu_block_s", copy_bytes_per_s), ("ssd_block_s", ssd_bytes_per_s),
                           ("ssd_write_block_s", ssd_write_bytes_per_s)):
            if block_bytes and rate:
                changes[name] = block_bytes / rate
        return replace(self, **changes)


# A small model on a few CPU cores; said as "assumed" wherever it is used.
ASSUMED = Costs(prefill_tokens_per_s=2000.0, decode_tokens_per_s=20.0, cpu_block_s=20e-6,
                ssd_block_s=200e-6, ssd_write_block_s=1e-3)


class TtftFit:
    """Streaming least squares of TTFT on uncached prompt tokens, and the decode rate, from a
    log's requests (those that produced at least two tokens)."""

    __slots__ = ("n", "sx", "sy", "sxx", "sxy", "decode_s", "decode_tokens")

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.decode_s = 0.0
        self.decode_tokens = 0

    def add(self, uncached: int, ttft: float, e2e: float, output_len: int) -> None:
        self.n += 1
        self.sx += uncached
        self.sy += ttft
        self.sxx += uncached * uncached
        self.sxy += uncached * ttft
        if output_len > 1:
            self.decode_s += e2e - ttft
            self.decode_tokens += output_len - 1

    def costs(self) -> Costs | None:
        """The fitted rates, or None when the log cannot tell (too few requests, or no spread
        of uncached lengths, or no sign that prefill costs time)."""
        n = self.n
        var = n * self.sxx - self.sx * self.sx
        if n < 8 or var <= 0 or not self.decode_tokens or self.decode_s <= 0:
            return None
        slope = (n * self.sxy - self.sx * self.sy) / var
        if slope <= 0:
            return None
        base = max((self.sy - slope * self.sx) / n, 0.0)
        return Costs(prefill_tokens_per_s=1.0 / slope,
                     decode_tokens_per_s=self.decode_tokens / self.decode_s,
                     ttft_base_s=base, source="fitted to the log's TTFTs")
