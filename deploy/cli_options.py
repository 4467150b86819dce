"""The CLI's engine and sampling options, both ways: the flags built from EngineConfig's fields
(runtime/config.py) and the sampling parameters, and the values read back from parsed arguments.

EngineConfig is the one source of a flag's name, type, choices, default and help; a flag left
out is absent from the parsed arguments, so EngineConfig's default applies and nothing is
restated here. The README's options table is generated from the same fields.
"""
from __future__ import annotations

import argparse
import textwrap

from tierserve.runtime import envs
from tierserve.runtime.config import field_kind, option_fields
from tierserve.runtime.hub_cache import HUB_ARGS
from tierserve.runtime.vllm_args import VLLM_ARGS

__all__ = ["options_table", "engine_options", "sampling_params"]


def engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named, typed, limited and documented by the field
    (runtime/config.py); a flag left out keeps EngineConfig's default."""
    g = p.add_argument_group("engine options (every EngineConfig field)")
    for f in option_fields():
        flag = "--" + f.name.replace("_", "-")
        meta, kind = f.metadata, field_kind(f)
        help_text = meta["help"] + ("" if "default:" in meta["help"] else
                                    f" (default: {'none' if f.default is None else f.default})")
        if kind is bool:
            g.add_argument(flag, *meta["flags"], dest=f.name, default=argparse.SUPPRESS,
                           action=argparse.BooleanOptionalAction, help=help_text)
            continue
        if kind is dict and meta["cli_words"]:
            g.add_argument(flag, *meta["flags"], dest=f.name, nargs="+",
                           default=argparse.SUPPRESS, metavar="WORD", help=help_text)
            continue
        if kind is dict:
            g.add_argument(flag, *meta["flags"], dest=f.name, type=_json_object,
                           default=argparse.SUPPRESS, metavar="JSON", help=help_text)
            continue
        g.add_argument(flag, *meta["flags"], dest=f.name, type=kind, default=argparse.SUPPRESS,
                       choices=meta["choices"],
                       metavar=None if meta["choices"] else kind.__name__.upper(), help=help_text)
    vllm_flags(p)


def vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags that are not tierserve options (runtime/vllm_args.py): accepted
    where they ask for what tierserve does, else refused with what it does instead."""
    g = p.add_argument_group("vLLM's engine flags (accepted where they ask for what tierserve "
                             "does)")
    for name, help_text in HUB_ARGS.items():
        g.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                       metavar="STR", help=help_text)
    for name, arg in VLLM_ARGS.items():
        flag = "--" + name.replace("_", "-")
        shown = " or ".join(repr(a) for a in arg.accepts if not isinstance(a, float))
        help_text = f"{arg.meaning} (accepted: {shown}; default: none)"
        if arg.kind is bool:
            g.add_argument(flag, dest=name, default=argparse.SUPPRESS,
                           action=argparse.BooleanOptionalAction, help=help_text)
        else:
            g.add_argument(flag, dest=name, type=arg.kind, default=argparse.SUPPRESS,
                           metavar=arg.kind.__name__.upper(), help=help_text)


def _json_object(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def sampling_flags(p: argparse.ArgumentParser, chat: bool) -> None:
    """The per-request sampling flags; each defaults to None so that the model's generation
    defaults fill what is left out (sampling_params)."""
    g = p.add_argument_group(
        "sampling (a flag left out takes the model's default: --generation-config says where "
        "defaults come from; `tierserve status` shows a deployment's)")
    rest = "the rest of the context" if chat else "16, vLLM's"
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens to generate (default: the generation config's "
                        f"max_new_tokens, else {rest})")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the generation config's, else 1.0)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass (default: the generation config's, else 1.0)")
    g.add_argument("--top-k", type=int, default=None,
                   help="sample from the k likeliest tokens; 0 or -1: all (default: the "
                        "generation config's, else 0)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below this share of the likeliest one's probability "
                        "(default: the generation config's, else 0.0)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages repeating tokens (default: the generation config's, "
                        "else 1.0)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this request's sampling (default: none; the engine's --seed "
                        "seeds unseeded requests)")
    g.add_argument("--stop", action="append", default=[],
                   help="a string that ends the output (repeatable; default: none)")


def deployment_flags(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--name", required=required, default=None,
                   help="the deployment's name" + (" (required)" if required else
                                                   " (default: none, an engine of its own)"))
    namespace_flag(p)


def namespace_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default=None,
                   help=f"Ray namespace of the deployment (default: TIERSERVE_NAMESPACE, else "
                        f"{envs.default_namespace()!r})")


def options_epilog() -> str:
    """The top-level help's list of every engine flag, wrapped for an 80-column terminal."""
    names = ", ".join("--" + f.name.replace("_", "-") for f in option_fields())
    return textwrap.fill(f"engine options (generate, chat and serve take each; `tierserve "
                         f"COMMAND --help` documents them): {names}", width=79,
                         break_on_hyphens=False, break_long_words=False)


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
    names = [f.name for f in option_fields()] + list(HUB_ARGS) + list(VLLM_ARGS)
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def sampling_params(args: argparse.Namespace, defaults: dict, chat: bool = False):
    """The request's SamplingParams: the flags given, else the engine's generation defaults,
    else vLLM's (a chat reply may take the rest of the context, as vLLM's server allows)."""
    from tierserve.runtime.generation_config import sampling_params_with
    if chat and "max_tokens" not in defaults:
        defaults = dict(defaults, max_tokens=None)
    return sampling_params_with(
        defaults, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed, stop=args.stop or None)
