"""`kvforge bench quant`: per quantization method, weight memory, batch-1 and N-concurrent decode tok/s
and perplexity on a held-out text, side by side with fp32 / bf16 in one run (machines are shared and
noisy: only same-run ratios mean anything), and llama.cpp (llama-cpp-python on the embedded GGUF)
when it is installed.

GPTQ / AWQ rows use the checkpoints given with --gptq / --awq (e.g. made by `kvforge quantize`), else
round-to-nearest ones written into a temporary directory (app/quantize/rtn_writer.py): same layout and
kernels, so the speed and memory figures hold; only their perplexity is worse than calibrated ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvforge.app.bench.arguments import checked_model, use_threads
from kvforge.app.bench.runs import SMALL_KV_BYTES, bench_engine, run_batch
from kvforge.app.bench.workloads import eval_text, prompt_ids

METHODS = ("fp32", "bf16", "gptq", "awq", "bnb-int8", "bnb-nf4")


@dataclass
class QuantRow:
    method: str
    dtype: str
    weight_bytes: int | None
    decode_tok_s: float
    concurrent_tok_s: float | None
    perplexity: float | None


def decode_rate(engine, prompts: list[list[int]], decode_tokens: int) -> float:
    """Generated tok/s once every request has its first token (prefill excluded)."""
    return run_batch(engine, prompts, decode_tokens)["decode_tok_s"] or 0.0  # None: 1 token, no decode step


def measure(method: str, model: str, dtype: str, quant: str, args, ids: list[int], text_ids: list[int]) -> QuantRow:
    from kvforge.core.perplexity import perplexity

    engine = bench_engine(model=model, dtype=dtype, quant=quant, kv_cache_bytes=SMALL_KV_BYTES,
                          num_threads=args.threads, enable_prefix_caching=False)
    decode_rate(engine, [ids], 4)  # warm-up
    single = statistics.median(decode_rate(engine, [ids], args.decode_tokens) for _ in range(args.repeats))
    batch = [ids[i:] for i in range(args.concurrency)]  # distinct prompts
    concurrent = decode_rate(engine, batch, args.decode_tokens) if args.concurrency > 1 else None
    ppl = perplexity(engine, text_ids)
    return QuantRow(method, engine.config.dtype, engine.runtime().weight_bytes, single, concurrent, ppl)


def measure_llama_cpp(args, ids: list[int]) -> QuantRow | None:
    """llama-cpp-python on the embedded GGUF (Q4_1), batch-1 decode only; None when not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from kvforge.core.loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    llm = Llama(model_path=str(gguf), n_ctx=len(ids) + args.decode_tokens + 8, n_threads=args.threads or
                torch.get_num_threads(), verbose=False)
    rates = []
    for _ in range(args.repeats + 1):
        llm.reset()
        llm.eval(ids)
        token = llm.sample(temp=0)
        start = time.perf_counter()
        for _ in range(args.decode_tokens - 1):
            llm.eval([token])
            token = llm.sample(temp=0)
        rates.append((args.decode_tokens - 1) / (time.perf_counter() - start))
    return QuantRow("llama.cpp Q4_1", "gguf", gguf.stat().st_size, statistics.median(rates[1:]), None, None)


