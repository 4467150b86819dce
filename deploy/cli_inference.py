"""The commands that run prompts through an engine: generate, chat and api-server.

Each uses the deployment --name names, or starts an engine of its own from the command line's
engine options (and shuts it down on the way out). Each takes parsed arguments and returns the
exit status; a request's error goes to stderr with exit status 1, and Ctrl-C in chat is 130.
"""
from __future__ import annotations

import argparse
import os
import sys

from tierserve.deploy.cli_options import engine_options, sampling_params
from tierserve.runtime.hub_cache import hub_id_of

__all__ = ["cmd_generate", "cmd_chat", "cmd_api_server", "model_name"]


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


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream the completion from the deployment as it is generated."""
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


def cmd_api_server(args: argparse.Namespace) -> int:
    from tierserve.deploy.openai import KeyTable, ServerConfig, serve_http
    from tierserve.deploy.openai.connections import ConnectionLimits
    from tierserve.runtime.client import AsyncLLM
    keys = KeyTable.single(args.api_key) if args.api_key else \
        KeyTable.from_file(args.api_keys_file) if args.api_keys_file else None
    chat_template = chat_template_of(args.chat_template)
    options = engine_options(args)
    if args.model_tag is not None:
        if options.get("model", args.model_tag) != args.model_tag:
            raise ValueError(f"two models: {args.model_tag!r} and --model {options['model']!r}")
        options["model"] = args.model_tag
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
                              chat_template=chat_template,
                              trust_request_chat_template=args.trust_request_chat_template,
                              response_store_bytes=args.response_store_bytes,
                              reasoning_parser=args.reasoning_parser,
                              tool_call_parser=args.tool_call_parser,
                              allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                              body_timeout_s=args.body_timeout,
                              connections=ConnectionLimits(args.header_timeout,
                                                           args.max_connections_per_client))
        print(f"tierserve: serving {config.served_model_name!r} on "
              f"http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
        serve_http(engine, config, args.host, args.port, log_level=args.uvicorn_log_level,
                   access_log=not args.disable_log_requests)
    finally:
        if args.name is None:
            engine.shutdown()
    return 0


def chat_template_of(value: str | None) -> str | None:
    """--chat-template's template: the file it names, else the text itself when it reads as
    a Jinja template (vLLM's rule); a name of no file and no template is an error."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def model_name(model: str | None) -> str:
    """A model's name as a server reports it: its Hugging Face Hub id for a snapshot of the
    Hub cache (runtime/hub_cache.py), else its folder or file name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    hub_id = hub_id_of(model)
    if hub_id is not None:
        return hub_id
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base
