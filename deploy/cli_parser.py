"""The `tierserve` argument parser: every subcommand, its arguments and help texts.

The engine and sampling flags come from cli_options.py and analyze's from cli_analyze.py.
Building the parser imports neither torch nor Ray, so `--help` and a bad flag answer fast.
"""
from __future__ import annotations

import argparse

from tierserve.deploy.cli_analyze import add_analyze_parser
from tierserve.deploy.cli_options import (deployment_flags, engine_flags, namespace_flag,
                                          options_epilog, sampling_flags)

__all__ = ["build_parser"]

DESCRIPTION = "The `tierserve` command line."

# The commands that act on a running deployment named by a positional argument.
_DEPLOYMENT_COMMANDS = (
    ("status", "a deployment's health, requests, KV usage and prefix hits (exits 1 when it is "
               "dead)"),
    ("stop", "stop a deployment: engine, workers, placement group"),
    ("abort", "abort one request of a deployment"),
    ("scale", "add replicas to a replicated deployment, or drain and remove some"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierserve", description=DESCRIPTION,
                                     epilog=options_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt", help="the text to complete")
    deployment_flags(gen, required=False)
    engine_flags(gen)
    sampling_flags(gen, chat=False)
    srv = sub.add_parser("serve", help="start (or reuse) a named deployment on Ray")
    deployment_flags(srv, required=True)
    engine_flags(srv)
    for cmd, text in _DEPLOYMENT_COMMANDS:
        _deployment_command_parser(sub, cmd, text)
    _api_server_parser(sub)
    chat = sub.add_parser("chat", help="chat with the model (one message, or a REPL)")
    chat.add_argument("message", nargs="?", default=None,
                      help="one user message (default: a REPL reading messages from stdin; "
                           "Ctrl-D or Ctrl-C leaves it)")
    chat.add_argument("--system", default=None,
                      help="a system prompt (default: the chat template's)")
    engine_flags(chat)
    sampling_flags(chat, chat=True)
    add_analyze_parser(sub)
    return parser


def _deployment_command_parser(sub, cmd: str, text: str) -> None:
    p = sub.add_parser(cmd, help=text)
    p.add_argument("name", help="the deployment's name")
    namespace_flag(p)
    if cmd == "status":
        p.add_argument("--requests", action="store_true",
                       help="also list the unfinished requests (default: off)")
    if cmd == "abort":
        p.add_argument("request_id", help="the request's id (`status --requests` lists "
                                          "them)")
    if cmd == "scale":
        p.add_argument("--data-parallel-size", "--dp", dest="data_parallel_size", type=int,
                       required=True, help="the number of replicas wanted (required)")


def _api_server_parser(sub) -> None:
    api = sub.add_parser("api-server", help="an OpenAI-compatible HTTP server in the "
                         "foreground (in front of --name, or of an engine of its own)")
    deployment_flags(api, required=False)
    api.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default: 127.0.0.1)")
    api.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    api.add_argument("--served-model-name", default=None,
                     help="the `model` requests name (default: the model's file or folder "
                          "name)")
    api.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="a Jinja chat template (its file, or the template itself) for chat "
                          "requests that send none, in place of the model's (default: the "
                          "model's)")
    api.add_argument("--trust-request-chat-template", action="store_true",
                     help="take a chat_template sent in a request (vLLM's flag; a template is "
                          "code the server runs, so by default a request's is refused with "
                          "400)")
    api.add_argument("--max-body-bytes", type=int, default=1 << 20,
                     help="larger request bodies are answered 413 (default: 1048576)")
    api.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="take POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                          "(vLLM's): LoRA adapters added and removed while serving, each a "
                          "folder on this machine (needs enable_lora; default: off)")
    api.add_argument("--tool-call-parser", default="hermes",
                     choices=("hermes", "llama3_json", "mistral", "pythonic"),
                     help="how the model writes tool calls, read back for tool_choice auto "
                          "(default: hermes, <tool_call> blocks)")
    api.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"),
                     help="return a thinking model's <think> text apart from its answer, as "
                          "chat's `reasoning` (and `reasoning_content`) (default: none)")
    api.add_argument("--response-store-bytes", type=int, default=64 << 20, metavar="BYTES",
                     help="memory for stored responses (/v1/responses with store: true), the "
                          "least recently used dropped first; 0 keeps none (default: "
                          "67108864)")
    api.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="a request head must arrive whole within this long, else 408 "
                          "(default: 10)")
    api.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="a request body must arrive whole within this long, else 408 "
                          "(default: 30)")
    api.add_argument("--max-connections-per-client", type=int, default=256, metavar="N",
                     help="open connections one client address may hold; more are answered "
                          "429 (default: 256)")
    api.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model, as `vllm serve MODEL` takes it (the same as --model; "
                          "default: none, --model's)")
    api.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="vLLM's flag, accepted: tool_choice auto is always served, "
                          "--tool-call-parser reading the calls (default: off, changing "
                          "nothing)")
    api.add_argument("--disable-log-requests", action="store_true",
                     help="no access-log line per request (uvicorn's, at log level info; "
                          "default: logged)")
    api.add_argument("--uvicorn-log-level", default=None,
                     choices=("critical", "error", "warning", "info", "debug", "trace"),
                     help="uvicorn's log level (default: TIERSERVE_LOG_LEVEL's)")
    keys = api.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' on /v1 (one tenant, "
                           "'default'; default: no key)")
    keys.add_argument("--api-keys-file", default=None, metavar="FILE",
                      help="TOML or JSON: [keys] key -> tenant, [tenants.NAME] limits "
                           "(requests_per_second, tokens_per_minute), secret (README; "
                           "default: none)")
    engine_flags(api)
