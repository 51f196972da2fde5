"""`kvforge bench kernels`: the kernels each linear shape and the decode attention of the model can run, timed
on this CPU (core/kernel_choice.py), and the one chosen; the timings refresh the cache the engine reads at load."""

from __future__ import annotations

import argparse
import json

from kvforge.app.bench.arguments import as_command, use_threads


def time_model_kernels(model: str | None, dtype: str) -> tuple[str, list]:
    """(the dtype resolved, the ShapeChoice per op class and shape) of `model` loaded with the stock kernels, timed."""
    from kvforge.core.config import EngineConfig
    from kvforge.core.kernel_choice import choose_kernels
    from kvforge.core.loader import load_config, resolve_model
    from kvforge.core.runner import ModelRunner

    config = EngineConfig(model=model, dtype=dtype, linear_kernels="torch", decode_attention="bmm")  # as loaded
    path = resolve_model(model)
    runner = ModelRunner(config, path, load_config(path), progress=False)
    try:
        return config.dtype, choose_kernels(runner.model, config.torch_dtype, retime=True)
    finally:
        runner.close()


def run_kernels(args: argparse.Namespace) -> list[dict]:
    from kvforge.core.cpu import describe_cpu

    use_threads(args.threads)
    rows = []
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        resolved, choices = time_model_kernels(args.model, dtype)
        rows += [{"dtype": resolved, "op": c.key.split(":")[0], "shape": c.key.split(":")[-1], "layers": c.layers,
                  "us": c.us, "choice": c.choice} for c in choices]
    if args.json:
        print(json.dumps({"cpu": describe_cpu(), "linears": rows}))
        return rows
    print(f"CPU: {describe_cpu()}")
    if not rows:
        print("nothing here offers a choice of kernels")
        return rows
    for op, unit in (("linear", "rows"), ("decode_attention", "context tokens")):
        table = [r for r in rows if (r["op"] == "decode_attention") == (op == "decode_attention")]
        if not table:
            continue
        kernels = list(dict.fromkeys(k for r in table for k in r["us"]))
        sizes = sorted({n for r in table for t in r["us"].values() for n in t})
        width = max(14, *(len(f"{k} @{n}") + 2 for k in kernels for n in sizes))
        head = "".join(f"{f'{k} @{n}':>{width}}" for k in kernels for n in sizes)
        shape = "heads x kv x dim" if op == "decode_attention" else "out x in"
        print(f"\n{op}: microseconds per call at N {unit}")
        print(f"{'dtype':<9} {'op':<16} {shape:<17} {'layers':>6}{head}  chosen")
        for r in table:
            cells = "".join(f"{r['us'].get(k, {}).get(n, float('nan')):>{width}.1f}" for k in kernels for n in sizes)
            print(f"{r['dtype']:<9} {r['op']:<16} {r['shape']:<17} {r['layers']:>6}{cells}  {r['choice']}")
    return rows


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `kernels` on the `kvforge bench` subcommands."""
    parser = bench_sub.add_parser("kernels", help="time the matmul kernels of each linear shape on this CPU and "
                                  "show (and cache) the one the engine will choose")
    parser.add_argument("--model", default=None, help="the model (default: the embedded one)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes to time (default: float32,bfloat16)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.set_defaults(func=as_command(run_kernels))
    return parser
