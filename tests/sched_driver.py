"""Drives a Scheduler the way the engine does, with a deterministic fake "model" whose sampled
token is a function of the request's tokens (so preemption and resumption are checkable)."""
from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.scheduler import ModelRunnerOutput, Scheduler

EOS = 0


def next_token(tokens: list[int]) -> int:
    """What the fake model samples after `tokens`: never EOS, in [1, 500)."""
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 499 + 1


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=64, threshold=0, policy="fcfs", caching=True, watermark=0.0):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, watermark=watermark)
    return Scheduler(kv, BlockHasher(block_size), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     long_prefill_token_threshold=threshold, policy=policy, vocab_size=1000)


class WorkerMirror:
    """Rebuilds each request's tokens and block table from the wire diffs alone, and checks
    that they equal the scheduler's: the worker never needs a prompt twice."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

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
        for rid, new_tokens, new_blocks, resumed_computed in out.scheduled_cached_reqs.unpack():
            self.tokens[rid].extend(new_tokens)
            if resumed_computed is not None:
                self.blocks[rid] = list(new_blocks)
                self.computed[rid] = resumed_computed
            else:
                self.blocks[rid].extend(new_blocks)
        sampled = []
        for rid, n in zip(out.scheduled_req_ids(), out.num_scheduled_tokens):
            toks = self.tokens[rid]
            end = self.computed[rid] + n
            self.computed[rid] = end
            assert end <= len(toks)
            sampled.append(next_token(toks) if end == len(toks) else -1)
        return sampled


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
