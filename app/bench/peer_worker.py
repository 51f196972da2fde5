"""One engine of `kvforge bench peers`, in a process of its own, run by that engine's interpreter:
`python peer_worker.py JOB.json`.

A peer's virtualenv (vLLM CPU, llama-cpp-python) has no kvforge: this file imports only the standard library
at its top, and each engine's library inside that engine's function. The parent copies it into the job's
directory and runs it from there, so nothing of the bench package lands on the peer's sys.path. vLLM spawns
processes that re-import this file: the work starts under `if __name__ == "__main__":`.

The job (JSON): kind (hf | kvforge | vllm | llama.cpp | llama.cpp-chat), model (a safetensors directory; llama.cpp:
the GGUF file), dtype, prompts (token ids, chat template applied: every engine gets the same ids), batches, requests
(per batch), output_tokens, threads, kv_cache_gib, pad_id, out (a file: one JSON line per measurement, appended as
each one ends, so a crash keeps the finished ones). At batch B an engine serves `requests[B]` of the prompts in
waves of B submitted at once (a wave starts when the previous one has finished), each request greedy and forced to
`output_tokens` tokens (EOS ignored), prefix caching off (every request computes its whole prompt). Each line
written is either {"info": {...}} (the library's version, the load time, the memory after load and at the end:
`memory()`) or a measurement {"batch", "requests", "generated_tokens", "wall_s", "ttft_s": [per request] | null,
"tpot_s": [...] | null, "timing"} or {"batch", "skipped": why} for a batch the engine cannot run.

`kvforge bench chat` runs kind llama.cpp-chat the same way: its prompts are a conversation's turns, with
reply_tokens (per turn) in place of batches (run_llama_cpp_chat).
"""

from __future__ import annotations

import json
import os
import sys
import time

perf = time.perf_counter
PROCESS_START = perf()  # before any engine library is imported: `ready_s` counts from here


class Job:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.prompts: list[list[int]] = spec["prompts"]
        self.tokens: int = spec["output_tokens"]
        self.threads: int = spec["threads"]
        self._out = open(spec["out"], "a")

    def emit(self, row: dict) -> None:
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()

    def loaded(self, info: dict) -> None:
        """The library and load time (`load_s`: the model, its library already imported), the time from the worker's
        start to the loaded model (`ready_s`: the library's import too), with the memory held once it is loaded."""
        after = memory()
        self.emit({"info": info | {"ready_s": perf() - PROCESS_START}
                   | {f"{k}_after_load": v for k, v in after.items() if k != "peak_rss_bytes"}})

    def finished(self) -> None:
        """The memory at the end, with the peak (called while the engine, and any process of its own, still runs)."""
        self.emit({"info": {f"{k}_end" if k != "peak_rss_bytes" else k: v for k, v in memory().items()}})

    def workloads(self):
        """(batch, its waves of prompts) per batch, in order."""
        for batch in self.spec["batches"]:
            chosen = self.prompts[:self.spec["requests"][str(batch)]]
            yield batch, [chosen[i:i + batch] for i in range(0, len(chosen), batch)]

    def measured(self, batch: int, waves: list, generated: int, wall: float, ttft, tpot, timing: str) -> None:
        expected = sum(len(w) for w in waves) * self.tokens
        if generated != expected:  # a short request would flatter the rate: refuse it
            raise RuntimeError(f"batch {batch}: {generated} tokens generated, {expected} expected "
                               f"({self.tokens} per request, EOS ignored)")
        self.emit({"batch": batch, "requests": sum(len(w) for w in waves), "generated_tokens": generated,
                   "wall_s": wall, "ttft_s": ttft, "tpot_s": tpot, "timing": timing})

    def warm_ids(self) -> list[int]:
        return self.prompts[0][-8:]  # a short tail: first launches and allocations, outside the measurement


def run_hf(job: Job) -> None:
    """HF transformers `generate`, a static left-padded batch per wave. TTFT: a separate 1-token `generate` of
    the same wave (the time its requests wait for their first token); TPOT: (the full generate - that) /
    (tokens - 1)."""
    import torch
    import transformers

    from kvforge.app.bench.references import hf_generate, load_hf

    torch.set_num_threads(job.threads)
    start = perf()
    model = load_hf(job.spec["model"], job.spec["dtype"])
    job.loaded({"library": f"transformers {transformers.__version__}, torch {torch.__version__}",
                "load_s": perf() - start})
    pad = job.spec["pad_id"]
    hf_generate(model, [job.warm_ids()], 2, pad)
    for batch, waves in job.workloads():
        generated, wall, ttft, tpot = 0, 0.0, [], []
        for wave in waves:
            start = perf()
            hf_generate(model, wave, 1, pad)
            first = perf() - start
            start = perf()
            generated += hf_generate(model, wave, job.tokens, pad)
            full = perf() - start
            wall += full
            ttft += [first] * len(wave)
            # a full generate no longer than its 1-token probe (a noisy machine) leaves TPOT unknown
            tpot += [(full - first) / (job.tokens - 1) if job.tokens > 1 and full > first else None] * len(wave)
        job.measured(batch, waves, generated, wall, ttft, _known(tpot),
                     "TTFT: a 1-token generate of the wave; TPOT: (full - that) / (tokens - 1)")
    job.finished()


