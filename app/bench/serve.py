"""`kvforge bench serve`: the whole serving path under load, against the offline engine in the same run.

By default it starts a real `kvforge serve` subprocess with the server's defaults (persisted KV tier on a
temporary data directory, the UI mounted; only --model, --dtype, --threads, --kv-cache-gb and
--no-prefix-caching are passed, plus any --serve-args); `--server thread` serves an in-process engine under
uvicorn in a thread instead (no disk tier). For each concurrency level it runs that many streaming HTTP
clients at once, each sending its chat requests one after another, and measures from the client side:
requests/s, output tok/s, TTFT (time to the first content delta) and TPOT ((last - first token time) /
(tokens - 1)), p50 and p99. Then (unless --no-offline) the offline engine, built with the same settings in
this process, runs the same requests on the same token ids (each client's next request submitted when its
previous one finishes), and the level reports the HTTP / offline output tok/s ratio."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvforge.app.bench.arguments import bench_parser, checked_model, int_list
from kvforge.app.bench.http_client import stream_chat, wait_until_serving
from kvforge.app.bench.report import emit, fmt, ms, p50_p99, percentile
from kvforge.app.bench.runs import bench_engine
from kvforge.app.bench.workloads import chat_messages
from kvforge.app.http.threaded_server import free_port, serve_in_thread

MODEL_NAME = "kvforge-bench"
WARM_UP = [{"role": "user", "content": "Hello"}]  # the same short request warms the server and the offline engine


@contextmanager
def serving(engine, max_pending: int):
    """The server on a free loopback port, in a daemon thread; yields its base URL."""
    from kvforge.app.server import create_app

    with serve_in_thread(create_app(engine, MODEL_NAME, max_pending=max_pending)) as url:
        yield url


def serve_argv(args: argparse.Namespace, port: int, data_dir: str) -> list[str]:
    """`kvforge serve` with its defaults but for the bench's model options and --serve-args."""
    argv = [sys.executable, "-m", "kvforge.app.cli", "serve", "--port", str(port), "--log-level", "warning",
            "--data-dir", data_dir, "--served-model-name", MODEL_NAME, "--dtype", args.dtype]
    if args.model is not None:
        argv += ["--model", str(args.model)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.kv_cache_gb is not None:
        argv += ["--kv-cache-gb", str(args.kv_cache_gb)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    return argv + shlex.split(args.serve_args or "")


@contextmanager
def serve_process(args: argparse.Namespace, startup_timeout_s: float = 600) -> Iterator[tuple[str, int]]:
    """A `kvforge serve` subprocess on a free loopback port and a temporary data directory; yields its base URL
    and pid (to profile it), and stops it with SIGTERM on exit. Its output goes to a file, shown if it fails."""

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-serve-") as data_dir, \
            tempfile.TemporaryFile("w+") as log:
        env = {**os.environ, "KVFORGE_DATA_DIR": data_dir}
        env.pop("KVFORGE_DB", None)  # the sessions and KV index in the temporary data directory
        process = subprocess.Popen(serve_argv(args, port, data_dir), env=env, stdout=log, stderr=subprocess.STDOUT,
                                   text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_until_serving(process, url, time.monotonic() + startup_timeout_s, "/health")
            except RuntimeError as exc:
                log.seek(0)
                raise RuntimeError(f"kvforge serve: {exc}:\n{log.read()[-3000:]}") from None
            yield url, process.pid
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def client_prompts(prompts: list, concurrency: int, requests_per_client: int) -> list[list]:
    """What each client sends, in order: the HTTP run and the offline run take the same."""
    return [[prompts[(c * requests_per_client + r) % len(prompts)] for r in range(requests_per_client)]
            for c in range(concurrency)]


async def _run_level(url: str, concurrency: int, requests_per_client: int, max_tokens: int,
                     prompts: list[list[dict]], timeout: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def one_client(messages: list[list[dict]]) -> list[dict]:
            return [await stream_chat(client, MODEL_NAME, m, max_tokens) for m in messages]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(m) for m in client_prompts(prompts, concurrency,
                                                                                   requests_per_client)))
        wall = time.perf_counter() - start
    return _summarize(concurrency, [r for rs in per_client for r in rs], wall)


def offline_level(engine, concurrency: int, requests_per_client: int, max_tokens: int,
                  prompts: list[list[int]]) -> dict:
    """The HTTP level's requests on the offline engine, stepped in this thread: each client's first request
    submitted at once, its next one when the previous finishes. TTFT / TPOT as the engine measures them."""
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    queues = client_prompts(prompts, concurrency, requests_per_client)
    owner: dict[str, int] = {}

    def submit(client: int) -> None:
        owner[engine.add_request(queues[client].pop(0), params)] = client

    finals = []
    cpu, start = time.process_time(), time.perf_counter()
    for client in range(concurrency):
        submit(client)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals.append(out)
                client = owner.pop(out.request_id)
                if queues[client]:
                    submit(client)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(out.token_ids) for out in finals)
    metrics = [out.metrics or {} for out in finals]
    ttft = [m["ttft"] for m in metrics if m.get("ttft") is not None]
    tpot = [m["tpot"] for m in metrics if m.get("tpot") is not None]
    return {"requests": len(finals), "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "cpu_ms_per_token": cpu * 1000 / tokens if tokens else None, "ttft_samples": ttft, "tpot_samples": tpot}


def tagged(messages: list[list[dict]], request_set: int) -> list[list[dict]]:
    """Set 0: the messages as they are; set k: each user message opened by "Request set k+1." (as many tokens
    as before, near enough, but none of its blocks in a prefix cache that saw the other sets)."""
    if request_set == 0:
        return messages
    return [[{**m, "content": f"Request set {request_set + 1}. {m['content']}"} if m["role"] == "user" else m
             for m in conversation] for conversation in messages]


def median(values: list[float]) -> float | None:
    return percentile(values, 50)


def combine_rounds(runs: list[tuple[dict, dict | None]]) -> dict:
    """A level's rounds as one row: each figure the median of its rounds' (TTFT and TPOT: the percentiles of every
    round's requests together), the HTTP / offline ratio the median of the rounds' ratios (each round's two runs
    ran back to back), and every round's tok/s under "rounds"."""

    def merged(rows: list[dict]) -> dict:
        row = {key: median([r[key] for r in rows]) if isinstance(value, float) else value
               for key, value in rows[0].items() if not key.endswith("_samples")}
        for key in ("ttft", "tpot"):
            row[f"{key}_s"] = p50_p99([v for r in rows for v in r[f"{key}_samples"]])
        return row

    row = merged([http for http, _ in runs])
    offline = [o for _, o in runs if o is not None]
    row["offline"] = merged(offline) if offline else None
    ratios = [http["output_tok_s"] / o["output_tok_s"] for http, o in runs if o is not None]
    row["http_vs_offline"] = median(ratios) if ratios else None
    row["rounds"] = [{"output_tok_s": http["output_tok_s"], "offline_tok_s": o and o["output_tok_s"]}
                     for http, o in runs]
    return row


def _summarize(concurrency: int, results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "requests_per_s": len(results) / wall, "output_tok_s": tokens / wall,
            "ttft_s": p50_p99(ttft), "tpot_s": p50_p99(tpot), "ttft_samples": ttft, "tpot_samples": tpot}


def _print_table(report: dict) -> None:
    server = ("a `kvforge serve` subprocess (its defaults: persisted KV tier, UI" +
              (f"; {report['serve_args']}" if report.get("serve_args") else "") + ")"
              if report["server"] == "process" else "an in-process server (uvicorn in a thread)")
    print(f"model {report['model']}; dtype {report['dtype']}; {report['cpu']}; load average {report['load_before']} "
          f"before, {report['load_after']} after")
    print(f"{report['requests_per_client']} requests per client, {report['max_tokens']} output tokens each "
          f"(greedy, ignore_eos), streamed over HTTP from {server}")
    offline = any(r.get("offline") for r in report["levels"])
    header = (f"{'concurrency':>11}  {'requests':>8}  {'req/s':>7}  {'out tok/s':>9}  {'TTFT p50':>9}  "
              f"{'TTFT p99':>9}  {'TPOT p50':>9}  {'TPOT p99':>9}")
    if offline:
        header += f"  {'offline tok/s':>13}  {'HTTP/offline':>12}"
    print(header)
    print("-" * len(header))
    for r in report["levels"]:
        line = (f"{r['concurrency']:>11}  {r['requests']:>8}  {r['requests_per_s']:>7.2f}  {r['output_tok_s']:>9.1f}  "
                f"{ms(r['ttft_s']['p50']):>9}  {ms(r['ttft_s']['p99']):>9}  {ms(r['tpot_s']['p50']):>9}  "
                f"{ms(r['tpot_s']['p99']):>9}")
        if offline:
            off = r["offline"] and r["offline"]["output_tok_s"]
            line += f"  {fmt(off):>13}  {fmt(r['http_vs_offline'], '.2f'):>12}"
        print(line)
    if report["rounds"] > 1:
        for r in report["levels"]:
            rounds = ", ".join(f"{x['output_tok_s']:.1f}" + (f" / {x['offline_tok_s']:.1f}" if offline else "")
                               for x in r["rounds"])
            print(f"concurrency {r['concurrency']}, each round's HTTP{' / offline' if offline else ''} tok/s: {rounds}")
    if any(r.get("server_cpu_ms_per_token") for r in report["levels"]):
        for r in report["levels"]:
            off = f", offline engine {r['offline']['cpu_ms_per_token']:.2f}" if r["offline"] else ""
            print(f"concurrency {r['concurrency']}, CPU ms per output token: server "
                  f"{r['server_cpu_ms_per_token']:.2f}, HTTP clients {r['client_cpu_ms_per_token']:.2f}{off}")
    medians = f"medians of {report['rounds']} rounds; " if report["rounds"] > 1 else ""
    print(f"(TTFT and TPOT in ms, measured by the clients; {medians}offline: the same requests on the engine in this "
          "process, run back to back with the HTTP run)")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) the process has used; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def wait_for_disk_writes(url: str, timeout_s: float = 120) -> None:
    """Until the server's persisted-KV writer has nothing queued (kvforge_kv_disk_pending 0, or no such gauge):
    its writes must not run into the next measurement."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
        pending = [float(line.split()[1]) for line in lines if line.startswith("kvforge_kv_disk_pending ")]
        if not pending or pending[0] == 0:
            return
        time.sleep(0.1)


def _cpu_ms_per_token(before: float | None, after: float | None, tokens: int) -> float | None:
    return None if before is None or after is None or not tokens else (after - before) * 1000 / tokens


def run_serve_bench(args: argparse.Namespace) -> dict:
    import concurrent.futures

    import torch

    from kvforge.core.cpu import describe_cpu
    from kvforge.core.tokenizer import Tokenizer

    levels = int_list(args.concurrency, "concurrency")
    path = checked_model(args, ("requests_per_client", "max_tokens", "rounds"))
    if args.server == "process" and args.max_num_seqs is not None:
        raise ValueError("--max-num-seqs is not a `kvforge serve` setting: use it with --server thread")
    if args.server == "thread" and args.serve_args:
        raise ValueError("--serve-args are for --server process")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = dict(model=args.model, dtype=args.dtype, num_threads=args.threads,
                  enable_prefix_caching=not args.no_prefix_caching)
    if args.kv_cache_gb is not None:
        config["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
    if args.max_num_seqs is not None:
        config["max_num_seqs"] = args.max_num_seqs
    base = chat_messages(max(levels) * args.requests_per_client)
    tokenizer = Tokenizer(path)
    report = {"model": path.name, "dtype": args.dtype, "server": args.server, "threads": torch.get_num_threads(),
              "serve_args": args.serve_args or "", "cpu": describe_cpu(), "load_before": _load(),
              "requests_per_client": args.requests_per_client, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "prompt_tokens_mean": sum(len(tokenizer.apply_chat_template(m)) for m in base) / len(base),
              "server_pid": None, "levels": []}

    # the offline engine lives in one worker thread: torch work on the main thread would slow the in-process
    # server's engine thread (see build_off_main_thread), and `kvforge serve` steps its engine off the main thread
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvforge-offline")
    offline = None

    def offline_run(level: int, messages: list[list[dict]]) -> dict:
        nonlocal offline
        if offline is None:
            from kvforge.app.bench.runs import generate_one
            from kvforge.core import SamplingParams

            offline = bench_engine(**config)
            generate_one(offline, tokenizer.apply_chat_template(WARM_UP),
                         SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        prompt_ids = [tokenizer.apply_chat_template(m) for m in messages]
        return offline_level(offline, level, args.requests_per_client, args.max_tokens, prompt_ids)

    if args.server == "process":
        server = serve_process(args)
        engine = None
    else:
        from kvforge.core import AsyncEngine
        from kvforge.core.async_engine import build_off_main_thread

        engine = AsyncEngine(build_off_main_thread(lambda: bench_engine(**config)))
        server = serving(engine, max_pending=max(levels) + 16)
    try:
        with server as served:
            url = served[0] if args.server == "process" else served
            report["server_pid"] = pid = served[1] if args.server == "process" else os.getpid()
            if args.pid_file:
                with open(args.pid_file, "w") as f:
                    f.write(f"{pid}\n")
            # warm-up, outside the measurement: one short request through the whole stack
            asyncio.run(_run_level(url, 1, 1, 2, [WARM_UP], args.timeout))

            def http_run(level: int, messages: list[list[dict]]) -> dict:
                server_cpu, client_cpu = process_cpu_s(pid) if args.server == "process" else None, time.process_time()
                result = asyncio.run(_run_level(url, level, args.requests_per_client, args.max_tokens, messages,
                                                args.timeout))
                client_cpu = time.process_time() - client_cpu
                wait_for_disk_writes(url)  # the server's disk writes belong to this run, not to the next one
                if args.server == "process":  # in-process, the client's and the server's CPU cannot be told apart
                    tokens = result["output_tokens"]
                    result["server_cpu_ms_per_token"] = _cpu_ms_per_token(server_cpu, process_cpu_s(pid), tokens)
                    result["client_cpu_ms_per_token"] = client_cpu * 1000 / tokens if tokens else None
                return result

            request_set = 0
            for level in levels:
                runs = []
                for r in range(args.rounds):
                    messages = tagged(base, request_set)  # every run its own prompts: no prefix cached from the last
                    request_set += 1
                    # HTTP and offline back to back on the same requests, in turn first (a load that drifts
                    # during the run weighs on both)
                    if args.no_offline:
                        runs.append((http_run(level, messages), None))
                    elif r % 2 == 0:
                        runs.append((http_run(level, messages), pool.submit(offline_run, level, messages).result()))
                    else:
                        off = pool.submit(offline_run, level, messages).result()
                        runs.append((http_run(level, messages), off))
                report["levels"].append(combine_rounds(runs))
    finally:
        if offline is not None:
            pool.submit(offline.close).result()
        pool.shutdown()
        if engine is not None:
            engine.close()
    report["load_after"] = _load()
    emit(report, args.json, _print_table)
    return report


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `serve` on the `kvforge bench` subcommands."""
    serve = bench_parser(bench_sub, "serve", "requests/s, tok/s, TTFT and TPOT of concurrent streaming HTTP clients, "
                         "against the offline engine on the same requests", run_serve_bench,
                         dtype_help="float32 | bfloat16 | float16")
    serve.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts (default: 1,4,16,64)")
    serve.add_argument("--requests-per-client", type=int, default=2, help="chat requests each client sends in turn")
    serve.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    serve.add_argument("--server", choices=("process", "thread"), default="process",
                       help="process: a `kvforge serve` subprocess with its defaults (default); thread: the server "
                            "in this process (no persisted KV tier)")
    serve.add_argument("--serve-args", default=None,
                       help="more `kvforge serve` flags for --server process, e.g. '--no-persist-kv --no-ui'")
    serve.add_argument("--pid-file", default=None, help="write the server's pid here once it serves (to profile it)")
    serve.add_argument("--no-offline", action="store_true", help="skip the offline engine's run of each level")
    serve.add_argument("--rounds", type=int, default=1, help="runs of each level, HTTP and offline back to back (in "
                       "turn first), each on requests of its own; the table shows medians (default: 1)")
    serve.add_argument("--max-num-seqs", type=int, default=None, help="--server thread: sequences in one engine step "
                       "(default: the engine's)")
    serve.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache budget in GiB (default: the "
                       "engine's)")
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--timeout", type=float, default=600, help="per-request HTTP timeout in seconds")
    return serve
