"""Drives a Scheduler the way the engine does, with a deterministic fake "model" whose sampled
token is a function of the request's tokens (so preemption and resumption are checkable)."""
from tierserve.kvcache import ASYNC_KINDS, BlockHasher, CopyKind, KVCacheManager
from tierserve.scheduler import ModelRunnerOutput, Scheduler

EOS = 0


def next_token(tokens: list[int], seed: int = 0) -> int:
    """What the fake model samples after `tokens` (and a sampling seed): never EOS, in [1, 500)."""
    return (sum(tokens[-3:]) * 31 + len(tokens) + seed) % 499 + 1


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=64, threshold=0, policy="fcfs", caching=True, watermark=0.0,
                   async_scheduling=False, step_time_target_s=0.0):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, watermark=watermark)
    return Scheduler(kv, BlockHasher(block_size), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     long_prefill_token_threshold=threshold, policy=policy, vocab_size=1000,
                     async_scheduling=async_scheduling, step_time_target_s=step_time_target_s)


class WorkerMirror:
    """Rebuilds each request's tokens and block table from the wire diffs alone, and checks
    that they equal the scheduler's: the worker never needs a prompt twice."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.seeds: dict[str, int] = {}

    def apply(self, out) -> list[int]:
        for rid in out.finished_req_ids:
            self.tokens.pop(rid)
            self.blocks.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.blocks[rid] = []
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens, "a request was sent as new twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.seeds[new.req_id] = new.sampling_params.seed or 0
        for rid, new_tokens, new_blocks, resumed_computed in out.scheduled_cached_reqs.unpack():
            self.tokens[rid].extend(new_tokens)
            if resumed_computed is not None:
                self.blocks[rid] = list(new_blocks)
                self.computed[rid] = resumed_computed
            else:
                self.blocks[rid].extend(new_blocks)
        sampled, spans = [], []
        for rid, n in zip(out.scheduled_req_ids(), out.num_scheduled_tokens):
            toks = self.tokens[rid]
            start = self.computed[rid]
            end = start + n
            spans.append((rid, start, end))
            self.computed[rid] = end
            assert end <= len(toks)
            sampled.append(next_token(toks, self.seeds[rid]) if end == len(toks) else -1)
        # As the model does: every token's K/V is written first, then each token attends over
        # its context (which may include blocks another request writes in this same step).
        for rid, start, end in spans:
            self.compute(rid, start, end)
        for rid, _, end in spans:
            self.check_context(rid, end)
        return sampled

    def compute(self, rid: str, start: int, end: int) -> None:
        """The forward writes the K/V of tokens [start, end) (the plain mirror keeps no KV)."""

    def check_context(self, rid: str, end: int) -> None:
        """Tokens [0, end) of the request are in the pool (the plain mirror keeps no KV)."""


def step(sched: Scheduler, mirror: WorkerMirror):
    out = sched.schedule()
    sampled = mirror.apply(out)
    for rid in out.scheduled_req_ids():
        req = sched.requests[rid]
        assert mirror.tokens[rid] == req.all_token_ids
        assert mirror.blocks[rid] == sched.kv.get_block_ids(rid)
        assert mirror.computed[rid] == req.num_computed_tokens
    outputs = sched.update_from_output(out, ModelRunnerOutput(out.step_id, sampled))
    return out, outputs


class TieredMirror(WorkerMirror):
    """A WorkerMirror that also holds the KV itself, as the token each slot of each block was
    computed for, in the pool, the CPU tier and the SSD folder (by block hash, as the folder's
    content-addressed entries are), and runs the tier copies as a rank would (asynchronous
    ones completing `delay` steps later, loads of hashes in `corrupt` failing their checks).
    Every step it checks that the context every scheduled token attends to is in the pool: a
    hit, a promotion or a swap-in that brought the wrong KV fails at once. `probe` is the
    folder lookup an engine's SSD tier makes on a miss."""

    def __init__(self, block_size: int, delay: int = 1):
        super().__init__()
        self.bs = block_size
        self.delay = delay
        self.device: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.ssd: dict[bytes, list] = {}
        self.corrupt: set[bytes] = set()  # block hashes whose entries fail their checks
        # (due step, seq, kind, slot, block hash); each kind completes in its own seq order.
        self.queue: list[tuple[int, int, CopyKind, int, bytes]] = []
        self.done = {kind: 0 for kind in ASYNC_KINDS}
        self.step_no = 0

    def probe(self, block_hash: bytes) -> bool:
        return block_hash in self.ssd

    def _block(self, b):
        return self.device.setdefault(b, [None] * self.bs)

    def _cow(self) -> None:
        for src, dst in zip(self.copy_src, self.copy_dst):
            self.device[dst] = list(self._block(src))

    def run_tiers(self, batches) -> None:
        cow_done = False
        for batch in batches:
            if not cow_done and batch.kind != CopyKind.DEVICE_TO_CPU:
                self._cow()
                cow_done = True
            if batch.kind == CopyKind.DEVICE_TO_CPU:
                for b, s in zip(batch.src, batch.dst):
                    self.cpu[s] = list(self._block(b))
            elif batch.kind == CopyKind.CPU_TO_DEVICE:
                for s, b in zip(batch.src, batch.dst):
                    self.device[b] = list(self.cpu[s])
            else:
                slots = batch.dst if batch.kind == CopyKind.SSD_TO_CPU else batch.src
                for i, slot in enumerate(slots):
                    self.queue.append((self.step_no + self.delay, batch.first_seq + i,
                                       batch.kind, slot, batch.hashes[i]))
        if not cow_done:
            self._cow()

    def finish_async(self) -> tuple[list[int], list[int]]:
        if not self.queue:
            return [], []
        failed = []
        for copy in sorted(self.queue, key=lambda c: (c[2], c[1])):
            due, seq, kind, slot, block_hash = copy
            if due > self.step_no or seq != self.done[kind]:
                continue  # not yet, or waits for an earlier copy of its kind
            self.queue.remove(copy)
            if kind == CopyKind.CPU_TO_SSD:
                self.ssd[block_hash] = list(self.cpu[slot])
            elif block_hash in self.corrupt or block_hash not in self.ssd:
                failed += [int(kind), seq]
                self.cpu[slot] = [None] * self.bs  # what was read is garbage
            else:
                self.cpu[slot] = list(self.ssd[block_hash])
            self.done[kind] = seq + 1
        return [self.done[kind] for kind in ASYNC_KINDS], failed

    def apply(self, out) -> list[int]:
        self.step_no += 1
        self.copy_src, self.copy_dst = out.copy_src, out.copy_dst
        self.run_tiers(out.tier_copies)
        return super().apply(out)

    def compute(self, rid: str, start: int, end: int) -> None:
        toks, blocks, bs = self.tokens[rid], self.blocks[rid], self.bs
        for p in range(start, end):
            self._block(blocks[p // bs])[p % bs] = toks[p]

    def check_context(self, rid: str, end: int) -> None:
        toks, blocks, bs = self.tokens[rid], self.blocks[rid], self.bs
        for p in range(end):  # the context is in the pool, computed for these tokens
            assert self._block(blocks[p // bs])[p % bs] == toks[p], (
                f"{rid}: position {p} has the KV of {self._block(blocks[p // bs])[p % bs]}, "
                f"not {toks[p]}")


def tiered_step(sched: Scheduler, mirror: "TieredMirror"):
    out = sched.schedule()
    sampled = mirror.apply(out)
    done, failed = mirror.finish_async()
    reply = ModelRunnerOutput(out.step_id, sampled, tier_done=done, tier_failed=failed)
    outputs = sched.update_from_output(out, reply)
    return out, outputs