def run_kvforge(job: Job) -> None:
    """kvforge's LLMEngine stepped to the end of each wave; TTFT and TPOT from each request's metrics."""
    # transformers: kvforge's config, tokenizer and rope library, imported before the clock as every engine's library
    # is (~2.5-5 s on a 2-core Zen 2; `ready_s` counts it). Its modules load at first use: a config class brings in
    # what every config class shares (type validators, activations, torch.distributed.tensor: ~2 s)
    import torch
    import transformers

    import kvforge
    import kvforge.app.models.factory  # noqa: F401 -- the app's engine factory (bench_engine's), with its imports

    transformers.AutoConfig, transformers.AutoTokenizer, transformers.LlamaConfig  # noqa: B018
    from kvforge.app.bench.runs import bench_engine, warm_up
    from kvforge.core import SamplingParams

    start = perf()
    largest = max(job.spec["batches"])
    engine = bench_engine(model=job.spec["model"], dtype=job.spec["dtype"], num_threads=job.threads,
                          enable_prefix_caching=False, kv_cache_bytes=int(job.spec["kv_cache_gib"] * (1 << 30)),
                          max_num_seqs=max(64, largest))
    version = getattr(kvforge, "__version__", None) or _dist_version("kvforge")
    job.loaded({"library": f"kvforge {version}, torch {torch.__version__}", "load_s": perf() - start})
    try:
        warm_up(engine, job.warm_ids(), ignore_eos=True)
        params = SamplingParams(temperature=0, max_tokens=job.tokens, ignore_eos=True)
        for batch, waves in job.workloads():
            generated, wall, ttft, tpot = 0, 0.0, [], []
            for wave in waves:
                finals = []
                start = perf()
                for ids in wave:
                    engine.add_request(ids, params)
                while engine.has_unfinished():
                    finals.extend(out for out in engine.step() if out.finished)
                wall += perf() - start
                generated += sum(len(out.token_ids) for out in finals)
                for out in finals:
                    metrics = out.metrics or {}
                    ttft.append(metrics.get("ttft"))
                    tpot.append(metrics.get("tpot"))
            job.measured(batch, waves, generated, wall, _known(ttft), _known(tpot), "the engine's request metrics")
        job.finished()
    finally:
        engine.close()


