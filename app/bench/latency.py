"""`kvforge bench latency`: prefill and batch-1 decode speed of kvforge against HF transformers
`generate`, both measured in the same run on the same prompt (machines are shared and noisy, so
only same-run ratios mean anything)."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from kvforge.app.bench.arguments import as_command, int_list, rank_threads, use_threads
from kvforge.app.bench.references import hf_generate, load_hf
from kvforge.app.bench.runs import SMALL_KV_BYTES, bench_engine
from kvforge.app.bench.workloads import prompt_ids


@dataclass
class Result:
    engine: str
    dtype: str
    prefill_tok_s: float
    decode_tok_s: float


def bench_kvforge(model: str | None, dtype: str, ids: list[int], decode_tokens: int, repeats: int,
                  threads: int | None, tp: int = 1) -> Result:
    # prefix caching off: every repeat must prefill the whole prompt again
    engine = bench_engine(model=model, dtype=dtype, kv_cache_bytes=SMALL_KV_BYTES,
                          num_threads=rank_threads(threads, tp), enable_prefix_caching=False, tp_size=tp)
    try:
        prefill, decode = _time_requests(engine, ids, decode_tokens, repeats)
    finally:
        engine.close()
    name = "kvforge" if tp == 1 else f"kvforge tp {tp}"
    return Result(name, dtype, statistics.median(prefill[1:]), statistics.median(decode[1:]))


def _time_requests(engine, ids: list[int], decode_tokens: int, repeats: int) -> tuple[list[float], list[float]]:
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    prefill, decode = [], []
    for _ in range(repeats + 1):  # the first run warms up
        engine.add_request(ids, params)
        start = time.perf_counter()
        engine.step()  # the whole prompt fits one step: prefill + first token
        first = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        end = time.perf_counter()
        prefill.append(len(ids) / (first - start))
        decode.append((decode_tokens - 1) / (end - first))
    return prefill, decode


def bench_hf(path, dtype: str, ids: list[int], decode_tokens: int, repeats: int) -> Result:
    model = load_hf(path, dtype)

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        hf_generate(model, [ids], new_tokens, pad=0)
        return time.perf_counter() - start

    prefill, decode = [], []
    for _ in range(repeats + 1):
        first = timed(1)
        full = timed(decode_tokens)
        prefill.append(len(ids) / first)
        decode.append((decode_tokens - 1) / max(full - first, 1e-9))
    return Result("HF transformers", dtype, statistics.median(prefill[1:]), statistics.median(decode[1:]))


def run_latency(args: argparse.Namespace) -> list[Result]:
    from kvforge.core.loader import resolve_model
    from kvforge.core.tokenizer import Tokenizer

    tp_counts = int_list(args.tp, "tp", what="rank counts")
    use_threads(args.threads)
    path = resolve_model(args.model)
    ids = prompt_ids(Tokenizer(path), args.prompt_tokens)
    print(f"model {path.name}; prompt {len(ids)} tokens; decode {args.decode_tokens} tokens at batch 1; "
          f"{torch.get_num_threads()} threads; median of {args.repeats} runs after a warm-up")
    results = []
    if not args.no_hf:
        results.append(bench_hf(path, "float32", ids, args.decode_tokens, args.repeats))
    for tp in tp_counts:
        for dtype in args.dtypes.split(","):
            results.append(bench_kvforge(str(path), dtype.strip(), ids, args.decode_tokens, args.repeats,
                                         args.threads, tp))
    baseline = results[0] if not args.no_hf else None
    print(f"{'engine':<16} {'dtype':<9} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'prefill vs HF fp32':>19} {'decode vs HF fp32':>18}")
    for r in results:
        ratios = ("", "") if baseline is None else (
            f"{r.prefill_tok_s / baseline.prefill_tok_s:.2f}x", f"{r.decode_tok_s / baseline.decode_tok_s:.2f}x")
        print(f"{r.engine:<16} {r.dtype:<9} {r.prefill_tok_s:>14.1f} {r.decode_tok_s:>13.1f} "
              f"{ratios[0]:>19} {ratios[1]:>18}")
    return results


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `latency` on the `kvforge bench` subcommands."""
    latency = bench_sub.add_parser("latency", help="prefill tok/s and batch-1 decode tok/s")
    latency.add_argument("--model", default=None)
    latency.add_argument("--dtypes", default="float32,bfloat16", help="kvforge dtypes to measure")
    latency.add_argument("--prompt-tokens", type=int, default=256)
    latency.add_argument("--decode-tokens", type=int, default=64)
    latency.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is kept")
    latency.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    latency.add_argument("--threads", type=int, default=None, help="CPU threads in all (split among --tp ranks)")
    latency.add_argument("--tp", default="1", metavar="N[,N...]",
                         help="kvforge tensor-parallel rank counts to measure, e.g. 1,2 (default: 1)")
    latency.set_defaults(func=as_command(run_latency))
    return latency
