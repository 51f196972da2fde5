"""`kvforge bench chat`: time to first token, turn by turn, of one multi-turn conversation, in three modes
measured in the same run on identical prompts:

  no cache   enable_prefix_caching=False: every turn prefills its whole chat prompt;
  memory     the in-memory prefix cache (persistence off): a turn reuses the KV of the turns before it;
  persisted  a restart before every turn: persist_kv on a fresh temporary data directory and SQLite
             store; each turn runs on a newly built engine (empty in-memory cache) whose disk tier holds
             the earlier turns, written while they ran. The turn's new message is computed; the history
             is loaded from disk.

The replies generated without a cache build the history of every mode (greedy), so all modes time the
same token ids; the replies of the other modes are checked against them token for token. TTFT is the
time from add_request to the first step output carrying a token, driving engine.step() directly.

Beside them, where the model is a GGUF file and llama-cpp-python is installed (`kvforge bench peers`' peers
dir, or --llama-python), llama.cpp on the same file and the same prompt token ids, in a process of its own
(peer_worker.run_llama_cpp_chat): its TTFT per turn with its context kept from the turn before (`memory`: it
reuses the longest prefix it holds, as its server does within a slot) and cleared before each turn
(`recompute`: what a restarted llama.cpp server does; it keeps no KV across a restart unless a slot is saved
and restored by hand)."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from kvforge.app.bench.arguments import bench_parser, checked_model
from kvforge.app.bench.peer_engines import add_peer_options
from kvforge.app.bench.report import emit
from kvforge.app.bench.runs import bench_engine, warm_up
from kvforge.app.bench.workloads import user_messages

TARGET_RATIO = 0.2  # persisted-after-restart TTFT / no-cache TTFT at the last turn
LLAMA_TIMEOUT_S = 7200  # llama.cpp's two passes over the conversation (an 8B's no-cache turns take ~1 h on 2 cores)


def _turn(engine, prompt: list[int], params, request_id: str, stop: threading.Event) -> dict:
    """Run one turn to the end; TTFT from add_request to the first output that carries a token."""
    start = time.perf_counter()
    engine.add_request(prompt, params, request_id=request_id)
    ttft, final = None, None
    while engine.has_unfinished():
        if stop.is_set():
            raise KeyboardInterrupt
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                final = out
    return {"ttft_s": ttft, "cached_tokens": final.num_cached_tokens, "token_ids": list(final.token_ids),
            "text": final.text}


def _warm_up(engine, prompt: list[int]) -> None:
    warm_up(engine, prompt[-(engine.config.block_size // 2):])  # under one block: nothing cached or persisted


def _measure(args: argparse.Namespace, path: Path, stop: threading.Event) -> dict:
    """Everything that touches torch, on one thread that is not the main thread (see build_off_main_thread)."""
    import torch

    from kvforge.core import SamplingParams

    base = dict(model=args.model, dtype=args.dtype, num_threads=args.threads)
    if args.kv_cache_gb is not None:
        base["kv_cache_bytes"] = int(args.kv_cache_gb * (1 << 30))
    phases, clock = {}, time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name], clock = now - clock, now

    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens)

    # (a) no prefix cache: its replies make the conversation every mode replays
    engine = bench_engine(**base, enable_prefix_caching=False)
    threads = torch.get_num_threads()
    messages = user_messages(engine.tokenizer, args.turns, args.user_tokens)
    history: list[dict] = []
    prompts, no_cache = [], []
    for t, message in enumerate(messages):
        history.append({"role": "user", "content": message})
        prompts.append(engine.tokenizer.apply_chat_template(history))
        if t == 0:
            _warm_up(engine, prompts[0])
        no_cache.append(_turn(engine, prompts[t], params, f"none-{t}", stop))
        history.append({"role": "assistant", "content": no_cache[t]["text"]})
    block_size = engine.config.block_size
    del engine
    gc.collect()
    phase("no_cache")

    # (b) the in-memory prefix cache
    engine = bench_engine(**base)
    _warm_up(engine, prompts[0])
    memory = [_turn(engine, prompt, params, f"memory-{t}", stop) for t, prompt in enumerate(prompts)]
    del engine
    gc.collect()
    phase("memory")

    # (c) the persisted tier after a restart: before each turn the server restarts (a new engine, an
    # empty in-memory cache) and only the disk holds the earlier turns (written while they ran)
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-chat-") as data_dir:
        url = f"sqlite:///{Path(data_dir) / 'kvforge.db'}"
        persist = dict(base, persist_kv=True, data_dir=data_dir, db_url=url)
        persisted, flushed, written, loaded, failures = [], True, 0, 0, 0
        for t, prompt in enumerate(prompts):
            engine = bench_engine(**persist)
            _warm_up(engine, prompts[0])
            persisted.append(_turn(engine, prompt, params, f"persisted-{t}", stop))
            flushed = engine.persisted.flush(timeout=120) and flushed
            engine.close()
            stats = engine.persisted.stats()
            written, loaded, failures = (written + stats.written_blocks, loaded + stats.loaded_blocks,
                                         failures + stats.load_failures)
            disk_bytes = stats.bytes_total
            del engine
            gc.collect()
        phase("persisted")

    return {"threads": threads, "block_size": block_size, "messages": messages, "prompts": prompts,
            "no_cache": no_cache, "memory": memory, "persisted": persisted, "phases": phases,
            "disk": {"flushed": flushed, "written_blocks": written, "bytes": disk_bytes,
                     "loaded_blocks": loaded, "load_failures": failures}}


def _llama_cpp_turns(args: argparse.Namespace, measured: dict) -> dict:
    """The conversation kvforge timed, on llama.cpp (see the module's docstring), or why it was skipped."""
    from kvforge.app.bench.peer_engines import ENGINES, EngineRun, find_peer
    from kvforge.app.bench.peers import run_engine
    from kvforge.core.loader import gguf_file_of

    gguf = gguf_file_of(args.model)
    if gguf is None:
        return {"status": "skipped", "why": "llama.cpp runs GGUF files only"}
    python, why = find_peer("llama", args)
    if python is None:
        return {"status": "skipped", "why": why}
    replies = [len(r["token_ids"]) for r in measured["no_cache"]]
    job = {"kind": "llama.cpp-chat", "model": str(gguf), "prompts": measured["prompts"], "reply_tokens": replies,
           "output_tokens": max(replies), "threads": measured["threads"]}
    run = EngineRun(next(e for e in ENGINES if e.name == "llama.cpp"), python=python)
    env = dict(os.environ, OMP_NUM_THREADS=str(measured["threads"]))
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-chat-llama-") as workdir:
        run_engine(run, job, Path(workdir), timeout=LLAMA_TIMEOUT_S, env=env)
    if run.status != "ok":
        return {"status": run.status, "why": run.why, "stderr_tail": run.stderr_tail}
    rows = {(row["mode"], row["turn"]): row for row in run.measurements}
    return {"status": "ok", "library": run.info.get("library"), "file": str(gguf),
            "turns": [{mode: rows[(mode, t)] for mode in ("memory", "recompute")}
                      for t in range(1, len(replies) + 1)]}


def _mismatches(runs: list[dict], reference: list[dict]) -> list[int]:
    """1-based turns whose reply differs from the reference reply."""
    return [t + 1 for t, (r, ref) in enumerate(zip(runs, reference)) if r["token_ids"] != ref["token_ids"]]


def _report(args: argparse.Namespace, path: Path, m: dict, llama: dict, wall: float) -> dict:
    per_turn = []
    for t in range(args.turns):
        a, b, c = m["no_cache"][t], m["memory"][t], m["persisted"][t]
        per_turn.append({
            "turn": t + 1, "prompt_tokens": len(m["prompts"][t]), "reply_tokens": len(a["token_ids"]),
            "ttft_s": {"no_cache": a["ttft_s"], "memory": b["ttft_s"], "persisted": c["ttft_s"]},
            "cached_tokens": {"no_cache": a["cached_tokens"], "memory": b["cached_tokens"],
                              "persisted": c["cached_tokens"]},
            "ratio_memory": b["ttft_s"] / a["ttft_s"], "ratio_persisted": c["ttft_s"] / a["ttft_s"],
            "llama_cpp": None if llama["status"] != "ok" else {
                "ttft_s": {mode: row["ttft_s"] for mode, row in llama["turns"][t].items()},
                "reused_tokens": {mode: row["reused_tokens"] for mode, row in llama["turns"][t].items()}},
        })
    mismatches = {mode: _mismatches(m[mode], m["no_cache"]) for mode in ("memory", "persisted")}
    last = per_turn[-1]
    return {
        "model": path.name, "dtype": args.dtype, "threads": m["threads"], "block_size": m["block_size"],
        "turns": args.turns, "user_tokens": args.user_tokens, "reply_tokens": args.reply_tokens,
        "per_turn": per_turn,
        "replies_identical": not any(mismatches.values()),
        "replies_identical_by_mode": {"memory": not mismatches["memory"], "persisted": not mismatches["persisted"]},
        "reply_mismatch_turns": mismatches,
        "disk": m["disk"],
        "llama_cpp": {k: v for k, v in llama.items() if k != "turns"},
        "target": {"turn": last["turn"], "ratio_persisted": last["ratio_persisted"], "max_ratio": TARGET_RATIO,
                   "met": last["ratio_persisted"] <= TARGET_RATIO},
        "wall_s": wall,
        "phase_wall_s": m["phases"],  # each mode's engine build, warm-up and turns
    }


def _print_table(r: dict) -> None:
    from kvforge.app.cli.cache import human_bytes

    print(f"model {r['model']}; dtype {r['dtype']}; {r['threads']} threads; block size {r['block_size']}; "
          f"{r['turns']} turns: user messages of ~{r['user_tokens']} tokens, greedy replies of <= "
          f"{r['reply_tokens']} tokens")
    print("TTFT in ms: add_request until the first token, the turn's whole chat prompt; (n) = prompt tokens "
          "served from a cache")
    header = (f"{'turn':>4}  {'prompt':>6}  {'no cache':>9}  {'memory':>9} {'(cached)':>8}  "
              f"{'persisted':>9} {'(cached)':>8}  {'persisted/no cache':>18}")
    print(header)
    print("-" * len(header))
    for p in r["per_turn"]:
        ttft, cached = p["ttft_s"], p["cached_tokens"]
        print(f"{p['turn']:>4}  {p['prompt_tokens']:>6}  {ttft['no_cache'] * 1000:>9.1f}  "
              f"{ttft['memory'] * 1000:>9.1f} {'(' + str(cached['memory']) + ')':>8}  "
              f"{ttft['persisted'] * 1000:>9.1f} {'(' + str(cached['persisted']) + ')':>8}  "
              f"{p['ratio_persisted']:>17.2f}x")
    by_mode, bad = r["replies_identical_by_mode"], r["reply_mismatch_turns"]
    names = {"memory": "memory", "persisted": "persisted after restart"}
    checks = ", ".join(f"{names[k]} {'yes' if ok else 'NO (turns ' + ','.join(map(str, bad[k])) + ')'}"
                       for k, ok in by_mode.items())
    print(f"replies equal to the no-cache replies, token for token: {checks}")
    d = r["disk"]
    print(f"disk tier: {d['written_blocks']} blocks written ({human_bytes(d['bytes'])}), {d['loaded_blocks']} "
          f"loaded after the restarts, {d['load_failures']} load failures")
    llama = r["llama_cpp"]
    if llama["status"] == "ok":
        print(f"llama.cpp ({llama['library']}, the same file and prompt token ids, its own process): TTFT in ms, "
              "(n) = prompt tokens it reused")
        print(f"{'turn':>4}  {'context kept':>12} {'(reused)':>8}  {'after restart':>13}  "
              f"{'kvforge persisted / llama.cpp restart':>38}")
        for p in r["per_turn"]:
            ttft, reused = p["llama_cpp"]["ttft_s"], p["llama_cpp"]["reused_tokens"]
            print(f"{p['turn']:>4}  {ttft['memory'] * 1000:>12.1f} {'(' + str(reused['memory']) + ')':>8}  "
                  f"{ttft['recompute'] * 1000:>13.1f}  {p['ttft_s']['persisted'] / ttft['recompute']:>37.2f}x")
    else:
        print(f"llama.cpp: {llama['status']} ({llama['why']})")
    t = r["target"]
    print(f"turn {t['turn']}: persisted after restart {t['ratio_persisted']:.2f}x the no-cache TTFT "
          f"(target <= {t['max_ratio']}x): {'met' if t['met'] else 'NOT met'}")


@contextmanager
def _stop_on_interrupt(stop: threading.Event):
    """Ctrl-C also tells the measuring thread to stop at its next step (it then removes its temporary
    data directory); otherwise the main thread would wait for the whole run before exiting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        stop.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat_bench(args: argparse.Namespace) -> dict:
    from kvforge.core.async_engine import build_off_main_thread

    path = checked_model(args, ("turns", "reply_tokens", "user_tokens"))
    if args.kv_cache_gb is not None and args.kv_cache_gb <= 0:
        raise ValueError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    stop = threading.Event()
    start = time.perf_counter()
    with _stop_on_interrupt(stop):
        measured = build_off_main_thread(lambda: _measure(args, path, stop))
    llama = _llama_cpp_turns(args, measured)
    report = _report(args, path, measured, llama, time.perf_counter() - start)
    emit(report, args.json, _print_table)
    return report


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `chat` on the `kvforge bench` subcommands."""
    chat = bench_parser(bench_sub, "chat", "TTFT per turn of a multi-turn chat: no prefix cache, in-memory cache, "
                        "persisted after a restart", run_chat_bench, dtype_help="float32 | bfloat16 | float16")
    chat.add_argument("--turns", type=int, default=10, help="turns of the conversation (default: 10)")
    chat.add_argument("--user-tokens", type=int, default=100, help="tokens per user message (default: ~100)")
    chat.add_argument("--reply-tokens", type=int, default=48, help="greedy reply length cap (default: 48)")
    chat.add_argument("--kv-cache-gb", type=float, default=None,
                      help="each engine's KV pool in GiB (default: the engine's, 1 GiB on CPU; a long conversation "
                           "on a larger model needs more)")
    add_peer_options(chat, ("llama",), "kvforge only: skip llama.cpp")
    return chat
