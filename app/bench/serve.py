"""`kvforge bench serve`: the whole serving path under load. Starts the OpenAI-compatible server in this
process (uvicorn on a free 127.0.0.1 port, in a thread), then for each concurrency level runs that many
streaming HTTP clients at once, each sending its chat requests one after another, and measures from the
client side: requests/s, output tok/s, TTFT (time to the first content delta) and TPOT ((last - first
token time) / (tokens - 1)), p50 and p99."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from contextlib import contextmanager

from kvforge.app.bench.arguments import bench_parser, checked_model, int_list
from kvforge.app.bench.report import emit, ms, p50_p99
from kvforge.app.bench.runs import bench_engine
from kvforge.app.bench.workloads import chat_messages
from kvforge.app.threaded_server import serve_in_thread

MODEL_NAME = "kvforge-bench"


@contextmanager
def serving(engine, max_pending: int):
    """The server on a free loopback port, in a daemon thread; yields its base URL."""
    from kvforge.app.server import create_app

    with serve_in_thread(create_app(engine, MODEL_NAME, max_pending=max_pending)) as url:
        yield url


async def _stream_one(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request; client-side times of every content delta."""
    payload = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    token_times: list[float] = []
    completion_tokens = None
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice.get("delta", {}).get("content"):
                    token_times.append(time.perf_counter())
    end = time.perf_counter()
    tokens = completion_tokens if completion_tokens is not None else len(token_times)
    ttft = token_times[0] - start if token_times else None
    # deltas can carry several tokens (held back while text is incomplete): spread over the token count
    tpot = (token_times[-1] - token_times[0]) / (tokens - 1) if token_times and tokens > 1 else None
    return {"tokens": tokens, "ttft": ttft, "tpot": tpot, "latency": end - start}


async def _run_level(url: str, concurrency: int, requests_per_client: int, max_tokens: int,
                     prompts: list[list[dict]], timeout: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def one_client(c: int) -> list[dict]:
            return [await _stream_one(client, prompts[(c * requests_per_client + r) % len(prompts)], max_tokens)
                    for r in range(requests_per_client)]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(concurrency)))
        wall = time.perf_counter() - start
    return _summarize(concurrency, [r for rs in per_client for r in rs], wall)


def _summarize(concurrency: int, results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "requests_per_s": len(results) / wall, "output_tok_s": tokens / wall,
            "ttft_s": p50_p99(ttft), "tpot_s": p50_p99(tpot)}


def _print_table(report: dict) -> None:
    print(f"model {report['model']}; dtype {report['dtype']}; {report['threads']} threads; "
          f"{report['requests_per_client']} requests per client, {report['max_tokens']} output tokens each "
          f"(greedy, ignore_eos), streamed over HTTP")
    header = (f"{'concurrency':>11}  {'requests':>8}  {'req/s':>7}  {'out tok/s':>9}  {'TTFT p50':>9}  "
              f"{'TTFT p99':>9}  {'TPOT p50':>9}  {'TPOT p99':>9}")
    print(header)
    print("-" * len(header))
    for r in report["levels"]:
        print(f"{r['concurrency']:>11}  {r['requests']:>8}  {r['requests_per_s']:>7.2f}  {r['output_tok_s']:>9.1f}  "
              f"{ms(r['ttft_s']['p50']):>9}  {ms(r['ttft_s']['p99']):>9}  {ms(r['tpot_s']['p50']):>9}  "
              f"{ms(r['tpot_s']['p99']):>9}")
    print("(TTFT and TPOT in ms, measured by the clients)")


def run_serve_bench(args: argparse.Namespace) -> dict:
    import torch

    from kvforge.core import AsyncEngine
    from kvforge.core.async_engine import build_off_main_thread

    levels = int_list(args.concurrency, "concurrency")
    path = checked_model(args, ("requests_per_client", "max_tokens"))
    config = dict(model=str(path), dtype=args.dtype, kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
                  max_num_seqs=args.max_num_seqs, num_threads=args.threads,
                  enable_prefix_caching=not args.no_prefix_caching)
    engine = AsyncEngine(build_off_main_thread(lambda: bench_engine(**config)))
    prompts = chat_messages(max(levels) * args.requests_per_client)
    report = {"model": path.name, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "requests_per_client": args.requests_per_client,
              "max_tokens": args.max_tokens, "levels": []}
    try:
        with serving(engine, max_pending=max(levels) + 16) as url:
            # warm-up, outside the measurement: one short request through the whole stack
            asyncio.run(_run_level(url, 1, 1, 2, [[{"role": "user", "content": "Hello"}]], args.timeout))
            for level in levels:
                report["levels"].append(asyncio.run(_run_level(url, level, args.requests_per_client,
                                                               args.max_tokens, prompts, args.timeout)))
    finally:
        engine.close()
    emit(report, args.json, _print_table)
    return report


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `serve` on the `kvforge bench` subcommands."""
    serve = bench_parser(bench_sub, "serve", "requests/s, tok/s, TTFT and TPOT of concurrent streaming HTTP clients",
                         run_serve_bench, dtype_help="float32 | bfloat16 | float16")
    serve.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts (default: 1,4,16,64)")
    serve.add_argument("--requests-per-client", type=int, default=2, help="chat requests each client sends in turn")
    serve.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one engine step")
    serve.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache budget in GiB")
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--timeout", type=float, default=600, help="per-request HTTP timeout in seconds")
    return serve
