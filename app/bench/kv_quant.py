"""`kvforge bench kv-quant`: per KV cache type (kv_cache_dtype), in one run against the full-precision KV: bytes per
token and the tokens a KV budget holds, perplexity on a held-out text, teacher-forced top-1 agreement over a long greedy
generation, and decode tok/s at batch 1 and at a large batch over a long context (prefill excluded; the batch's
steps timed with every sequence in them). Each type's engine is built and dropped in turn; full precision's engines
(one for batch 1, one holding its prefilled batch) stay, and each type's speed runs alternate with theirs, so its
ratios compare the same minutes of a shared machine (one run apart, a type's ratio moved by 10% on one).

Agreement: the full-precision model writes `--generate` tokens greedily after a chat prompt; each type then reads the
prompt and those tokens teacher-forced, and the share of positions whose top-1 token equals full precision's is
reported (free-running greedy outputs part at the first difference and say nothing after it)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvforge.app.bench.arguments import bench_parser, checked_model, use_threads
from kvforge.app.bench.runs import SteadyBatch, bench_engine, run_batch
from kvforge.app.bench.workloads import eval_text, prompt_ids, random_prompts
from kvforge.core.config import KV_CACHE_DTYPES

STORY = "Tell me a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class KVQuantRow:
    kv_cache_dtype: str
    kv_bytes_per_token: float
    pool_tokens: int  # what the --kv-gb budget holds
    perplexity: float
    top1_agreement: float | None  # None for the full-precision row itself
    decode_b1_tok_s: float | None
    decode_batch_tok_s: float | None
    # against full precision timed in turn with this type's own runs (the same minutes of a shared machine)
    b1_ratio: float | None = None
    batch_ratio: float | None = None


def _engine(args, kv_cache_dtype: str):
    return bench_engine(model=args.model, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
                        kv_cache_bytes=int(args.kv_gb * (1 << 30)), num_threads=args.threads,
                        enable_prefix_caching=False)


def _accuracy(engine, text_ids: list[int], story: list[int], generate: int,
              reference: tuple | None) -> tuple[float, float | None, tuple]:
    """Perplexity on the text; top-1 agreement with `reference`, the full-precision engine's greedy continuation of
    the story and its predictions over it (None: this engine is full precision, and writes it)."""
    logprobs, _ = engine.prompt_predictions(text_ids)
    perplexity = math.exp(-logprobs.double().mean().item())
    if reference is None:
        continuation = story + run_batch(engine, [story], generate)["token_ids"][0]
        _, best = engine.prompt_predictions(continuation)
        return perplexity, None, (continuation, best)
    continuation, full_best = reference
    _, best = engine.prompt_predictions(continuation)
    tail = slice(len(story) - 1, None)  # the generated positions
    return perplexity, (best[tail] == full_best[tail]).double().mean().item(), reference


def _b1_tok_s(engine, prompt: list[int], tokens: int) -> float:
    return run_batch(engine, [prompt], tokens)["decode_tok_s"] or 0.0


def _in_turn(ours, theirs, times: int) -> tuple[list[float], list[float]]:
    """`times` results of each of two measurements taken alternately."""
    a, b = [], []
    for _ in range(times):
        a.append(ours())
        b.append(theirs())
    return a, b


def run_kv_quant(args: argparse.Namespace) -> list[KVQuantRow]:
    from kvforge.core.tokenizer import Tokenizer

    path = checked_model(args, ("generate", "decode_tokens", "batch", "context", "repeats", "batch_steps"))
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = sorted(set(types) - set(KV_CACHE_DTYPES))
    if unknown:
        raise ValueError(f"--types: unknown KV cache type {unknown[0]!r} (choose from {', '.join(KV_CACHE_DTYPES)})")
    types = [t for t in types if t != "auto"]  # full precision: the reference row, measured first
    use_threads(args.threads)
    tokenizer = Tokenizer(path)
    text_ids = tokenizer.encode(Path(args.text).read_text() if args.text else eval_text())[:args.text_tokens]
    story = tokenizer.apply_chat_template([{"role": "user", "content": STORY}])
    speed = not args.no_speed
    b1_prompt = prompt_ids(tokenizer, 64)
    say = (lambda *a, **k: None) if args.json else print
    say(f"model {path.name} ({args.dtype}); perplexity on {len(text_ids)} held-out tokens; top-1 agreement over "
        f"{args.generate} generated tokens; decode {args.decode_tokens} tokens at batch 1 (median of {args.repeats}) "
        + (f"and at batch {args.batch} over {args.context}-token contexts (median of {args.batch_steps} steps with "
           "every sequence decoding), each type's runs in turn with full precision's for its ratios "
           if speed else "") + f"in a {args.kv_gb:g} GiB KV budget; {torch.get_num_threads()} threads")
    full = _engine(args, "auto")
    full_batch = None  # full precision's batch (a second engine): its steps alternate with each type's
    try:
        perplexity, _, reference = _accuracy(full, text_ids, story, args.generate, None)
        b1 = batch = None
        if speed:
            run_batch(full, [b1_prompt[:8]], 2)  # warm-up
            b1 = statistics.median(_b1_tok_s(full, b1_prompt, args.decode_tokens) for _ in range(args.repeats))
            full_batch = SteadyBatch(_engine(args, "auto"), random_prompts(args.batch, args.context, seed=0))
            batch = args.batch / statistics.median(full_batch.step() for _ in range(args.batch_steps))
        rows = [_row(full, "auto", perplexity, None, b1, batch, 1.0 if speed else None, 1.0 if speed else None)]
        _say_row(args, rows[0], rows[0])
        for kv_cache_dtype in types:
            engine = _engine(args, kv_cache_dtype)
            try:
                perplexity, agreement, _ = _accuracy(engine, text_ids, story, args.generate, reference)
                b1 = batch = b1_ratio = batch_ratio = None
                if speed:
                    run_batch(engine, [b1_prompt[:8]], 2)
                    ours, theirs = _in_turn(lambda e=engine: _b1_tok_s(e, b1_prompt, args.decode_tokens),
                                            lambda: _b1_tok_s(full, b1_prompt, args.decode_tokens), args.repeats)
                    b1, b1_ratio = statistics.median(ours), statistics.median(ours) / statistics.median(theirs)
                    steady = SteadyBatch(engine, random_prompts(args.batch, args.context, seed=0))
                    try:
                        ours, theirs = _in_turn(steady.step, full_batch.step, args.batch_steps)
                    finally:
                        steady.close()
                    batch = args.batch / statistics.median(ours)
                    batch_ratio = statistics.median(theirs) / statistics.median(ours)
                rows.append(_row(engine, kv_cache_dtype, perplexity, agreement, b1, batch, b1_ratio, batch_ratio))
            finally:
                engine.close()
            _say_row(args, rows[-1], rows[0])
    finally:
        if full_batch is not None:
            full_batch.close()
            full_batch.engine.close()
        full.close()
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
    return rows


def _row(engine, kv_cache_dtype: str, perplexity: float, agreement: float | None, b1: float | None,
         batch: float | None, b1_ratio: float | None, batch_ratio: float | None) -> KVQuantRow:
    tokens = engine.stats().kv_blocks_total * engine.config.block_size
    return KVQuantRow(kv_cache_dtype, engine.runtime().kv_bytes_per_token, tokens, perplexity, agreement, b1, batch,
                      b1_ratio, batch_ratio)


def _say_row(args, row: KVQuantRow, base: KVQuantRow) -> None:
    if not args.json:
        _print_row(row, base)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _print_row(row: KVQuantRow, base: KVQuantRow) -> None:
    if row is base:
        print(f"{'kv type':<9} {'bytes/tok':>9} {'pool tokens':>11} {'capacity':>8} {'perplexity':>10} "
              f"{'ppl ratio':>9} {'top-1':>6} {'b1 tok/s':>8} {'b1 ratio':>8} {'batch tok/s':>11} {'batch ratio':>11}")
    agreement = "-" if row.top1_agreement is None else f"{row.top1_agreement:.3f}"
    b1 = f"{row.decode_b1_tok_s:.1f}" if row.decode_b1_tok_s else "-"
    batch = f"{row.decode_batch_tok_s:.1f}" if row.decode_batch_tok_s else "-"
    print(f"{row.kv_cache_dtype:<9} {row.kv_bytes_per_token:>9.0f} {row.pool_tokens:>11} "
          f"{row.pool_tokens / base.pool_tokens:>7.2f}x {row.perplexity:>10.3f} "
          f"{row.perplexity / base.perplexity:>8.4f}x "
          f"{agreement:>6} {b1:>8} {_ratio(row.b1_ratio):>8} {batch:>11} {_ratio(row.batch_ratio):>11}", flush=True)


def add_parser(bench_sub) -> argparse.ArgumentParser:
    parser = bench_parser(bench_sub, "kv-quant", "per KV cache type: capacity, perplexity, top-1 agreement with the "
                          "full-precision KV, decode tok/s at batch 1 and at a large batch over long contexts",
                          run_kv_quant)
    parser.add_argument("--types", default=",".join(KV_CACHE_DTYPES),
                        help=f"comma-separated kv_cache_dtype values (default: all: {', '.join(KV_CACHE_DTYPES)})")
    parser.add_argument("--text", default=None, help="a text file for the perplexity (default: the bench's own)")
    parser.add_argument("--text-tokens", type=int, default=4096, help="at most this many of its tokens")
    parser.add_argument("--generate", type=int, default=512, help="greedy tokens the agreement is measured over")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="sequences decoded at once (default: 64)")
    parser.add_argument("--context", type=int, default=2048, help="each batch sequence's prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 runs; the median is kept")
    parser.add_argument("--batch-steps", type=int, default=9, help="batch decode steps timed once every sequence "
                        "decodes; the median is kept (default: 9)")
    parser.add_argument("--kv-gb", type=float, default=4.0, help="the KV budget of every engine (default: 4 GiB)")
    parser.add_argument("--no-speed", action="store_true", help="accuracy and capacity only")
    return parser