def run_vllm(job: Job) -> None:
    """vLLM's offline LLM.generate per wave; TTFT and TPOT from RequestOutput.metrics (kept when log stats are
    on): first_token_latency, and (last_token_ts - first_token_ts) / (tokens - 1)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(job.spec["kv_cache_gib"]))))
    import vllm
    from vllm import LLM, SamplingParams

    start = perf()
    longest = max(len(p) for p in job.prompts) + job.tokens + 16
    llm = LLM(model=job.spec["model"], dtype=job.spec["dtype"], max_model_len=max(2048, longest),
              max_num_seqs=max(64, max(job.spec["batches"])), enable_prefix_caching=False, disable_log_stats=False,
              seed=0)
    job.loaded({"library": f"vLLM {vllm.__version__}", "load_s": perf() - start})
    llm.generate([{"prompt_token_ids": job.warm_ids()}], SamplingParams(temperature=0, max_tokens=2),
                 use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=job.tokens, min_tokens=job.tokens, ignore_eos=True)
    for batch, waves in job.workloads():
        generated, wall, ttft, tpot = 0, 0.0, [], []
        for wave in waves:
            start = perf()
            outs = llm.generate([{"prompt_token_ids": ids} for ids in wave], params, use_tqdm=False)
            wall += perf() - start
            for out in outs:
                n = len(out.outputs[0].token_ids)
                generated += n
                m = out.metrics
                first = getattr(m, "first_token_latency", 0.0) or None
                span = (getattr(m, "last_token_ts", 0.0) - getattr(m, "first_token_ts", 0.0)) if m else 0.0
                ttft.append(first)
                tpot.append(span / (n - 1) if first and n > 1 and span > 0 else None)
        job.measured(batch, waves, generated, wall, _known(ttft), _known(tpot), "RequestOutput.metrics")
    job.finished()  # while the LLM, and its engine-core process, are alive


def _llama_cpp(job: Job, n_ctx: int):
    """llama-cpp-python's Llama on the job's GGUF, loaded (the info line emitted), and a logits processor that
    masks every end-of-generation token out (EOS can never be sampled)."""
    import llama_cpp
    from llama_cpp import Llama, LogitsProcessorList

    start = perf()
    llm = Llama(model_path=job.spec["model"], n_ctx=n_ctx, n_threads=job.threads, n_threads_batch=job.threads,
                n_batch=512, seed=0, verbose=False)
    is_eog = getattr(llama_cpp, "llama_vocab_is_eog", None)  # every end-of-generation token, where exposed
    vocab = getattr(getattr(llm, "_model", None), "vocab", None)
    banned = sorted({llm.token_eos()} | ({t for t in range(llm.n_vocab()) if is_eog(vocab, t)}
                                         if is_eog and vocab is not None else set()))

    def no_eos(input_ids, scores):
        scores[banned] = -float("inf")
        return scores

    job.loaded({"library": f"llama-cpp-python {llama_cpp.__version__}", "load_s": perf() - start,
                "eos_masked": banned})
    return llm, LogitsProcessorList([no_eos])


def run_llama_cpp(job: Job) -> None:
    """llama-cpp-python's Llama on the GGUF file, one sequence at a time (its Python API has no batching: batches
    above 1 are skipped). EOS is masked out of the logits (the end-of-generation tokens can never be sampled).
    TTFT: until the generator yields the first token; TPOT: (last - first token) / (tokens - 1)."""
    llm, processors = _llama_cpp(job, max(len(p) for p in job.prompts) + job.tokens + 16)

    def one(ids: list[int], n: int) -> tuple[float, list[float]]:
        llm.reset()  # no reuse of the previous request's prefix
        times, start = [], perf()
        for _ in llm.generate(ids, temp=0.0, reset=True, logits_processor=processors):
            times.append(perf())
            if len(times) == n:
                break
        return start, times

    one(job.warm_ids(), 2)
    for batch, waves in job.workloads():
        if batch > 1:
            job.emit({"batch": batch, "skipped": "llama-cpp-python serves one sequence at a time"})
            continue
        generated, wall, ttft, tpot = 0, 0.0, [], []
        for wave in waves:
            start, times = one(wave[0], job.tokens)
            generated += len(times)
            wall += times[-1] - start
            ttft.append(times[0] - start)
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
        job.measured(batch, waves, generated, wall, ttft, tpot or None, "timed at each token the generator yields")
    job.finished()


def memory() -> dict:
    """This process's memory with its descendants' (vLLM's engine core is a child process), in bytes, from
    /proc/PID/status: rss_bytes (VmRSS: resident now, the mapped model file's pages included), rss_anon_bytes
    (RssAnon: what is not file-backed) and peak_rss_bytes (VmHWM, each process's own peak, summed), and the number
    of processes. Off Linux: this process's ru_maxrss as the peak, the rest unknown."""
    try:
        pids = _process_tree(os.getpid())
        totals = {"VmRSS": 0, "RssAnon": 0, "VmHWM": 0}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        key, _, value = line.partition(":")
                        if key in totals:
                            totals[key] += int(value.split()[0]) * 1024  # kB
            except OSError:  # exited meanwhile
                continue
        return {"rss_bytes": totals["VmRSS"], "rss_anon_bytes": totals["RssAnon"], "peak_rss_bytes": totals["VmHWM"],
                "processes": len(pids)}
    except OSError:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB elsewhere
        return {"rss_bytes": None, "rss_anon_bytes": None, "processes": 1,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}


def _process_tree(root: int) -> list[int]:
    """`root` and every process below it (parents read from /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # after the command name, which may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _known(values: list) -> list | None:
    known = [v for v in values if v is not None]
    return known if len(known) == len(values) and known else None  # all or nothing: no partial percentiles


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def run_llama_cpp_chat(job: Job) -> None:
    """`kvforge bench chat`'s conversation on llama-cpp-python: the job's prompts are its turns' chat prompts (the
    same token ids kvforge timed), `reply_tokens` each turn's reply length (forced: EOS masked). Two passes:
    `memory`, one Llama kept across the turns: it reuses the longest prefix its context holds from the previous
    turn (the prompt and its own reply), as llama.cpp's server does within a slot; `recompute`, its context cleared
    before each turn: what a restarted llama.cpp server does (it keeps no KV across a restart unless a slot is saved
    and restored by hand). One line per turn: {"mode", "turn", "ttft_s", "reused_tokens", "tokens"}."""
    replies = job.spec["reply_tokens"]
    llm, processors = _llama_cpp(job, max(len(p) for p in job.prompts) + max(replies) + 16)
    for _ in llm.generate(job.warm_ids(), temp=0.0, reset=True, logits_processor=processors):
        break
    for mode in ("memory", "recompute"):
        llm.reset()
        for turn, (ids, n) in enumerate(zip(job.prompts, replies), 1):
            if mode == "recompute":
                llm.reset()
            held = list(llm._input_ids[:llm.n_tokens])  # what the context holds: the reuse llama.cpp will find
            reused = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))
            start, first, count = perf(), None, 0
            for _ in llm.generate(ids, temp=0.0, reset=True, logits_processor=processors):
                count += 1
                first = first or perf()
                if count == n:
                    break
            job.emit({"mode": mode, "turn": turn, "ttft_s": first - start, "reused_tokens": reused,
                      "tokens": count})
    job.finished()


RUNNERS = {"hf": run_hf, "kvforge": run_kvforge, "vllm": run_vllm, "llama.cpp": run_llama_cpp,
           "llama.cpp-chat": run_llama_cpp_chat}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    RUNNERS[spec["kind"]](Job(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
