"""The `tierserve` command line's entry point (`tierserve.deploy.cli:main`): parse, configure
logging, dispatch to the command, and map the errors every command shares to exit statuses.

The parser is cli_parser.py's, the engine and sampling options cli_options.py's; the commands
live in cli_inference.py (generate, chat, api-server), cli_deployment.py (serve, status, abort,
scale, stop) and cli_analyze.py. Their public names are re-exported here.
"""
from __future__ import annotations

import logging
import sys

from tierserve.deploy.cli_analyze import cmd_analyze
from tierserve.deploy.cli_deployment import cmd_abort, cmd_scale, cmd_serve, cmd_status, cmd_stop
from tierserve.deploy.cli_inference import cmd_api_server, cmd_chat, cmd_generate, model_name
from tierserve.deploy.cli_options import engine_options, options_table, sampling_params
from tierserve.deploy.cli_parser import build_parser
from tierserve.runtime import envs
from tierserve.runtime.errors import EngineDeadError

__all__ = ["main", "build_parser", "engine_options", "options_table", "sampling_params",
           "model_name", "COMMANDS"]

COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
            "api-server": cmd_api_server, "analyze": cmd_analyze,
            "status": cmd_status, "stop": cmd_stop, "abort": cmd_abort, "scale": cmd_scale}


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
