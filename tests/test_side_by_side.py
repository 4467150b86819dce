"""bench/side_by_side.py's --rounds: engines alternate their order round by round, each figure
is an engine's median over the rounds, and each ratio to vLLM the median of the rounds' own; a
variant's decode is paired with tierserve's in one process, its ratio read from those pairs."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "bench"))  # last: shadows nothing
import side_by_side  # noqa: E402

ENGINES = [{"label": "tierserve", "kind": "tierserve", "options": {}},
           {"label": "vllm", "kind": "vllm", "options": {}}]
# Per round: (tierserve output tok/s, vLLM output tok/s); the machine slows in round 2.
FIGURES = [(800.0, 500.0), (600.0, 300.0), (780.0, 520.0)]


def test_rounds_alternate_the_order_and_pair_the_ratios(monkeypatch):
    orders, tags = [], []

    def fake_run(args, spec, hf_folder, runs, log_dir, engines, tag=""):
        r = len(orders)
        orders.append([e["label"] for e in engines])
        tags.append(tag)
        ours, theirs = FIGURES[r]
        return {"tierserve": {"float32": {"output_tok_s": ours, "throughput_token_ids": [[r]]}},
                "vllm": {"float32": {"output_tok_s": theirs, "throughput_token_ids": [[r]]}}}

    monkeypatch.setattr(side_by_side, "run_engines", fake_run)
    results = side_by_side.run_rounds(SimpleNamespace(rounds=3), {}, None, [], "/tmp", ENGINES)
    assert orders == [["tierserve", "vllm"], ["vllm", "tierserve"], ["tierserve", "vllm"]]
    assert tags == ["-r1", "-r2", "-r3"]
    ours = results["tierserve"]["float32"]
    assert ours["output_tok_s"] == 780.0 and ours["rounds"]["output_tok_s"] == [800, 600, 780]
    assert ours["throughput_token_ids"] == [[0]]  # the first round's, for the agreement
    row = side_by_side.table_rows(results, ["float32"], 512)[0]
    # Round ratios 1.6, 2.0, 1.5: their median, not the medians' ratio (780 / 500 = 1.56).
    assert row["tierserve/vllm"] == pytest.approx(1.6)
    assert row["tierserve/vllm by round"] == pytest.approx([1.6, 2.0, 1.5])
    assert row["met"] is True


def test_one_round_keeps_the_plain_ratio(monkeypatch):
    monkeypatch.setattr(side_by_side, "run_engines", lambda *a, **k: {
        "tierserve": {"float32": {"output_tok_s": 700.0}},
        "vllm": {"float32": {"output_tok_s": 500.0}}})
    results = side_by_side.run_rounds(SimpleNamespace(rounds=1), {}, None, [], "/tmp", ENGINES)
    row = side_by_side.table_rows(results, ["float32"], 512)[0]
    assert "rounds" not in results["tierserve"]["float32"]
    assert row["tierserve/vllm"] == pytest.approx(1.4) and row["met"] is False
    assert "tierserve/vllm by round" not in row


def test_a_variant_pairs_its_decode_with_tierserve_in_its_process(monkeypatch):
    """A variant's first-dtype process runs paired_decode with tierserve's engine options as its
    base; tierserve's own processes and the variant's other dtypes do not."""
    specs = []
    monkeypatch.setattr(side_by_side, "run_driver",
                        lambda argv, spec, env, log: specs.append(spec) or {})
    engines = [{"label": "tierserve", "kind": "tierserve", "options": {"async": True}},
               {"label": "tierserve[q8]", "kind": "tierserve",
                "options": {"async": True, "quantization": "q8_0"}}]
    runs = [("float32", ["throughput", "decode"]), ("bfloat16", ["decode"])]
    side_by_side.run_engines(SimpleNamespace(vllm_fresh_cache=False), {"output_len": 8}, None,
                             runs, "/tmp", engines)
    assert [(s["dtype"], s["engine_options"]) for s in specs] == [
        ("float32", {"async": True}), ("bfloat16", {"async": True}),
        ("float32", engines[1]["options"]), ("bfloat16", engines[1]["options"])]
    assert all("paired_decode" not in s["sections"] and "paired_base" not in s
               for s in (specs[0], specs[1], specs[3]))
    assert specs[2]["sections"] == ["throughput", "decode", "paired_decode"]
    assert specs[2]["paired_base"] == {"async": True}


def test_variant_rows_pool_the_rounds_and_read_the_interleaved_ratio():
    def paired(own_tok_s, base_tok_s, own_ms, base_ms):
        # paired_decode's ratios are the other engine's over this one's (speeds; step times
        # the other way round)
        return {"ratios": {"base": [b / o for o, b in zip(own_tok_s, base_tok_s)]},
                "interleaved": {"ratios": {"base": [o / b for o, b in zip(own_ms, base_ms)]}}}

    rounds = [paired([150, 160], [80, 100], [6.0], [12.0]), paired([140], [70], [7.0], [12.6])]
    results = {"tierserve": {"float32": {}},
               "tierserve[q8]": {"float32": {"paired_decode": rounds[0],
                                             "paired_decode_rounds": rounds}}}
    engines = [{"label": "tierserve", "kind": "tierserve", "options": {}},
               {"label": "tierserve[q8]", "kind": "tierserve",
                "options": {"quantization": "q8_0"}}]
    [row] = side_by_side.variant_rows(results, ["float32"], engines)
    assert row["engine"] == "tierserve[q8]"
    assert row["by round"] == pytest.approx([1.875, 1.6, 2.0])
    assert row["ratio"] == pytest.approx(1.875)
    assert row["interleaved"] == pytest.approx(1.9)
    assert row["target"] == ">= 1.8x" and row["met"] is True
    results["tierserve[q8]"]["float32"]["paired_decode_rounds"] = [rounds[1]]
    rounds[1]["interleaved"]["ratios"]["base"] = [7.0 / 12.0]
    assert side_by_side.variant_rows(results, ["float32"], engines)[0]["met"] is False


def test_interleaved_steps_time_tokens_of_an_engine_that_speculates(monkeypatch):
    """A speculating engine emits several tokens a step and ends its stream in fewer steps:
    the interleaved rounds step the engines until each stream ends and compare time per token,
    not per step. The clock is the engines' own (each step advances it by the engine's cost)."""
    import engine_driver
    clock = [0.0]
    monkeypatch.setattr(engine_driver.time, "perf_counter", lambda: clock[0])

    class Stepper:
        def __init__(self, step_s: float, per_step: int) -> None:
            self.step_s, self.per_step = step_s, per_step

        def stream_steps(self, prompt, max_tokens):
            yield [SimpleNamespace(new_token_ids=[1])]  # the prefill's token
            left = max_tokens - 1
            while left > 0:
                clock[0] += self.step_s
                k = min(self.per_step, left)
                left -= k
                yield [SimpleNamespace(new_token_ids=[1] * k)]

    # The plain engine: 10 ms a token; the speculating one: 15 ms a step of 3 tokens.
    got = engine_driver.interleaved_steps(
        {"plain": Stepper(0.010, 1), "ngram": Stepper(0.015, 3)}, [1, 2, 3], 12, 2)
    assert got["token_ms"]["plain"] == pytest.approx([10.0, 10.0])
    assert got["token_ms"]["ngram"] == pytest.approx([5.0, 5.0])
    assert got["ratio"]["ngram"] == pytest.approx(2.0)


def test_the_paired_decode_takes_the_decode_workloads_own_prompts():
    """Random distinct prompts for the default workload; a workload's own pairs (what a
    speculating variant drafts from) again and again, pair by pair, for the others."""
    args = SimpleNamespace(decode_repeats=1, ttft_repeats=1, prompt_len=8, paired_rounds=2,
                           cpu_isa="auto", max_model_len=64, kv_cache_gib=1,
                           output_len=4)
    plain = side_by_side.base_spec(args, [[1, 2]], dtypes=["float32"])["paired_decode_prompts"]
    assert len(plain) == 12 and len({tuple(p) for p in plain}) == 12
    assert all(len(p) == 8 for p in plain)
    edit = [[5, 6, 7], [8, 9, 10]]
    paired = side_by_side.base_spec(args, [[1, 2]], edit, dtypes=["float32"])
    assert paired["paired_decode_prompts"] == edit * 6
    assert paired["decode_prompts"] == edit
