"""KV events and the router's index, driven directly (no Ray): the recorder's net changes, the
block pool's events against its contents, the index against several replicas' real contents
through a random workload with a batch dropped on purpose and a restart, and the policies."""
import math
import random

import pytest

from tests.sched_driver import WorkerMirror, make_scheduler, step
from tierserve.deploy.kv_index import KVIndex
from tierserve.deploy.routing import (
    LOAD_BOUND, LOAD_SLACK, NEAR_TIE, RECOMPUTE_WEIGHT, Candidate, KVAware, LeastLoaded,
    LoadTracker, PrefixTree, RoundRobin, RouteQuery, bounded,
)
from tierserve.kvcache import BlockHasher, KVEventRecorder, KVTier
from tierserve.kvcache.hashing import encode_extra_keys
from tierserve.scheduler import SamplingParams
from tierserve.scheduler.kv_events import (
    KV_EVENTS_VERSION, KVEventBatch, KVEventCodec, KVSnapshot, ReplicaLoad,
)
from tierserve.scheduler.messages import MalformedFrameError

BS = 4


def test_recorder_keeps_the_net_change_per_tier():
    rec = KVEventRecorder()
    rec.stored(KVTier.DEVICE, b"a")
    rec.stored(KVTier.DEVICE, b"b")
    rec.removed(KVTier.DEVICE, b"a")  # entered and left: nothing
    rec.removed(KVTier.CPU, b"c")
    rec.stored(KVTier.CPU, b"c")  # left and came back: nothing
    rec.removed(KVTier.SSD, b"d")
    assert rec.take() == ([[b"b"], [], []], [[], [], [b"d"]])
    assert not rec and rec.take() == ([[], [], []], [[], [], []])


class Replica:
    """A scheduler with KV events, as an engine publishes them (EngineCore.take_kv_events)."""

    def __init__(self, epoch: int, num_blocks: int = 24):
        self.events = KVEventRecorder()
        self.sched = make_scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=4,
                                    max_num_batched_tokens=24, max_model_len=48)
        self.sched.kv.pool.events = self.events
        self.mirror = WorkerMirror()
        self.epoch, self.seq = epoch, -1

    def batch(self) -> KVEventBatch:
        stored, removed = self.events.take()
        self.seq += 1
        return KVEventBatch(KV_EVENTS_VERSION, self.epoch, self.seq, stored, removed,
                            ReplicaLoad(num_running=len(self.sched.running)))

    def snapshot(self) -> KVSnapshot:
        b = self.batch()
        return KVSnapshot(KV_EVENTS_VERSION, self.epoch, b.seq,
                          [self.sched.kv.pool.cached_hashes(), [], []]), b

    def actual(self) -> list[set[bytes]]:
        return [set(self.sched.kv.pool.cached_hashes()), set(), set()]

    def step(self):
        return step(self.sched, self.mirror)