def run_quant(args: argparse.Namespace) -> list[QuantRow]:
    from kvforge.app.quantize.rtn_writer import write_rtn_checkpoint
    from kvforge.core.loader import resolve_model
    from kvforge.core.plugins import QUANT_GROUP, discover
    from kvforge.core.tokenizer import Tokenizer

    checked_model(args, ("prompt_tokens", "decode_tokens", "concurrency", "repeats"))
    path = resolve_model(args.model)  # the methods compared all start from the dense weights (a GGUF's conversion)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown method {unknown[0]!r} (choose from {', '.join(METHODS)})")
    installed = discover(QUANT_GROUP).plugins
    for method in methods:
        if method not in ("fp32", "bf16") and method not in installed:
            raise ValueError(f"--methods: quant plugin {method!r} is not installed")
    use_threads(args.threads)
    tokenizer = Tokenizer(path)
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    text_ids = tokenizer.encode(eval_text())
    say = (lambda *a, **k: None) if args.json else print
    say(f"model {path.name}; decode {args.decode_tokens} tokens at batch 1 (median of {args.repeats}) and "
          f"{args.concurrency} at once; perplexity on {len(text_ids)} held-out tokens; "
          f"{torch.get_num_threads()} threads; quantized rows in {args.dtype}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-quant-") as tmp:
        for method in methods:
            if method in ("fp32", "bf16"):
                model, dtype, quant = str(path), {"fp32": "float32", "bf16": "bfloat16"}[method], "none"
            elif method in ("gptq", "awq"):
                given = getattr(args, method)
                if given is None:
                    say(f"writing a round-to-nearest {method} checkpoint (4-bit, group 64, asymmetric)...")
                    given = write_rtn_checkpoint(path, Path(tmp) / method, method=method, sym=False)
                model, dtype, quant = str(given), args.dtype, "none"  # the checkpoint picks its method
            else:
                model, dtype, quant = str(path), args.dtype, method
            rows.append(measure(method, model, dtype, quant, args, ids, text_ids))
            if not args.json:
                _print_row(rows[-1], rows[0])
    if not args.no_llama_cpp:
        row = measure_llama_cpp(args, ids)
        if row is None:
            say("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python) - row skipped")
        else:
            rows.append(row)
            if not args.json:
                _print_row(row, rows[0])
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
    return rows


def _print_row(row: QuantRow, base: QuantRow) -> None:
    if row is base:
        print(f"{'method':<15} {'dtype':<9} {'weights MiB':>11} {'decode b1 tok/s':>15} {'concurrent tok/s':>16} "
              f"{'perplexity':>10} {'b1 vs first':>11} {'ppl vs first':>12}")
    mib = f"{row.weight_bytes / 2**20:.1f}" if row.weight_bytes else "-"
    conc = f"{row.concurrent_tok_s:.1f}" if row.concurrent_tok_s else "-"
    ppl = f"{row.perplexity:.2f}" if row.perplexity else "-"
    ppl_ratio = f"{row.perplexity / base.perplexity:.3f}x" if row.perplexity and base.perplexity else "-"
    print(f"{row.method:<15} {row.dtype:<9} {mib:>11} {row.decode_tok_s:>15.1f} {conc:>16} {ppl:>10} "
          f"{row.decode_tok_s / base.decode_tok_s:>10.2f}x {ppl_ratio:>12}", flush=True)


def add_parser(bench_sub) -> None:
    quant = bench_sub.add_parser("quant", help="weight memory, decode tok/s and perplexity per quantization method")
    quant.add_argument("--model", default=None, help="the dense model (default: the embedded one)")
    quant.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    quant.add_argument("--gptq", default=None, help="a GPTQ checkpoint dir (default: write a round-to-nearest one)")
    quant.add_argument("--awq", default=None, help="an AWQ checkpoint dir (default: write a round-to-nearest one)")
    quant.add_argument("--dtype", default="bfloat16", help="model dtype of the quantized rows (default: bfloat16)")
    quant.add_argument("--prompt-tokens", type=int, default=64)
    quant.add_argument("--decode-tokens", type=int, default=64)
    quant.add_argument("--concurrency", type=int, default=16, help="requests decoded at once (default: 16)")
    quant.add_argument("--repeats", type=int, default=3, help="batch-1 runs; the median is kept")
    quant.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp row")
    quant.add_argument("--json", action="store_true", help="print one JSON list of rows instead of the table")
    quant.add_argument("--threads", type=int, default=None)
    quant.set_defaults(func=lambda args: run_quant(args) and 0)
