"""The `tierserve` command line."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from tierserve.deploy.cli_analyze import cmd_analyze
from tierserve.deploy.cli_options import engine_options, options_table, sampling_params
from tierserve.deploy.cli_parser import build_parser
from tierserve.runtime import envs
from tierserve.runtime.errors import EngineDeadError

__all__ = ["main", "build_parser", "engine_options", "options_table", "sampling_params"]


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


def cmd_api_server(args: argparse.Namespace) -> int:
    from tierserve.deploy.openai import KeyTable, ServerConfig, serve_http
    from tierserve.deploy.openai.connections import ConnectionLimits
    from tierserve.runtime.client import AsyncLLM
    keys = KeyTable.single(args.api_key) if args.api_key else \
        KeyTable.from_file(args.api_keys_file) if args.api_keys_file else None
    options = engine_options(args)
    if args.name is not None:
        from tierserve.deploy.ray_engine import serve
        engine = serve(args.name, args.namespace, **options)
    else:
        engine = AsyncLLM(**options)
    try:
        info = engine.info()
        config = ServerConfig(served_model_name=args.served_model_name or
                              model_name(info.get("model")),
                              max_queued_requests=info["max_queued_requests"],
                              max_body_bytes=args.max_body_bytes, keys=keys,
                              body_timeout_s=args.body_timeout,
                              connections=ConnectionLimits(args.header_timeout,
                                                           args.max_connections_per_client))
        print(f"tierserve: serving {config.served_model_name!r} on "
              f"http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
        serve_http(engine, config, args.host, args.port)
    finally:
        if args.name is None:
            engine.shutdown()
    return 0


def model_name(model: str | None) -> str:
    """A model's name as a server reports it: its folder or file name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


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


def _generate_remote(args: argparse.Namespace) -> int:
    import asyncio
    from tierserve.deploy.ray_engine import connect
    handle = connect(args.name, args.namespace)
    params = sampling_params(args, handle.info()["generation_defaults"])

    async def run() -> str | None:
        async for delta in handle.generate(args.prompt, params):
            if delta.error:
                return delta.error
            print(delta.outputs[0].text, end="", flush=True)
        print()
        return None

    error = asyncio.run(run())
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.name is not None:
        return _generate_remote(args)
    from tierserve.runtime.llm import LLM
    with LLM(**engine_options(args)) as llm:
        params = sampling_params(args, llm.engine.info()["generation_defaults"])
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """One reply, or a REPL; Ctrl-D (end of input) and Ctrl-C leave it without a trace."""
    from tierserve.runtime.llm import LLM
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None and sys.stdin.isatty()
    with LLM(**engine_options(args)) as llm:
        params = sampling_params(args, llm.engine.info()["generation_defaults"], chat=True)
        messages = [args.message] if args.message is not None else _read_messages(interactive)
        try:
            for message in messages:
                history.append({"role": "user", "content": message})
                out = llm.chat(history, params, use_tqdm=False)[0]
                if out.error:
                    print(f"error: {out.error}", file=sys.stderr)
                    return 1
                reply = out.outputs[0].text
                history.append({"role": "assistant", "content": reply})
                print(reply, flush=True)
        except KeyboardInterrupt:
            if interactive:
                print()
            return 130
    if interactive:
        print()
    return 0


def _read_messages(interactive: bool):
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def _progress(message: str) -> None:
    """A line about a slow step, for a person watching a terminal."""
    if sys.stderr.isatty():
        print(f"tierserve: {message}", file=sys.stderr, flush=True)


def _configure_logging() -> None:
    """Warnings read as `tierserve: ...`; a chosen TIERSERVE_LOG_LEVEL below WARNING adds the
    level and logger. On a terminal the start's progress lines (weights, KV pool, kernels)
    show too."""
    level = envs.log_level()
    verbose = level in ("DEBUG", "INFO")
    fmt = "%(levelname)s %(name)s: %(message)s" if verbose else "tierserve: %(message)s"
    logging.basicConfig(level=level, format=fmt)
    if sys.stderr.isatty() and not verbose:
        progress = logging.getLogger("tierserve.progress")
        progress.setLevel(logging.INFO)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
            "api-server": cmd_api_server, "analyze": cmd_analyze,
            "status": cmd_status, "stop": cmd_stop, "abort": cmd_abort, "scale": cmd_scale}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging()
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineDeadError as e:
        print(f"error: the engine is dead: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
