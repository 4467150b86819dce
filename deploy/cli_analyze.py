"""`tierserve analyze`: its flags and the command, which runs runtime/analyze/ on request logs
and prints the report (a table, or JSON) and optionally a plot.

The analysis and its report are imported when the command runs, so that building the parser
imports nothing heavy.
"""
from __future__ import annotations

import argparse

__all__ = ["add_analyze_parser", "cmd_analyze"]


def add_analyze_parser(sub) -> None:
    """The `analyze` subcommand on the subparsers `sub`."""
    a = sub.add_parser(
        "analyze", help="what prefix caches of each size would save on a request log",
        description="Prefix-sharing statistics of a workload, and a replay through the "
        "engine's own block manager and tiers at every capacity asked for: hit rate per tier, "
        "prefill tokens and TTFT saved, and the smallest tiers within 2%% of an unbounded "
        "cache.")
    a.add_argument("inputs", nargs="+", metavar="LOG",
                   help="request logs (--request-log), OpenAI request JSONL, ShareGPT JSON(L) "
                        "or Mooncake trace JSONL")
    a.add_argument("--model", default=None,
                   help="its tokenizer reads text inputs, its config sizes a KV block "
                        "(default: none; a log's header gives the block's size)")
    _tier_flags(a)
    _replay_flags(a)


def _tier_flags(a: argparse.ArgumentParser) -> None:
    """The capacities to replay at and what sizes a block's bytes."""
    a.add_argument("--device-blocks", type=_int_list, default=None, metavar="N[,N...]",
                   help="device pool sizes in blocks, null block included (num_kv_blocks) "
                        "(default: the engine's own, from its log)")
    a.add_argument("--cpu-bytes", type=_size_list, default=None, metavar="SIZE[,SIZE...]",
                   help="CPU tier sizes per rank, e.g. 0,4GiB,16GiB, as kv_offload_cpu_bytes "
                        "counts them (default: the engine's own from its log, else 0)")
    a.add_argument("--ssd-bytes", type=_size_list, default=None, metavar="SIZE[,SIZE...]",
                   help="SSD tier sizes, as kv_offload_ssd_bytes counts them (default: the "
                        "engine's own from its log, else 0)")
    a.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default: a log's own, else 16)")
    a.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                   help="KV dtype for a block's bytes (default: a log's, else float32)")
    a.add_argument("--tensor-parallel-size", "--tp", type=int, default=None,
                   help="ranks (a block's bytes are per rank; default: a log's, else 1)")


def _replay_flags(a: argparse.ArgumentParser) -> None:
    """The replay's timing and costs, and the report's form."""
    a.add_argument("--rate", type=float, default=None,
                   help="requests per second for inputs without times (default: each "
                        "arrives when the one before has finished)")
    a.add_argument("--output-len", type=int, default=128,
                   help="output tokens of a request whose input does not say (default: 128)")
    a.add_argument("--profile", action="store_true",
                   help="measure prefill, decode and tier-copy costs with the engine on this "
                        "machine, --model's (default: off; costs fitted to a log's TTFTs, "
                        "else assumed)")
    a.add_argument("--ssd-path", default=None,
                   help="folder --profile measures SSD speed in (default: the temp folder)")
    a.add_argument("--no-stats", dest="statistics", action="store_false",
                   help="skip the sharing statistics, whose memory grows with distinct blocks "
                        "(default: computed)")
    a.add_argument("--json", action="store_true",
                   help="print the figures as JSON (default: tables)")
    a.add_argument("--plot", default=None, metavar="FILE.png",
                   help="hit-rate curves against tier size, with matplotlib (default: none)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of ints: {text!r}") from None


def _size_list(text: str) -> list[int]:
    from tierserve.runtime.analyze.report import parse_size
    try:
        return [parse_size(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_analyze(args: argparse.Namespace) -> int:
    import json
    from tierserve.runtime.analyze import analyze
    from tierserve.runtime.analyze.report import check_plotting, format_report, plot_curves
    if args.plot:
        check_plotting()  # before the analysis, not after it
    costs = None
    if args.profile:
        from tierserve.runtime.analyze.profile import profile_costs
        costs = profile_costs(args.model, dtype=args.dtype or "auto",
                              block_size=args.block_size or 16, ssd_path=args.ssd_path)
    out = analyze(args.inputs, model=args.model, block_size=args.block_size,
                  device_blocks=args.device_blocks, cpu_bytes=args.cpu_bytes,
                  ssd_bytes=args.ssd_bytes, dtype=args.dtype,
                  tensor_parallel_size=args.tensor_parallel_size, costs=costs, rate=args.rate,
                  output_len=args.output_len, statistics=args.statistics)
    if args.plot:
        plot_curves(out, args.plot)
    print(json.dumps(out) if args.json else format_report(out))
    return 0
