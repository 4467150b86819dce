"""Random streams of arriving, finishing, aborted and preempted requests, checked every step
against the invariants and a brute-force longest-common-full-block-prefix oracle."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierserve.scheduler import SamplingParams
from tests.sched_driver import EOS, WorkerMirror, make_scheduler, step

BS = 4
BASES = [list(range(1, 21)), list(range(1, 9)) + list(range(40, 52)), list(range(60, 73))]


@st.composite
def prompts(draw):
    base = draw(st.sampled_from(BASES + [[]]))
    cut = draw(st.integers(0, len(base)))
    suffix = draw(st.lists(st.integers(1, 30), min_size=0 if cut else 1, max_size=10))
    return base[:cut] + suffix


@st.composite
def events(draw):
    kind = draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]))
    if kind == "add":
        return ("add", draw(prompts()), draw(st.integers(1, 12)), draw(st.sampled_from(
            [None, None, "tenant"])))
    if kind == "abort":
        return ("abort", draw(st.integers(0, 50)))
    return ("step",)


class Oracle:
    """Every (salt, full-block prefix) any request has had scheduled for compute."""

    def __init__(self):
        self.prefixes: set[tuple] = set()

    def record(self, salt, tokens, num_computed):
        for k in range(1, min(num_computed, len(tokens)) // BS + 1):
            self.prefixes.add((salt, tuple(tokens[:k * BS])))

    def expected_hit(self, salt, tokens):
        best = 0
        for k in range(1, (len(tokens) - 1) // BS + 1):
            if (salt, tuple(tokens[:k * BS])) not in self.prefixes:
                break
            best = k * BS
        return best


def check_step(sched, out, oracle, salts, mirror):
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
    no_evictions = sched.kv.pool.num_evictions == 0
    sizes = dict(zip(out.scheduled_req_ids(), out.num_scheduled_tokens))
    cached = out.scheduled_cached_reqs
    resumed = dict(zip((cached.req_ids[i] for i in cached.resumed), cached.resumed_num_computed))
    running = [r for r in cached.req_ids if r not in resumed]
    admitted = (list(resumed.items())
                + [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs])
    for rid in running:  # the mirror has already advanced past this step
        oracle.record(salts[rid], mirror.tokens[rid], mirror.computed[rid])
    for rid, hit in admitted:
        if no_evictions and sched.kv.enable_caching:
            assert hit == oracle.expected_hit(salts[rid], mirror.tokens[rid]), rid
        oracle.record(salts[rid], mirror.tokens[rid], hit + sizes[rid])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.lists(events(), min_size=1, max_size=60),
       num_blocks=st.integers(9, 40), budget=st.integers(4, 40), max_seqs=st.integers(1, 6),
       threshold=st.sampled_from([0, 0, 3, 8]), policy=st.sampled_from(["fcfs", "priority"]))
def test_random_streams_keep_every_invariant(stream, num_blocks, budget, max_seqs, threshold,
                                             policy):
    sched = make_scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_seqs,
                           max_num_batched_tokens=budget, max_model_len=32,
                           threshold=threshold, policy=policy)
    mirror, oracle, salts, added = WorkerMirror(), Oracle(), {}, []

    def do_step():
        out, _ = step(sched, mirror)
        sched.check_integrity()
        if policy == "fcfs":
            check_step(sched, out, oracle, salts, mirror)

    for event in stream:
        if event[0] == "add":
            rid = f"r{len(added)}"
            _, prompt, max_tokens, salt = event
            sched.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                              eos_token_id=EOS, cache_salt=salt, priority=len(added) % 3)
            salts[rid] = salt
            added.append(rid)
        elif event[0] == "abort" and added:
            sched.abort_requests([added[event[1] % len(added)]])
            sched.check_integrity()
        else:
            do_step()
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        do_step()
    assert not sched.has_unfinished_requests() and not sched.running and not sched.waiting
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert not sched.kv.req_to_blocks
    sched.check_integrity()
