"""The CLI's engine flags come from EngineConfig's fields (one source for names, types, choices,
defaults and help), every option is reachable from the command line, and the README lists each
exactly once, as EngineConfig documents it."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest

from tierserve.deploy.cli import build_parser, engine_options, options_table
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
