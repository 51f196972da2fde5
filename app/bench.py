"""`kvforge bench latency`: prefill and batch-1 decode speed of kvforge against HF transformers
`generate`, both measured in the same run on the same prompt (machines are shared and noisy, so
only same-run ratios mean anything)."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the budget, "
          "the schedule and the staffing plan for the coming year. ")


@dataclass
class Result:
    engine: str
    dtype: str
    prefill_tok_s: float
    decode_tok_s: float


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(FILLER * (n // 10 + 1))
    return ids[:n]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def bench_kvforge(model: str | None, dtype: str, ids: list[int], decode_tokens: int, repeats: int,
                  threads: int | None) -> Result:
    from kvforge.core import LLMEngine, SamplingParams
    from kvforge.core.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=256 << 20, num_threads=threads),
                       progress=False)
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
    return Result("kvforge", dtype, _median(prefill[1:]), _median(decode[1:]))


def bench_hf(path, dtype: str, ids: list[int], decode_tokens: int, repeats: int) -> Result:
    from transformers import AutoModelForCausalLM

    from kvforge.core.config import DTYPES

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    input_ids = torch.tensor([ids])

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        return time.perf_counter() - start

    prefill, decode = [], []
    for _ in range(repeats + 1):
        first = timed(1)
        full = timed(decode_tokens)
        prefill.append(len(ids) / first)
        decode.append((decode_tokens - 1) / max(full - first, 1e-9))
    return Result("HF transformers", dtype, _median(prefill[1:]), _median(decode[1:]))


def run_latency(args: argparse.Namespace) -> list[Result]:
    from kvforge.core.loader import resolve_model
    from kvforge.core.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    ids = prompt_ids(Tokenizer(path), args.prompt_tokens)
    print(f"model {path.name}; prompt {len(ids)} tokens; decode {args.decode_tokens} tokens at batch 1; "
          f"{torch.get_num_threads()} threads; median of {args.repeats} runs after a warm-up")
    results = []
    if not args.no_hf:
        results.append(bench_hf(path, "float32", ids, args.decode_tokens, args.repeats))
    for dtype in args.dtypes.split(","):
        results.append(bench_kvforge(str(path), dtype.strip(), ids, args.decode_tokens, args.repeats, args.threads))
    baseline = results[0] if not args.no_hf else None
    print(f"{'engine':<16} {'dtype':<9} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'prefill vs HF fp32':>19} {'decode vs HF fp32':>18}")
    for r in results:
        ratios = ("", "") if baseline is None else (
            f"{r.prefill_tok_s / baseline.prefill_tok_s:.2f}x", f"{r.decode_tok_s / baseline.decode_tok_s:.2f}x")
        print(f"{r.engine:<16} {r.dtype:<9} {r.prefill_tok_s:>14.1f} {r.decode_tok_s:>13.1f} "
              f"{ratios[0]:>19} {ratios[1]:>18}")
    return results
