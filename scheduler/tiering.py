"""The scheduler's side of the KV tiers: which prefix hits are copied in, which requests wait
for SSD loads, which preemptions swap instead of recompute, and the copies each step carries.

The bookkeeping of slots and copies is kvcache/tiers.py's TierManager; this collaborator ties
it to requests and steps so that the Scheduler itself stays a short loop.
"""
from __future__ import annotations

from dataclasses import dataclass

from tierserve.kvcache import KVCacheBlock, TierHit, TierManager
from tierserve.kvcache.tiers import CopyKind, StepCopies
from tierserve.scheduler.messages import ModelRunnerOutput, SchedulerOutput, TierOps
from tierserve.scheduler.request import Request

__all__ = ["PREEMPTION_MODES", "Tiering", "Admission", "CostModel"]

PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass(slots=True)
class Admission:
    """What the tiers add to a waiting request's admission."""

    cpu_hits: list[TierHit]  # pinned until promoted or given back
    wait: bool = False  # the request waits for SSD loads; admit others meanwhile
    defer: bool = False  # its SSD hits cannot load yet (no free CPU slot): try next step


@dataclass(slots=True)
class CostModel:
    """Measured rates behind swap-vs-recompute (the seeds' table): a block's bytes over the
    copy bandwidth, out and back, against prefilling its tokens again. Zero: not measured."""

    block_bytes: int = 0
    copy_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0

    def swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        if not (self.block_bytes and self.copy_bytes_per_s and self.prefill_tokens_per_s):
            return True  # a memcpy is cheaper than a forward on every device we know
        swap_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s
        return swap_s < num_tokens / self.prefill_tokens_per_s


