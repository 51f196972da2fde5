"""`kvforge bench throughput`: many chat requests of varied lengths submitted at once to one engine
(continuous batching, prefix caching), against HF `generate` one request at a time and in static
left-padded batches, in the same run on the same prompts. With --pp N (pipeline stages) the same requests also run
on one process, and the bench prints the pipeline's ratio to it."""

from __future__ import annotations

import argparse
import time

import torch

from kvforge.app.bench.arguments import bench_parser, checked_model, rank_threads, use_threads
from kvforge.app.bench.references import hf_generate, load_hf
from kvforge.app.bench.report import emit, ms, p50_p99
from kvforge.app.bench.runs import bench_engine, warm_up
from kvforge.app.bench.workloads import chat_messages


def _warm_ids(prompts: list[list[int]]) -> list[int]:
    return prompts[0][-8:]  # the tail of a prompt: no full block, so nothing lands in the prefix cache


def throughput_kvforge(model: str, dtype: str, prompts: list[list[int]], output_len: int, args,
                       one_process: bool = False) -> dict:
    """`one_process`: whatever --tp / --pp say, one process (the pipeline's baseline)."""
    tp, pp = (1, 1) if one_process else (getattr(args, "tp", 1), getattr(args, "pp", 1))
    engine = bench_engine(model=model, dtype=dtype, kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_threads=rank_threads(args.threads, tp * pp), tp_size=tp, pp_size=pp,
                          enable_prefix_caching=not getattr(args, "no_prefix_caching", False))
    try:
        return _throughput_run(engine, prompts, output_len)
    finally:
        engine.close()


def _throughput_run(engine, prompts: list[list[int]], output_len: int) -> dict:
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    warm_up(engine, _warm_ids(prompts), ignore_eos=True)
    before = engine.stats()

    finals = []
    start = time.perf_counter()
    for ids in prompts:
        engine.add_request(ids, params)
    while engine.has_unfinished():
        finals.extend(out for out in engine.step() if out.finished)
    wall = time.perf_counter() - start
    after = engine.stats()

    generated = sum(len(out.token_ids) for out in finals)
    prompt_tokens = sum(len(ids) for ids in prompts)
    ttft = [out.metrics["ttft"] for out in finals if out.metrics and out.metrics.get("ttft") is not None]
    tpot = [out.metrics["tpot"] for out in finals if out.metrics and out.metrics.get("tpot") is not None]
    new_prompt = after.prompt_tokens_total - before.prompt_tokens_total
    cached = after.cached_tokens_total - before.cached_tokens_total
    return {
        "requests_finished": len(finals),
        "generated_tokens": generated,
        "wall_s": wall,
        "output_tok_s": generated / wall,
        "total_tok_s": (prompt_tokens + generated) / wall,
        "ttft_s": p50_p99(ttft),
        "tpot_s": p50_p99(tpot),
        "prefix_cache_hit_rate": cached / new_prompt if new_prompt else 0.0,
        "cached_prompt_tokens": cached,
        "preemptions": after.preemptions_total - before.preemptions_total,
        "kv_cache_tokens": after.kv_blocks_total * engine.config.block_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
    }


