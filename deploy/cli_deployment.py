"""The commands that manage a named deployment on Ray: serve, status, abort, scale and stop.

Each takes parsed arguments and returns the exit status; Ray and the client side are imported
when a command runs, never torch (the engine is imported inside its actor's process). A
command's report goes to stdout and a refusal to stderr with exit status 1.
"""
from __future__ import annotations

import argparse
import sys

from tierserve.deploy.cli_options import engine_options
from tierserve.runtime import envs
from tierserve.runtime.errors import EngineDeadError

__all__ = ["cmd_serve", "cmd_status", "cmd_abort", "cmd_scale", "cmd_stop"]


def cmd_serve(args: argparse.Namespace) -> int:
    from tierserve.deploy.ray_engine import serve
    _progress(f"serving {args.name!r}: joining its Ray cluster, starting the deployment if it "
              f"is not running (loading the model takes a while)")
    handle = serve(args.name, args.namespace, **engine_options(args))
    info = handle.info()
    ns = args.namespace or envs.default_namespace()
    replicas = info.get("data_parallel_size", 1)
    where = f"{replicas} replicas behind a router ({info['routing_policy']} routing)" \
        if replicas > 1 else f"engine on {info['node_ip']}"
    print(f"tierserve deployment {args.name!r} is running (namespace {ns!r}, "
          f"TP={info['tensor_parallel_size']}, max_model_len={info['max_model_len']}, "
          f"{where}).")
    print(f"  python: handle = tierserve.connect({args.name!r}, namespace={ns!r})")
    print(f"  shell:  tierserve generate --name {args.name} \"PROMPT\"")
    print(f"  status: tierserve status {args.name}")
    print(f"  stop:   tierserve stop {args.name}")
    return 0


def _progress(message: str) -> None:
    """A line about a slow step, for a person watching a terminal."""
    if sys.stderr.isatty():
        print(f"tierserve: {message}", file=sys.stderr, flush=True)


def cmd_status(args: argparse.Namespace) -> int:
    from tierserve.deploy.cli_status import replica_lines, request_lines, status_lines
    from tierserve.deploy.ray_engine import connect
    try:
        llm = connect(args.name, args.namespace)
        stats = llm.stats()
        info = llm.info() if not stats["dead"] else {}
    except EngineDeadError as e:
        print(f"deployment {args.name!r}: DEAD: {e}")
        return 1
    if stats["dead"]:
        print(f"deployment {args.name!r}: DEAD: {stats['dead']}")
        return 1
    print("\n".join(status_lines(args.name, stats, info)))
    if "replicas" in stats:
        print("\n".join(replica_lines(stats)))
    if args.requests:
        print("\n".join(request_lines(llm.list_requests())))
    return 0


def cmd_abort(args: argparse.Namespace) -> int:
    from tierserve.deploy.ray_engine import connect
    if connect(args.name, args.namespace).engine.abort_now([args.request_id]):
        print(f"aborted {args.request_id!r}")
        return 0
    print(f"no unfinished request {args.request_id!r} in {args.name!r}", file=sys.stderr)
    return 1


def cmd_scale(args: argparse.Namespace) -> int:
    from tierserve.deploy.ray_engine import connect
    engine = connect(args.name, args.namespace).engine
    if not hasattr(engine, "scale"):
        print(f"deployment {args.name!r} runs one engine without a router; serve it with "
              f"--dp 2 or more to scale it", file=sys.stderr)
        return 1
    result = engine.scale(args.data_parallel_size)
    for error in result["errors"]:
        print(f"error: {error}", file=sys.stderr)
    print(f"deployment {args.name!r}: {result['replicas']} replicas")
    return 1 if result["errors"] else 0


def cmd_stop(args: argparse.Namespace) -> int:
    from tierserve.deploy import ray_cluster
    from tierserve.deploy.ray_engine import stop
    head = ray_cluster.local_head()
    if not stop(args.name, args.namespace):
        print(f"no deployment named {args.name!r}", file=sys.stderr)
        return 1
    print(f"stopped {args.name!r}")
    if head is not None and ray_cluster.local_head() is None:
        print(f"stopped the local Ray head at {head.address} (its last deployment is gone)")
    return 0
