"""bench/side_by_side.py's --rounds: engines alternate their order round by round, each figure
is an engine's median over the rounds, and each ratio to vLLM the median of the rounds' own."""
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
