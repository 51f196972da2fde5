"""The `kvforge` command line: serve, generate, chat, bench, cache, quantize, models, pull, plugins.

parser.py builds the argparse tree; serve.py, repl.py (generate / chat) and plugins.py run the verbs."""

from __future__ import annotations

import logging
import os
import sys

from kvforge.app.cli.parser import build_parser
from kvforge.app.models.factory import torchrun_world_size

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    if torchrun_world_size() > 1 and os.environ["RANK"] != "0":
        # a rank > 0 started by torchrun (multi-machine tensor or pipeline parallelism): whatever the command line,
        # it serves rank 0's commands; rank 0 runs the command and sends it the model to load
        from kvforge.core.ranks import worker_main

        worker_main()
        return 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from kvforge.core.loader import ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, ValueError) as exc:  # user errors: one clear line, no traceback
        print(f"kvforge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