class Tiering:
    def __init__(self, tiers: TierManager, block_size: int, preemption_mode: str) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {preemption_mode!r}")
        self.tiers = tiers
        self.block_size = block_size
        self.preemption_mode = preemption_mode
        self.costs = CostModel()
        self.loading: dict[str, Request] = {}  # waiting requests whose SSD loads are in flight
        self._steps: dict[int, StepCopies] = {}

    # ---------------------------------------------------------------- admission

    def lookup(self, req: Request, hits: list[TierHit]) -> Admission:
        """A waiting request's tier hits: CPU ones are pinned for promotion this step; SSD ones
        start loading, and the request then waits, with its CPU hits and load targets held in
        the tier for it."""
        if any(h.tier == "ssd" for h in hits):
            if self.tiers.start_loads(req.request_id, hits):
                self.loading[req.request_id] = req
                return Admission([], wait=True)
            if self.tiers.could_load_later():
                return Admission([], defer=True)  # copies in flight will free CPU slots
        cpu = []
        for h in hits:
            if h.tier != "cpu":
                break  # a load could not start: the rest is recomputed
            cpu.append(h)
        self.tiers.pin_hits(cpu)
        return Admission(cpu)

    def promoted(self, req: Request, admission: Admission,
                 new_blocks: list[KVCacheBlock]) -> None:
        """The admission fit: the first new blocks take the CPU hits, and the slots held for
        the request while it waited for loads are let go."""
        hits = admission.cpu_hits
        self.tiers.promote(hits, [b.block_id for b in new_blocks[: len(hits)]])
        self.tiers.release_held(req.request_id)

    def refused(self, admission: Admission) -> None:
        """No room this step: the CPU hits are unpinned (slots held for a request that waited
        for loads stay held: it is still at the head of the queue)."""
        self.tiers.unpin_hits(admission.cpu_hits)

    # ---------------------------------------------------------------- preemption

    def try_swap_out(self, req: Request, block_ids: list[int]) -> bool:
        """Swap preemption, where the mode and the costs say so and the CPU tier has room: the
        blocks holding the computed tokens go to CPU slots the request owns."""
        if self.preemption_mode == "recompute" or req.num_computed_tokens == 0:
            return False
        n = -(-req.num_computed_tokens // self.block_size)
        if self.preemption_mode == "auto" and not self.costs.swap_is_cheaper(
                n, req.num_computed_tokens):
            return False
        slots = self.tiers.swap_out(req.request_id, block_ids[:n])
        if slots is None:
            return False
        req.swapped_slots = slots
        req.num_swapped_tokens = req.num_computed_tokens
        return True

    def swap_in(self, req: Request, new_blocks: list[KVCacheBlock]) -> None:
        slots, req.swapped_slots = req.swapped_slots, None
        self.tiers.swap_in(slots, [b.block_id for b in new_blocks[: len(slots)]])

    # ---------------------------------------------------------------- requests leaving

    def forget(self, req: Request) -> None:
        """A request finished or was aborted: its loads go on for the cache; slots it owns
        are released (once any copy of them completes)."""
        self.loading.pop(req.request_id, None)
        self.tiers.forget_request(req.request_id)
        if req.swapped_slots:
            self.tiers.release_owned(req.swapped_slots)
            req.swapped_slots = None

    # ---------------------------------------------------------------- steps

    def end_schedule(self, step_id: int) -> TierOps:
        """Write-back of cold CPU slots, then this step's copies, as the wire carries them."""
        self.tiers.write_back()
        copies = self.tiers.take_copies()
        if not copies:
            return TierOps()
        self._steps[step_id] = copies
        started = copies.started
        return TierOps(
            out_blocks=copies.out_blocks, out_slots=copies.out_slots,
            in_slots=copies.in_slots, in_blocks=copies.in_blocks,
            seqs=[c.seq for c in started], kinds=[int(c.kind) for c in started],
            cpu_slots=[c.cpu_slot for c in started], ssd_entries=[c.ssd_entry for c in started],
            hashes=[c.block_hash for c in started], keys=[c.hash_key or b"" for c in started])

    def complete(self, out: SchedulerOutput, reply: ModelRunnerOutput | None) -> list[Request]:
        """The workers ran the step (reply) or failed it (None). Returns the waiting requests
        whose loads all completed, to be scheduled again."""
        copies = self._steps.pop(out.step_id, None)
        if copies is not None:
            self.tiers.complete_step(copies, ok=reply is not None)
        if reply is None or not reply.tier_done:
            return []
        upto = {kind: done for kind, done in zip((CopyKind.LOAD, CopyKind.SPILL),
                                                  reply.tier_done) if done >= 0}
        pairs = reply.tier_failed
        failed = [(CopyKind(pairs[i]), pairs[i + 1]) for i in range(0, len(pairs), 2)]
        ready = self.tiers.complete_async(upto, failed)
        return [self.loading.pop(rid) for rid in ready if rid in self.loading]

    def workers_lost(self) -> None:
        """The workers were replaced: no load is coming (the requests that waited for one are
        the scheduler's to re-admit) and no step's copies will complete."""
        self.loading.clear()
        self._steps.clear()

    def has_work(self) -> bool:
        """Copies in flight whose completion only a step can report."""
        return self.tiers.has_in_flight() or bool(self.tiers.copies)

    def stats(self) -> dict:
        s = self.tiers.stats
        out = dict(self.tiers.usage())
        out.update(
            tier_cpu_hit_blocks=s.cpu_hit_blocks, tier_ssd_hit_blocks=s.ssd_hit_blocks,
            tier_promotions=s.promotions, tier_demotions=s.demotions,
            tier_demotions_dropped=s.demotions_dropped, tier_loads=s.loads,
            tier_spills=s.spills, tier_cpu_dropped=s.cpu_dropped, tier_ssd_dropped=s.ssd_dropped,
            tier_checksum_failures=s.checksum_failures, tier_swap_outs=s.swap_outs,
            tier_swap_ins=s.swap_ins, tier_bytes_copied=s.bytes_copied,
            num_loading=len(self.loading))
        return out
