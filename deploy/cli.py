"""The `tierserve` command line."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap

from tierserve.runtime import envs
from tierserve.runtime.config import field_kind, option_fields

__all__ = ["main", "build_parser"]


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named, typed, limited and documented by the field
    (runtime/config.py); a flag left out keeps EngineConfig's default."""
    g = p.add_argument_group("engine options (every EngineConfig field)")
    for f in option_fields():
        flag = "--" + f.name.replace("_", "-")
        meta, kind = f.metadata, field_kind(f)
        help_text = meta["help"] + ("" if f.default is None else f" (default: {f.default})")
        if kind is bool:
            g.add_argument(flag, *meta["flags"], dest=f.name, default=argparse.SUPPRESS,
                           action=argparse.BooleanOptionalAction, help=help_text)
            continue
        if kind is dict:
            g.add_argument(flag, *meta["flags"], dest=f.name, type=_json_object,
                           default=argparse.SUPPRESS, metavar="JSON", help=help_text)
            continue
        g.add_argument(flag, *meta["flags"], dest=f.name, type=kind, default=argparse.SUPPRESS,
                       choices=meta["choices"],
                       metavar=None if meta["choices"] else kind.__name__.upper(), help=help_text)


def _json_object(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this request's sampling (--seed is the engine's)")
    g.add_argument("--stop", action="append", default=[])


