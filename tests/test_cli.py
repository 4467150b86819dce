"""The CLI's engine flags come from EngineConfig's fields (one source for names, types, choices,
defaults and help), every option is reachable from the command line, and the README lists each
exactly once, as EngineConfig documents it."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tierserve.deploy.cli import build_parser, engine_options, options_table, sampling_params
from tierserve.deploy.cli_status import status_lines
from tierserve.runtime.config import EngineConfig, option_fields

README = Path(__file__).resolve().parents[1] / "README.md"
NAMES = [f.name for f in option_fields()]


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return out.getvalue()


def test_top_level_help_lists_every_engine_option_once():
    text = _help()
    for name in NAMES:
        flag = "--" + name.replace("_", "-")
        assert len(re.findall(re.escape(flag) + r"(?![\w-])", text)) == 1, flag


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_engine_command_takes_every_option(command):
    text = _help(command, *(["--name", "x"] if command == "serve" else []))
    for f in option_fields():
        assert "--" + f.name.replace("_", "-") in text, f.name
        assert f.metadata["help"].split(";")[0][:30] in " ".join(text.split()), f.name


def test_flags_parse_to_engine_config_values():
    argv = ["generate", "hi", "--tp", "3", "--dtype", "bfloat16", "--no-prefix-caching",
            "--gpu-memory-utilization", "0.5", "--cpu-isa", "avx2", "--seed", "7",
            "--sampling-seed", "9", "--placement-strategy", "SPREAD"]
    args = build_parser().parse_args(argv)
    options = engine_options(args)
    assert options == {"tensor_parallel_size": 3, "dtype": "bfloat16",
                       "enable_prefix_caching": False, "gpu_memory_utilization": 0.5,
                       "cpu_isa": "avx2", "seed": 7, "placement_strategy": "SPREAD"}
    assert EngineConfig.from_kwargs(**options).tensor_parallel_size == 3
    assert args.sampling_seed == 9
    # Flags left out keep EngineConfig's defaults: nothing is restated in the CLI.
    assert engine_options(build_parser().parse_args(["generate", "hi"])) == {}


def test_bad_flag_values_are_refused_by_argparse():
    for argv in (["generate", "x", "--dtype", "int8"], ["generate", "x", "--tp", "two"],
                 ["generate", "x", "--cpu-isa", "sse"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(argv)


def test_readme_table_is_engine_config():
    text = README.read_text()
    block = re.search(r"<!-- engine-options:begin[^>]*-->\n(.*?)\n<!-- engine-options:end -->",
                      text, re.S)
    assert block is not None, "README lacks the engine options table"
    assert block.group(1) == options_table(), (
        "README's engine options table is stale; regenerate it with "
        "python -c 'from tierserve.deploy.cli import options_table; print(options_table())'")
    for name in NAMES:
        assert len(re.findall(rf"^\| `{name}` \|", block.group(1), re.M)) == 1, name


@pytest.mark.parametrize("name,value,message", [
    ("hash_seed", "x", "hash_seed must be an int"),
    ("step_timeout_s", float("nan"), "step_timeout_s must be a finite number"),
    ("step_timeout_s", 0, "step_timeout_s must be > 0"),
    ("tensor_parallel_size", True, "tensor_parallel_size must be an int"),
    ("max_num_seqs", 2.0, "max_num_seqs must be an int"),
    ("enable_prefix_caching", 1, "enable_prefix_caching must be True or False"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be > 0.0 and <= 1.0"),
    ("num_kv_blocks", 1, "num_kv_blocks must be >= 2"),
    ("dtype", "int8", "dtype must be one of auto, float32"),
    ("model", 3, "model must be a string or None"),
])
def test_config_errors_name_the_field(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**{name: value})


def test_every_field_is_documented():
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f.name


_NO_TORCH = """
import sys
from tierserve.deploy.cli import main
for argv in ({argvs}):
    try:
        main(argv)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules))
"""


def test_help_and_argument_errors_import_neither_torch_nor_ray():
    """`tierserve --help` and a bad flag answer without the engine's heavy imports."""
    argvs = [["--help"], ["generate", "--help"], ["serve", "--help"], ["status", "--help"],
             ["generate", "x", "--no-such-flag"], ["serve"], ["generate", "x", "--tp", "two"]]
    out = subprocess.run([sys.executable, "-c", _NO_TORCH.format(argvs=argvs)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {a.dest}", a) for _, a in _actions(sub))
        elif not isinstance(action, argparse._HelpAction):
            yield action.dest, action


def test_every_flag_has_help_naming_its_default():
    for dest, action in _actions(build_parser()):
        assert action.help, dest
        if action.option_strings and action.required is False:
            assert "default" in action.help, f"{dest}: {action.help}"


def test_unset_sampling_flags_take_the_generation_defaults():
    parse = build_parser().parse_args
    defaults = {"temperature": 0.2, "top_p": 0.9}
    params = sampling_params(parse(["generate", "x"]), defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 16)
    params = sampling_params(parse(["generate", "x", "--temperature", "0", "--max-tokens", "5"]),
                             defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.9, 5)
    assert sampling_params(parse(["chat"]), defaults, chat=True).max_tokens is None
    assert sampling_params(parse(["chat"]), {"max_tokens": 64}, chat=True).max_tokens == 64
    assert sampling_params(parse(["generate", "x"]), {}).temperature == 1.0


def test_status_shows_tiers_backend_and_hits_per_tier():
    stats = {"num_running": 1, "num_waiting": 2, "kv_usage": 0.25, "num_free_blocks": 30,
             "num_total_blocks": 40, "block_size": 16, "prefix_cache_hit_rate": 0.5,
             "prefix_cache_hit_tokens": 10, "prefix_cache_queried_tokens": 20,
             "num_preemptions": 3, "cpu_tier_usage": 0.5, "cpu_tier_slots": 8,
             "tier_cpu_hit_blocks": 4, "ssd_tier_usage": 0.25, "ssd_tier_blocks": 16,
             "tier_ssd_hit_blocks": 2, "tier_promotions": 5, "tier_demotions": 6,
             "tier_loads": 2, "tier_spills": 1, "tier_swap_outs": 1, "tier_swap_ins": 1,
             "backend": {"name": "avx2", "paths": ["attention"], "cpu": "EPYC"},
             "dropped_frames": 0}
    info = {"namespace": "ns", "tensor_parallel_size": 2, "model": None, "node_ip": "1.2.3.4",
            "max_model_len": 512, "generation_defaults": {"temperature": 0.2},
            "startup_s": {"tokenizer": 0.5, "weights": 1.0, "total": 2.0}}
    text = "\n".join(status_lines("smol", stats, info))
    for part in ("1 running, 2 waiting", "25.0% of 40 blocks", "hit rate 50.0%",
                 "CPU: 50.0% of 8 slots, 4 blocks hit", "SSD: 25.0% of 16 blocks, 2 blocks hit",
                 "5 promotions, 6 demotions, 2 loads, 1 spills", "3 (1 swapped out",
                 "avx2 (attention) on EPYC", "temperature 0.2", "2.0 s (tokenizer 0.5"):
        assert part in text, (part, text)
    off = "\n".join(status_lines("smol", {k: v for k, v in stats.items()
                                         if "tier" not in k}, info))
    assert "KV tiers           off (--kv-offload-cpu-bytes" in off
