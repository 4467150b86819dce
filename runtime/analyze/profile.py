"""`tierserve analyze --profile`: the costs measured with the engine on this machine.

An in-process engine on the model prefills prompts of two lengths (TTFT's slope is the prefill
rate, its intercept the base), decodes a few dozen tokens (the decode rate), and reports the
block copy bandwidth its workers measured between the pool and the CPU tier; SSD entries are
written and read back through the workers' own SSD store, from disk (the page cache dropped).
"""
from __future__ import annotations

import os
import random
import tempfile
import time

from tierserve.runtime.analyze.costs import Costs

__all__ = ["profile_costs"]

_SHORT, _LONG = 64, 1024
_SSD_ENTRIES = 32


def profile_costs(model: str | None, *, dtype: str = "auto", block_size: int = 16,
                  ssd_path: str | None = None, repeats: int = 3) -> Costs:
    from tierserve.runtime.llm import LLM
    from tierserve.scheduler.params import SamplingParams

    # Random prompts never hit: every TTFT is a full prefill.
    options = dict(dtype=dtype, block_size=block_size, kv_offload_cpu_bytes=64 << 20)
    with LLM(model, **options) as llm:
        core = llm.engine
        longest = min(_LONG, core.max_model_len - 8)
        vocab = core.vocab_size
        rng = random.Random(0)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def ttft(n: int) -> float:
            best = float("inf")
            for _ in range(repeats):
                prompt = [rng.randrange(1, vocab) for _ in range(n)]
                t0 = time.perf_counter()
                llm.generate([prompt], one, use_tqdm=False)
                best = min(best, time.perf_counter() - t0)
            return best

        ttft(_SHORT)  # warm-up: kernels, caches
        short, long = ttft(_SHORT), ttft(longest)
        slope = max(long - short, 1e-9) / (longest - _SHORT)
        decode_n = 32
        t0 = time.perf_counter()
        llm.generate([[rng.randrange(1, vocab) for _ in range(_SHORT)]],
                     SamplingParams(temperature=0, max_tokens=decode_n, ignore_eos=True),
                     use_tqdm=False)
        decode_s = max(time.perf_counter() - t0 - short, 1e-9) / (decode_n - 1)
        costs = core.scheduler.tiers.costs
        block_bytes, copy_bw = costs.block_bytes, costs.copy_bytes_per_s
    costs = Costs(prefill_tokens_per_s=1.0 / slope, decode_tokens_per_s=1.0 / decode_s,
                  ttft_base_s=max(short - _SHORT * slope, 0.0),
                  source="measured on this machine (--profile)")
    return costs.with_copies(block_bytes, copy_bw, *_ssd_bytes_per_s(block_bytes, ssd_path))


def _ssd_bytes_per_s(block_bytes: int, folder: str | None) -> tuple[float, float]:
    """(read, write) bandwidth of block-sized entries through the workers' SSD folder: written
    (fsynced) as the tier's write-back writes them, read back checked, from disk."""
    if not block_bytes:
        return 0.0, 0.0
    from tierserve.workers.tier_ssd import SsdFolder
    with tempfile.TemporaryDirectory(dir=folder, prefix="tierserve-profile-") as root:
        ssd = SsdFolder(root, "profile", 1, 1 << 40)
        payload = memoryview(os.urandom(block_bytes))
        hashes = [b"%016d" % i for i in range(_SSD_ENTRIES)]
        t0 = time.perf_counter()
        for h in hashes:
            ssd.write(h, (0, 1), b"", [block_bytes], "uint8", payload)
        write_s = time.perf_counter() - t0
        for h in hashes:
            fd = os.open(ssd.path(h, (0, 1)), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        out = memoryview(bytearray(block_bytes))
        t0 = time.perf_counter()
        for h in hashes:
            why = ssd.read(ssd.path(h, (0, 1)), h, (0, 1), None, [block_bytes], "uint8", out)
            if why is not None:
                raise RuntimeError(f"--profile: an SSD entry read back wrong: {why}")
        seconds = time.perf_counter() - t0
    total = _SSD_ENTRIES * block_bytes
    return total / max(seconds, 1e-9), total / max(write_s, 1e-9)
