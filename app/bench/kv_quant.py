"""`kvforge bench kv-quant`: per KV cache type (kv_cache_dtype), in one run against the full-precision KV: bytes per
token and the tokens a KV budget holds, perplexity on a held-out text, teacher-forced top-1 agreement over a long greedy
generation, and decode tok/s at batch 1 and at a large batch over a long context (prefill excluded; the batch's
steps timed with every sequence in them). Each engine is built and dropped in turn; only same-run ratios mean
anything on a shared machine.

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
from kvforge.app.bench.runs import bench_engine, run_batch, steady_decode
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


def measure(kv_cache_dtype: str, args, text_ids: list[int], story: list[int], reference: list | None,
            batch_prompts: list[list[int]] | None, b1_prompt: list[int]) -> tuple[KVQuantRow, object]:
    engine = bench_engine(model=args.model, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
                          kv_cache_bytes=int(args.kv_gb * (1 << 30)), num_threads=args.threads,
                          enable_prefix_caching=False)
    try:
        runtime = engine.runtime()
        logprobs, _ = engine.prompt_predictions(text_ids)
        perplexity = math.exp(-logprobs.double().mean().item())
        if reference is None:  # the full-precision row writes the continuation the others are compared on
            out = run_batch(engine, [story], args.generate)
            continuation = story + out["token_ids"][0]
            _, best = engine.prompt_predictions(continuation)
            reference, agreement = (continuation, best), None
        else:
            continuation, full_best = reference
            _, best = engine.prompt_predictions(continuation)
            tail = slice(len(story) - 1, None)  # the generated positions
            agreement = (best[tail] == full_best[tail]).double().mean().item()
        run_batch(engine, [b1_prompt[:8]], 2)  # warm-up
        b1 = None if args.no_speed else statistics.median(
            run_batch(engine, [b1_prompt], args.decode_tokens)["decode_tok_s"] or 0.0 for _ in range(args.repeats))
        batch = None if args.no_speed or not batch_prompts else \
            steady_decode(engine, batch_prompts, args.batch_steps)["tok_s"]
        tokens = engine.stats().kv_blocks_total * engine.config.block_size
        return KVQuantRow(kv_cache_dtype, runtime.kv_bytes_per_token, tokens, perplexity, agreement, b1,
                          batch), reference
    finally:
        engine.close()


def run_kv_quant(args: argparse.Namespace) -> list[KVQuantRow]:
    from kvforge.core.tokenizer import Tokenizer

    path = checked_model(args, ("generate", "decode_tokens", "batch", "context", "repeats", "batch_steps"))
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = sorted(set(types) - set(KV_CACHE_DTYPES))
    if unknown:
        raise ValueError(f"--types: unknown KV cache type {unknown[0]!r} (choose from {', '.join(KV_CACHE_DTYPES)})")
    if types[:1] != ["auto"]:
        types = ["auto", *[t for t in types if t != "auto"]]  # full precision first: the reference
    use_threads(args.threads)
    tokenizer = Tokenizer(path)
    text_ids = tokenizer.encode(Path(args.text).read_text() if args.text else eval_text())[:args.text_tokens]
    story = tokenizer.apply_chat_template([{"role": "user", "content": STORY}])
    batch_prompts = None if args.no_speed else random_prompts(args.batch, args.context, seed=0)
    b1_prompt = prompt_ids(tokenizer, 64)
    say = (lambda *a, **k: None) if args.json else print
    say(f"model {path.name} ({args.dtype}); perplexity on {len(text_ids)} held-out tokens; top-1 agreement over "
        f"{args.generate} generated tokens; decode {args.decode_tokens} tokens at batch 1 (median of {args.repeats}) "
        + ("" if args.no_speed else f"and at batch {args.batch} over {args.context}-token contexts (median of "
                                   f"{args.batch_steps} steps with every sequence decoding) ")
        + f"in a {args.kv_gb:g} GiB KV budget; {torch.get_num_threads()} threads")
    rows, reference = [], None
    for kv_cache_dtype in types:
        row, reference = measure(kv_cache_dtype, args, text_ids, story, reference, batch_prompts, b1_prompt)
        rows.append(row)
        if not args.json:
            _print_row(row, rows[0])
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
    return rows


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


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
          f"{agreement:>6} {b1:>8} {_ratio(row.decode_b1_tok_s, base.decode_b1_tok_s):>8} {batch:>11} "
          f"{_ratio(row.decode_batch_tok_s, base.decode_batch_tok_s):>11}", flush=True)


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
