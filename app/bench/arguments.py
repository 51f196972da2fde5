"""The benches' argument checks, done before anything loads (a bad one is a ValueError: exit 2), the
thread settings they derive from --threads, and the argparse `func` that runs a bench."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def checked_model(args: argparse.Namespace, positive: tuple[str, ...]) -> Path:
    """Fail on bad bench arguments before anything loads: each option in `positive` must be >= 1, the
    dtype must exist. Returns the resolved model directory (config, tokenizer) as the default engine reads it: a
    GGUF's index, not a dense conversion. Engines get `args.model` itself, so that a GGUF (the embedded default
    included) is measured as `kvforge serve` runs it, from its own blocks."""
    from kvforge.core.config import EngineConfig
    from kvforge.core.loader import resolve_model

    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    config = EngineConfig(dtype=args.dtype)
    args.dtype = config.dtype  # "auto" resolved: the reports name the dtype measured
    return resolve_model(args.model, native_gguf=config.native_gguf)


def add_model_options(parser: argparse.ArgumentParser, model_help: str = "the model (default: the embedded one)",
                      dtype: str | None = None, dtype_help: str = "model dtype") -> None:
    """--model and --dtype, as every bench takes them; the dtype's default is the engine's unless the bench
    measures another one."""
    from kvforge.core.config import engine_default

    default = dtype or engine_default("dtype")
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--dtype", default=default, help=f"{dtype_help} (default: {default})")


def bench_parser(bench_sub, name: str, help: str, run: Callable[[argparse.Namespace], object], *,
                 dtype_help: str = "model dtype", threads_help: str | None = None) -> argparse.ArgumentParser:
    """`kvforge bench NAME` with what the table benches share: --model and --dtype, --threads, --json (one JSON
    object instead of the table), and `run` as the command. The bench adds its own options to what it returns."""
    parser = bench_sub.add_parser(name, help=help)
    add_model_options(parser, dtype_help=dtype_help)
    parser.add_argument("--threads", type=int, default=None, help=threads_help)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.set_defaults(func=as_command(run))
    return parser


def int_list(text: str, option: str, what: str = "integers") -> list[int]:
    """--option's comma-separated integers, each >= 1 (`what` names them in the errors)."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{option} must be {what} separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{option} must be {what} >= 1, got {text!r}")
    return values


def use_threads(threads: int | None) -> None:
    """--threads for this process's torch (None: torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def rank_threads(threads: int | None, tp: int) -> int | None:
    """Each tensor-parallel rank's share of `threads` (None: the ranks split torch's default themselves)."""
    return None if threads is None else max(1, threads // tp)


def as_command(run: Callable[[argparse.Namespace], object]) -> Callable[[argparse.Namespace], int]:
    """A bench's `run` as the argparse `func`: its result is printed by `run`; the exit status is 0 (a failure
    raises)."""
    def command(args: argparse.Namespace) -> int:
        run(args)
        return 0

    return command