def _hf_pad_id(path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def throughput_hf(path, dtype: str, prompts: list[list[int]], output_len: int, args) -> tuple[dict, dict]:
    model, pad = load_hf(path, dtype), _hf_pad_id(path)
    hf_generate(model, [_warm_ids(prompts)], 2, pad)  # warm-up, outside the measurement

    seq_prompts = prompts[:args.hf_sequential_requests]
    generated, start = 0, time.perf_counter()
    for ids in seq_prompts:
        generated += hf_generate(model, [ids], output_len, pad)
    elapsed = time.perf_counter() - start
    sequential = {"requests": len(seq_prompts), "prompt_tokens": sum(len(ids) for ids in seq_prompts),
                  "generated_tokens": generated, "time_s": elapsed, "output_tok_s": generated / elapsed}

    size = args.hf_batch_size
    batches = [prompts[i:i + size] for i in range(0, len(prompts), size)][:args.hf_batches]
    generated, padded, start = 0, 0, time.perf_counter()
    for batch in batches:
        generated += hf_generate(model, batch, output_len, pad)
        padded += sum(max(len(ids) for ids in batch) - len(ids) for ids in batch)
    elapsed = time.perf_counter() - start
    static = {"batch_size": size, "batches": len(batches), "requests": sum(len(b) for b in batches),
              "prompt_tokens": sum(len(ids) for b in batches for ids in b), "padding_tokens": padded,
              "generated_tokens": generated, "time_s": elapsed, "output_tok_s": generated / elapsed}
    return sequential, static


def _print_throughput(r: dict) -> None:
    p, k = r["prompt_tokens"], r["kvforge"]
    ranks = f"; kvforge on {r['tp']} tensor-parallel ranks" if r.get("tp", 1) > 1 else ""
    ranks += f"; kvforge in {r['pp']} pipeline stages" if r.get("pp", 1) > 1 else ""
    print(f"model {r['model']}; dtype {r['dtype']}; {r['threads']} threads{ranks}")
    print(f"requests          {r['num_requests']} chat prompts, all submitted at once; "
          f"{r['output_len']} output tokens each (greedy, ignore_eos)")
    print(f"prompt tokens     total {p['total']}, mean {p['mean']:.1f}, min {p['min']}, max {p['max']}")
    print(f"kvforge           max_num_seqs {k['max_num_seqs']}, max_num_batched_tokens "
          f"{k['max_num_batched_tokens']}, KV cache {k['kv_cache_tokens']} tokens")
    print(f"  wall time       {k['wall_s']:.2f} s ({k['requests_finished']} requests, "
          f"{k['generated_tokens']} tokens generated)")
    print(f"  output tok/s    {k['output_tok_s']:.1f}")
    print(f"  total tok/s     {k['total_tok_s']:.1f} (prompt + output)")
    print(f"  TTFT            p50 {ms(k['ttft_s']['p50'], ' ms')}, p99 {ms(k['ttft_s']['p99'], ' ms')}")
    print(f"  TPOT            p50 {ms(k['tpot_s']['p50'], ' ms')}, p99 {ms(k['tpot_s']['p99'], ' ms')}")
    print(f"  prefix cache    hit rate {k['prefix_cache_hit_rate']:.1%} ({k['cached_prompt_tokens']} of "
          f"{p['total']} prompt tokens)")
    print(f"  preemptions     {k['preemptions']}")
    if r.get("one_process") is not None:
        one = r["one_process"]
        print(f"kvforge, one process {one['output_tok_s']:.1f} output tok/s ({one['wall_s']:.2f} s, same requests)")
        print(f"kvforge / one process       {k['output_tok_s'] / one['output_tok_s']:.2f}x")
    seq, static, ratios = r["hf_sequential"], r["hf_static_batch"], r["ratios"]
    if seq is None:
        return
    print(f"HF sequential     {seq['output_tok_s']:.1f} output tok/s ({seq['requests']} requests one at a time, "
          f"{seq['prompt_tokens']} prompt tokens, {seq['generated_tokens']} generated, {seq['time_s']:.2f} s)")
    print(f"HF static batch   {static['output_tok_s']:.1f} output tok/s ({static['batches']} batches of "
          f"<= {static['batch_size']}, {static['requests']} requests, left padding {static['padding_tokens']} "
          f"tokens, {static['generated_tokens']} generated, {static['time_s']:.2f} s)")
    print(f"kvforge / HF sequential     {ratios['kvforge_vs_hf_sequential']:.2f}x")
    print(f"kvforge / HF static batch   {ratios['kvforge_vs_hf_static_batch']:.2f}x")


def run_throughput(args: argparse.Namespace) -> dict:
    from kvforge.core.loader import resolve_model
    from kvforge.core.tokenizer import Tokenizer

    if args.hf_batches is not None and args.hf_batches < 1:
        raise ValueError(f"--hf-batches must be >= 1, got {args.hf_batches}")
    path = checked_model(args, ("num_requests", "output_len", "hf_sequential_requests", "hf_batch_size"))
    use_threads(args.threads)
    tokenizer = Tokenizer(path)
    prompts = [tokenizer.apply_chat_template(m) for m in chat_messages(args.num_requests)]
    lengths = [len(ids) for ids in prompts]
    result = {
        "model": path.name, "dtype": args.dtype, "threads": torch.get_num_threads(), "tp": args.tp, "pp": args.pp,
        "num_requests": len(prompts), "output_len": args.output_len,
        "prompt_tokens": {"total": sum(lengths), "mean": sum(lengths) / len(lengths),
                          "min": min(lengths), "max": max(lengths)},
        "kvforge": throughput_kvforge(args.model, args.dtype, prompts, args.output_len, args),
        "hf_sequential": None, "hf_static_batch": None, "ratios": None, "one_process": None,
    }
    if args.pp > 1:  # the pipeline's baseline: the same requests on one process with every thread
        result["one_process"] = throughput_kvforge(args.model, args.dtype, prompts, args.output_len, args,
                                                   one_process=True)
    if not args.no_hf:
        sequential, static = throughput_hf(resolve_model(args.model), args.dtype, prompts, args.output_len, args)
        ours = result["kvforge"]["output_tok_s"]
        result |= {"hf_sequential": sequential, "hf_static_batch": static,
                   "ratios": {"kvforge_vs_hf_sequential": ours / sequential["output_tok_s"],
                              "kvforge_vs_hf_static_batch": ours / static["output_tok_s"]}}
    emit(result, args.json, _print_throughput)
    return result


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `throughput` on the `kvforge bench` subcommands."""
    from kvforge.app.settings import tp_ranks  # the --tp type: argparse names the flag in its error

    throughput = bench_parser(
        bench_sub, "throughput", "output tok/s of many chat requests at once, against HF sequential and static batches",
        run_throughput, dtype_help="kvforge and HF dtype", threads_help="CPU threads in all (split among --tp ranks)")
    throughput.add_argument("--no-prefix-caching", action="store_true",
                            help="kvforge: no reuse of the shared system prompt's KV")
    throughput.add_argument("--num-requests", type=int, default=64, help="chat requests, submitted at once")
    throughput.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    throughput.add_argument("--max-num-seqs", type=int, default=64, help="kvforge: sequences in one step")
    throughput.add_argument("--max-num-batched-tokens", type=int, default=2048, help="kvforge: tokens in one step")
    throughput.add_argument("--kv-cache-gb", type=float, default=1.0, help="kvforge KV cache budget in GiB")
    throughput.add_argument("--hf-sequential-requests", type=int, default=4,
                            help="requests HF generates one at a time (default: 4)")
    throughput.add_argument("--hf-batch-size", type=int, default=16, help="HF static batch size (default: 16)")
    throughput.add_argument("--hf-batches", type=int, default=None,
                            help="HF static batches to run (default: all, covering every request)")
    throughput.add_argument("--no-hf", action="store_true", help="skip the HF transformers baselines")
    throughput.add_argument("--tp", type=tp_ranks, default=1, metavar="N", help="kvforge tensor-parallel ranks")
    throughput.add_argument("--pp", type=tp_ranks, default=1, metavar="N",
                            help="kvforge pipeline stages (then also one process on the same requests, and the ratio)")
    return throughput
