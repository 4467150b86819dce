"""Every wire message round-trips through its channel's codec; garbage fails clearly."""
import msgspec
import pytest

from tierserve.scheduler import (
    CachedRequestData, ClientChannelCodec, EngineChannelCodec, EngineCoreOutput,
    EngineCoreOutputs, MalformedFrameError, ModelRunnerOutput, NewRequestData,
    SampleLogprobs, SamplingParams, SchedulerOutput, ShutdownWorker, WorkerChannelCodec,
    WorkerError,
)


def _cached(entries) -> CachedRequestData:
    cached = CachedRequestData()
    for entry in entries:
        cached.add(*entry)
    return cached


def test_cached_request_data_packs_and_unpacks_every_shape():
    entries = [("a", [1], [], None), ("b", [2], [7, 8], None), ("c", [], [4], 0),
               ("d", [3, 4, 5], [], None), ("e", [6], [11], 13)]
    cached = _cached(entries)
    assert cached.unpack() == entries
    assert WorkerChannelCodec().decode(WorkerChannelCodec().encode(
        SchedulerOutput(1, scheduled_cached_reqs=cached))).scheduled_cached_reqs.unpack() == entries
    ones = _cached([("a", [1], []), ("b", [2], [])])
    assert ones.num_new_tokens == []  # the common decode step carries no counts


def _full_scheduler_output():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=33,
                            stop=["\n\n"], stop_token_ids=[2], ignore_eos=True, seed=7,
                            presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.1, logprobs=3)
    return SchedulerOutput(
        step_id=41,
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3, 4, 5], params, [7, 8], 4)],
        scheduled_cached_reqs=_cached([("b", [9], []), ("c", [10, 11], [3], 0)]),
        num_scheduled_tokens=[1, 1, 2], finished_req_ids=["z"], preempted_req_ids=["y"])


@pytest.mark.parametrize("msg", [_full_scheduler_output(), SchedulerOutput(step_id=0),
                                 ShutdownWorker()])
def test_to_worker_round_trip(msg):
    codec = WorkerChannelCodec()
    back = codec.decode(codec.encode(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", [
    ModelRunnerOutput(3, [5, -1, 9], [SampleLogprobs([5, 1], [-0.1, -2.5], 0), None, None]),
    ModelRunnerOutput(4), WorkerError(4, 1, "CUDA out of memory")])
def test_from_worker_round_trip(msg):
    codec = EngineChannelCodec()
    assert codec.decode(codec.encode(msg)) == msg


def test_client_outputs_round_trip():
    codec = ClientChannelCodec()
    msg = EngineCoreOutputs([EngineCoreOutput("a", [1], "x", 0, [], 16),
                             EngineCoreOutput("b", error="prompt is empty", finish_reason=3)])
    assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode(
    [99, 1, 2]), msgspec.msgpack.encode({"step_id": 1})])
def test_garbage_frames_raise_a_clear_error(frame):
    with pytest.raises(MalformedFrameError, match="malformed to-worker frame"):
        WorkerChannelCodec().decode(frame)


def test_invalid_sampling_params_inside_a_frame_is_malformed():
    good = WorkerChannelCodec().encode(_full_scheduler_output())
    raw = msgspec.msgpack.decode(good)
    raw[2][0][2][0] = -1.0  # temperature
    with pytest.raises(MalformedFrameError, match="temperature"):
        WorkerChannelCodec().decode(msgspec.msgpack.encode(raw))


def test_decode_step_costs_a_few_bytes_per_request():
    cached = _cached([(f"r{i}", [40000 + i], []) for i in range(256)])
    frame = WorkerChannelCodec().encode(SchedulerOutput(step_id=10**6, scheduled_cached_reqs=cached,
                                                        num_scheduled_tokens=[1] * 256))
    assert len(frame) / 256 <= 24


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("temperature", float("nan")),
    ("stop", [""]), ("stop_token_ids", [-1]), ("seed", 1.5), ("seed", True), ("seed", 2**64),
    ("seed", -2), ("temperature", float("inf")), ("temperature", 2.5),
    ("repetition_penalty", float("inf"))])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