def options_table() -> str:
    """The README's table of engine options, one row per EngineConfig field."""
    rows = ["| option | CLI flag | default | meaning |", "| --- | --- | --- | --- |"]
    for f in option_fields():
        flags = ", ".join(["--" + f.name.replace("_", "-"), *f.metadata["flags"]])
        choices = f.metadata["choices"]
        meaning = f.metadata["help"] + (f" ({' / '.join(choices)})" if choices else "")
        rows.append(f"| `{f.name}` | `{flags}` | `{f.default}` | {meaning} |")
    return "\n".join(rows)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line."""
    return {f.name: getattr(args, f.name) for f in option_fields() if hasattr(args, f.name)}


def sampling_params(args: argparse.Namespace):
    from tierserve.scheduler.params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.sampling_seed, stop=args.stop)


def _deployment_flags(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--name", required=required, default=None,
                   help="the deployment's name" + ("" if required else
                                                   " (run against a running deployment)"))
    p.add_argument("--namespace", default=None,
                   help=f"Ray namespace (default: {envs.default_namespace()})")


def _options_epilog() -> str:
    names = ", ".join("--" + f.name.replace("_", "-") for f in option_fields())
    return textwrap.fill(f"engine options (generate, chat and serve take each; `tierserve "
                         f"COMMAND --help` documents them): {names}", width=79,
                         break_on_hyphens=False, break_long_words=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierserve", description=__doc__,
                                     epilog=_options_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    _deployment_flags(gen, required=False)
    _engine_flags(gen)
    _sampling_flags(gen)
    srv = sub.add_parser("serve", help="start (or reuse) a named deployment on Ray")
    _deployment_flags(srv, required=True)
    _engine_flags(srv)
    for cmd, text in (("status", "a deployment's health, requests, KV usage and prefix hits "
                                 "(exits 1 when it is dead)"),
                      ("stop", "stop a deployment: engine, workers, placement group"),
                      ("abort", "abort one request of a deployment")):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("name")
        p.add_argument("--namespace", default=None)
        if cmd == "status":
            p.add_argument("--requests", action="store_true",
                           help="also list the unfinished requests")
        if cmd == "abort":
            p.add_argument("request_id")
    api = sub.add_parser("api-server", help="an OpenAI-compatible HTTP server in the "
                         "foreground (in front of --name, or of an engine of its own)")
    _deployment_flags(api, required=False)
    api.add_argument("--host", default="127.0.0.1", help="address to listen on")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--served-model-name", default=None,
                     help="the `model` requests name (default: the model's file or folder "
                          "name)")
    api.add_argument("--max-body-bytes", type=int, default=1 << 20,
                     help="larger request bodies are answered 413")
    keys = api.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' on /v1 (one tenant, 'default')")
    keys.add_argument("--api-keys-file", default=None, metavar="FILE",
                      help="TOML or JSON: [keys] key -> tenant, [tenants.NAME] limits "
                           "(requests_per_second, tokens_per_minute), secret (README)")
    _engine_flags(api)
    chat = sub.add_parser("chat", help="chat with the model (one message, or a REPL)")
    chat.add_argument("message", nargs="?", default=None,
                      help="one user message; without it, read messages from stdin")
    chat.add_argument("--system", default=None, help="a system prompt")
    _engine_flags(chat)
    _sampling_flags(chat)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from tierserve.deploy.ray_engine import serve
    handle = serve(args.name, args.namespace, **engine_options(args))
    info = handle.info()
    ns = args.namespace or envs.default_namespace()
    print(f"tierserve deployment {args.name!r} is running (namespace {ns!r}, "
          f"TP={info['tensor_parallel_size']}, max_model_len={info['max_model_len']}, "
          f"engine on {info['node_ip']}).")
    print(f"  python: handle = tierserve.connect({args.name!r}, namespace={ns!r})")
    print(f"  shell:  tierserve generate --name {args.name} \"PROMPT\"")
    print(f"  stop:   tierserve stop {args.name}")
    return 0


def cmd_api_server(args: argparse.Namespace) -> int:
    from tierserve.deploy.openai import KeyTable, ServerConfig, serve_http
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
                              max_body_bytes=args.max_body_bytes, keys=keys)
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
    from tierserve.deploy.ray_engine import connect
    from tierserve.runtime.executor import EngineDeadError
    try:
        llm = connect(args.name, args.namespace)
        stats = llm.stats()
    except EngineDeadError as e:
        print(f"deployment {args.name!r}: DEAD: {e}")
        return 1
    if stats["dead"]:
        print(f"deployment {args.name!r}: DEAD: {stats['dead']}")
        return 1
    print(f"deployment {args.name!r}: running")
    print(f"  running requests   {stats['num_running']}")
    print(f"  waiting requests   {stats['num_waiting']}")
    print(f"  KV usage           {stats['kv_usage']:.1%} of {stats['num_total_blocks']} blocks")
    print(f"  prefix hit rate    {stats['prefix_cache_hit_rate']:.1%} "
          f"({stats['prefix_cache_hit_tokens']} of {stats['prefix_cache_queried_tokens']} tokens)")
    print(f"  preemptions        {stats['num_preemptions']}")
    backend = stats.get("backend")
    if backend:
        paths = ", ".join(backend["paths"]) or "plain torch ops"
        print(f"  CPU backend        {backend['name']} ({paths}) on {backend['cpu']}")
    if args.requests:
        requests = llm.list_requests()
        print(f"  requests ({len(requests)}):")
        for r in requests:
            print(f"    {r['request_id']}  {r['status']:<9} prompt {r['prompt_tokens']:>6}  "
                  f"output {r['output_tokens']:>6}  age {r['age_s']:.1f} s")
    return 0


def cmd_abort(args: argparse.Namespace) -> int:
    from tierserve.deploy.ray_engine import connect
    if args.request_id in connect(args.name, args.namespace).engine.abort_now([args.request_id]):
        print(f"aborted {args.request_id!r}")
        return 0
    print(f"no unfinished request {args.request_id!r} in {args.name!r}", file=sys.stderr)
    return 1


def cmd_stop(args: argparse.Namespace) -> int:
    from tierserve.deploy.ray_engine import stop
    if not stop(args.name, args.namespace):
        print(f"no deployment named {args.name!r}", file=sys.stderr)
        return 1
    print(f"stopped {args.name!r}")
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    import asyncio
    from tierserve.deploy.ray_engine import connect
    handle = connect(args.name, args.namespace)

    async def run() -> str | None:
        async for delta in handle.generate(args.prompt, sampling_params(args)):
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
        out = llm.generate(args.prompt, sampling_params(args), use_tqdm=False)[0]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tierserve.runtime.llm import LLM
    params = sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    with LLM(**engine_options(args)) as llm:
        messages = [args.message] if args.message is not None else _read_messages()
        for message in messages:
            history.append({"role": "user", "content": message})
            out = llm.chat(history, params, use_tqdm=False)[0]
            if out.error:
                print(f"error: {out.error}", file=sys.stderr)
                return 1
            reply = out.outputs[0].text
            history.append({"role": "assistant", "content": reply})
            print(reply, flush=True)
    return 0


def _read_messages():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
            "api-server": cmd_api_server,
            "status": cmd_status, "stop": cmd_stop, "abort": cmd_abort}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