def _workload(rng, replicas, rounds):
    """Random prompts from a few shared prefixes, added to random replicas, stepped."""
    prefixes = [[rng.randrange(1, 400) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    n = 0
    for _ in range(rounds):
        for rep in replicas:
            if rng.random() < 0.5 and len(rep.sched.waiting) < 4:
                prompt = rng.choice(prefixes) + [rng.randrange(1, 400)
                                                 for _ in range(rng.randrange(1, 9))]
                rep.sched.add_request(f"r{n}", prompt, SamplingParams(
                    max_tokens=rng.randrange(1, 8), temperature=0), eos_token_id=0)
                n += 1
            if rep.sched.has_unfinished_requests():
                rep.step()
            rep.sched.check_integrity()
            yield rep


def test_pool_events_replay_to_its_cached_hashes_every_step():
    rng = random.Random(3)
    rep = Replica(epoch=1, num_blocks=16)  # small: evictions happen
    held: set[bytes] = set()
    for r in _workload(rng, [rep], 150):
        b = r.batch()
        assert not set(b.stored[0]) & held, "stored a hash the tier already held"
        assert set(b.removed[0]) <= held, "removed a hash the tier did not hold"
        held = (held | set(b.stored[0])) - set(b.removed[0])
        assert held == set(r.sched.kv.pool.cached_hashes())
    assert r.sched.kv.pool.num_evictions > 0
    assert r.sched.reset_prefix_cache() or r.sched.has_unfinished_requests()


def test_index_equals_every_replica_with_a_dropped_batch_and_a_restart():
    """Two replicas, random workload; each step's batches go through the wire codec to the
    index. One batch is dropped on purpose: the next one shows the gap, a snapshot repairs
    it. A replica restarts (new epoch, empty pool): a snapshot again."""
    rng = random.Random(7)
    codec = KVEventCodec()
    reps = [Replica(epoch=10), Replica(epoch=20)]
    index = KVIndex()
    for i in range(2):
        index.add_replica(i)

    def deliver(i, frame):
        if index.receive(i, codec.decode(codec.encode(frame))):
            snap, batch = reps[i].snapshot()
            index.receive(i, batch)  # the batch before a snapshot may come before or after it
            assert not index.receive(i, codec.decode(codec.encode(snap)))

    resyncs, dropped = 0, False
    for count, rep in enumerate(_workload(rng, reps, 120)):
        i = reps.index(rep)
        batch = rep.batch()
        if count == 60 and i == 0:
            dropped = True  # lost on the way
            continue
        before = index.replicas[i].resyncs
        deliver(i, batch)
        resyncs += index.replicas[i].resyncs - before
        if count == 150:
            reps[1] = Replica(epoch=21)  # restarted: its pool is empty, its seq from 0
            deliver(1, reps[1].batch())
        index.check_integrity({j: r.actual() for j, r in enumerate(reps)
                               if not index.needs_snapshot(j)})
    assert dropped and resyncs >= 1 and index.replicas[1].epoch == 21
    for j, r in enumerate(reps):
        deliver(j, r.batch())
    index.check_integrity({j: r.actual() for j, r in enumerate(reps)})


def test_codec_refuses_unknown_versions_and_garbage():
    codec = KVEventCodec()
    frame = KVEventBatch(KV_EVENTS_VERSION + 1, 1, 0)
    with pytest.raises(MalformedFrameError, match="version"):
        codec.decode(codec.encode(frame))
    with pytest.raises(MalformedFrameError):
        codec.decode(b"\x93\x01")


def _index_with(holdings: dict[int, list[list[bytes]]]) -> KVIndex:
    index = KVIndex()
    for r, tiers in holdings.items():
        index.add_replica(r)
        index.receive(r, KVSnapshot(KV_EVENTS_VERSION, 1, 0, tiers))
    return index


def _cands(n, **loads):
    return [Candidate(i, LoadTracker(ReplicaLoad(**loads))) for i in range(n)]


def test_kv_policy_goes_where_the_prefix_is_by_tier_and_salt():
    hasher = BlockHasher(BS)
    prompt = list(range(1, 42))  # 10 usable blocks
    chain = hasher.hash_blocks(prompt, 0, None)[0]
    index = _index_with({0: [[], chain[:10], []], 1: [chain[:3], [], []], 2: [[], [], chain]})
    policy = KVAware(index, hasher, 64)
    assert policy.index.match(iter(chain), [0, 1, 2])[0].cpu == 10
    choice = policy.pick(RouteQuery(prompt), _cands(3))
    assert choice.replica == 0 and choice.cached_blocks == 10  # CPU beats SSD beats recompute
    del index.replicas[0]  # as if it were not a candidate
    index = _index_with({1: [chain[:3], [], []], 2: [[], [], chain]})
    policy = KVAware(index, hasher, 64)
    assert policy.pick(RouteQuery(prompt), [Candidate(1, LoadTracker()),
                                            Candidate(2, LoadTracker())]).replica == 2
    # Another tenant's identical prompt hashes differently: nothing of it matches.
    salted = hasher.hash_blocks(prompt, 0, None, encode_extra_keys(cache_salt="b"))[0]
    assert not set(salted) & set(chain)
    assert all(m.blocks == 0 for m in index.match(iter(salted), [1, 2]).values())
    assert policy.pick(RouteQuery(prompt, "b"), _cands(3)[1:]).cached_blocks == 0


def test_kv_policy_weighs_the_queue_and_bounds_the_load():
    hasher = BlockHasher(BS)
    prompt = list(range(1, 42))
    chain = hasher.hash_blocks(prompt, 0, None)[0]
    index = _index_with({0: [chain, [], []], 1: [[], [], []]})
    policy = KVAware(index, hasher, 64)
    busy = [Candidate(0, LoadTracker(ReplicaLoad(queued_prefill_tokens=500))),
            Candidate(1, LoadTracker())]
    assert policy.pick(RouteQuery(prompt), busy).replica == 1  # 500 queued > 40 to recompute
    # A hot prefix: the holder takes requests until it is LOAD_BOUND x the mean ahead.
    cands = _cands(2)
    picks = []
    for _ in range(8):
        choice = policy.pick(RouteQuery(prompt), cands)
        cands[choice.replica].load.route(choice.uncached_tokens)
        picks.append(choice.replica)
    assert picks[:3] == [0, 0, 0] and 1 in picks
    assert max(c.load.outstanding for c in cands) <= max(math.ceil(LOAD_BOUND * 8 / 2),
                                                          math.floor(8 / 2 + LOAD_SLACK))
    assert len(bounded(cands)) >= 1


def test_kv_policy_keeps_a_conversation_with_its_history_a_few_requests_apart():
    """At a few requests a replica the bound's slack keeps a turn with its cached history
    (the ratio alone caps 3 running against 0 idle); further apart the load bound wins."""
    hasher = BlockHasher(BS)
    prompt = list(range(1, 42))
    chain = hasher.hash_blocks(prompt, 0, None)[0]
    policy = KVAware(_index_with({0: [chain, [], []], 1: [[], [], []]}), hasher, 64)
    for running, holder_wins in ((3, True), (LOAD_SLACK + 3, False)):
        cands = [Candidate(0, LoadTracker(ReplicaLoad(num_running=running))),
                 Candidate(1, LoadTracker())]
        assert math.ceil(LOAD_BOUND * (running + 1) / 2) < running + 1
        assert (policy.pick(RouteQuery(prompt), cands).replica == 0) == holder_wins, running
        assert bounded(cands, slack=0) == cands[1:]


def test_kv_policy_sends_a_new_conversation_where_fewer_blocks_are_held():
    """A prompt cached nowhere, on replicas of about equal load, goes to the replica whose pool
    holds fewer blocks (fewer conversations whose later turns will come back to it); a clearly
    shorter queue elsewhere still wins."""
    hasher = BlockHasher(BS)
    other = hasher.hash_blocks(list(range(500, 541)), 0, None)[0]  # another conversation's
    policy = KVAware(_index_with({0: [other, [], []], 1: [[], [], []]}), hasher, 64)
    assert policy.index.device_blocks(0) == len(other) and policy.index.device_blocks(1) == 0
    prompt = list(range(1, 42))
    assert [policy.pick(RouteQuery(prompt), _cands(2)).replica for _ in range(4)] == [1] * 4
    # Two running decodes add a few tokens to each step: still a tie.
    decoding = [Candidate(0, LoadTracker()),
                Candidate(1, LoadTracker(ReplicaLoad(num_running=2)))]
    assert policy.pick(RouteQuery(prompt), decoding).replica == 1
    queued = [Candidate(0, LoadTracker()),
              Candidate(1, LoadTracker(ReplicaLoad(queued_prefill_tokens=200)))]
    assert policy.pick(RouteQuery(prompt), queued).replica == 0


def test_kv_policy_keeps_a_turn_with_its_history_when_a_queue_makes_estimates_near():
    """The holder's queue brings its estimate near an empty replica's: the tie among near
    estimates goes to the replica holding the most of the prompt, not to the emptier pool
    (which would recompute the history)."""
    hasher = BlockHasher(BS)
    prompt = list(range(1, 42))  # 10 blocks cached on replica 0, which holds more besides
    chain = hasher.hash_blocks(prompt, 0, None)[0]
    other = hasher.hash_blocks(list(range(500, 541)), 0, None)[0]
    policy = KVAware(_index_with({0: [chain + other, [], []], 1: [[], [], []]}), hasher, 64)
    holder = Candidate(0, LoadTracker(ReplicaLoad(queued_prefill_tokens=35)))
    rates = 36, 41  # the work each estimate counts: near (within NEAR_TIE)
    assert rates[1] <= rates[0] * NEAR_TIE
    assert policy.pick(RouteQuery(prompt), [holder, Candidate(1, LoadTracker())]).replica == 0


def test_kv_policy_weighs_blocks_the_holder_lacks():
    """A prefix holder whose pool has no free blocks for its queue and the request makes them
    wait for running requests to finish: with free blocks it wins, without it loses to an idle
    replica that recomputes the prompt."""
    hasher = BlockHasher(BS)
    prompt = list(range(1, 42))  # 40 tokens cacheable
    chain = hasher.hash_blocks(prompt, 0, None)[0]
    policy = KVAware(_index_with({0: [chain, [], []], 1: [[], [], []]}), hasher, 64)
    idle = Candidate(1, LoadTracker(ReplicaLoad(free_blocks=100, total_blocks=100)))
    # 60 queued + 1 uncached token need 16 blocks of 4.
    for free, winner in ((16, 0), (0, 1)):
        holder = Candidate(0, LoadTracker(ReplicaLoad(queued_prefill_tokens=60,
                                                      free_blocks=free, total_blocks=100)))
        assert policy.pick(RouteQuery(prompt), [holder, idle]).replica == winner, free


def test_kv_policy_moves_a_prefix_only_for_a_queue_past_its_recompute():
    """Leaving the holder recomputes its 40 cached tokens elsewhere, which the score counts
    beyond the other replica's own wait: a holder 80 queued tokens behind stays (the idle
    replica's estimate alone, 41 tokens, would have won), one 150 behind does not."""
    hasher = BlockHasher(BS)
    prompt = list(range(1, 42))  # 40 tokens cached on replica 0, 1 to compute anywhere
    chain = hasher.hash_blocks(prompt, 0, None)[0]
    policy = KVAware(_index_with({0: [chain, [], []], 1: [[], [], []]}), hasher, 64)
    assert RECOMPUTE_WEIGHT == 1.0
    for queued, winner in ((80, 0), (150, 1)):
        holder = Candidate(0, LoadTracker(ReplicaLoad(queued_prefill_tokens=queued)))
        assert (queued + 1 > 41 * NEAR_TIE) and ((queued + 1 > (41 + 40) * NEAR_TIE) == winner)
        assert policy.pick(RouteQuery(prompt), [holder, Candidate(1, LoadTracker())]).replica \
            == winner, queued


def test_load_tracker_counts_requests_in_transit_until_reported():
    t = LoadTracker()
    t.report(ReplicaLoad(requests_added=0), epoch=5)
    t.route(100)
    t.route(30)
    assert (t.in_transit, t.in_transit_tokens) == (2, 130)
    t.report(ReplicaLoad(requests_added=1, num_running=1), epoch=5)
    assert (t.in_transit, t.in_transit_tokens, t.outstanding) == (1, 30, 2)
    t.report(ReplicaLoad(requests_added=0), epoch=6)  # restarted: nothing on its way
    assert t.in_transit == 0 and t.in_transit_tokens == 0


def test_simple_policies():
    rr, ll = RoundRobin(), LeastLoaded()
    q = RouteQuery([1, 2, 3])
    assert [rr.pick(q, _cands(3)).replica for _ in range(4)] == [0, 1, 2, 0]
    cands = _cands(3)
    cands[0].load.route(5)
    cands[2].load.route(5)
    assert ll.pick(q, cands).replica == 1


def test_prefix_tree_follows_its_own_history_blind_to_salts():
    tree = PrefixTree(BS)
    prompt = list(range(1, 42))
    cands = _cands(2)
    first = tree.pick(RouteQuery(prompt), cands).replica
    assert tree.pick(RouteQuery(prompt + [7, 8]), cands).replica == first
    # It cannot tell tenants apart: another salt's identical prompt follows the same entry.
    assert tree.pick(RouteQuery(prompt, "other"), cands).replica == first
    other = tree.pick(RouteQuery(list(range(200, 240))), cands).replica
    assert other != first  # a new prompt goes to the replica with the smaller tree


def test_tier_events_replay_to_the_tier_index_every_step():
    """Device, CPU and SSD events through a workload several times the pool (blocks demoted,
    spilled, loaded back), and a worker rebuild that drops the CPU tier: replayed, they give
    exactly what the pool and the tier index hold after every step."""
    from tests.sched_driver import TieredMirror, tiered_step
    from tierserve.kvcache import KVCacheManager, TierIndex, TierPolicy
    from tierserve.scheduler import Scheduler
    mirror = TieredMirror(BS)
    index = TierIndex(8, 64, ssd_probe=mirror.probe)
    rec = KVEventRecorder()
    kv = KVCacheManager(12, BS, watermark=0.0, events=rec,
                        tiers=TierPolicy(index, block_size=BS, block_bytes=100))
    sched = Scheduler(kv, BlockHasher(BS), max_num_seqs=4, max_num_batched_tokens=32,
                      max_model_len=40, vocab_size=1000)
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 900) for _ in range(18)] for _ in range(8)]
    held = [set(), set(), set()]
    seen = [0, 0, 0]
    n = 0
    for step_no in range(400):
        if len(sched.waiting) < 2 and n < 48:
            sched.add_request(f"r{n}", rng.choice(prompts) + [rng.randrange(1, 900)],
                              SamplingParams(temperature=0, max_tokens=2))
            n += 1
        if step_no == 200:
            index.drop_worker_memory()  # a worker rebuild: the CPU tier's memory is gone
        if sched.has_unfinished_requests() or sched.has_pending_worker_updates():
            tiered_step(sched, mirror)
        sched.check_integrity()
        stored, removed = rec.take()
        for t in range(3):
            assert not set(stored[t]) & held[t] and set(removed[t]) <= held[t], t
            held[t] = (held[t] | set(stored[t])) - set(removed[t])
            seen[t] += len(stored[t])
        cpu, ssd = index.held_hashes()
        assert held == [set(kv.pool.cached_hashes()), set(cpu), set(ssd)]
    assert all(seen), seen
