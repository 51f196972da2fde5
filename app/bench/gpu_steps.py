"""One model's steps in `kvforge bench gpu`: build it (and its HF twin), the HF references, then a kvforge
engine with CUDA graphs on and one with them off, each running parity, batch-1 decode against the roofline,
throughput and graph decode. Every step is wrapped: a failing one is recorded and the next still runs."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from kvforge.app.bench.probe import free_memory, is_cuda
from kvforge.app.bench.random_models import MODELS, SMOKE_MODELS, build_random_model, tokenizer_source
from kvforge.app.bench.references import hf_generate_rate, hf_reference, load_hf, parity
from kvforge.app.bench.report import TARGET_ROOFLINE, error_line
from kvforge.app.bench.runs import bench_engine, run_batch
from kvforge.app.bench.workloads import random_prompts


def make_engine(path: Path, args, graphs: bool, max_model_len: int):
    return bench_engine(
        model=str(path), dtype=args.dtype, device=args.device, kernels=args.kernels, cuda_graphs=graphs,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)) or None, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=max(max(args.batches), max(args.graph_batches), len(args.parity_prompt_lens)),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=False)  # random prompts share nothing; repeats must prefill again


def empty_result(name: str, note: str = "", error: str | None = None) -> dict:
    """A model's result before any step (with `error` as its process error)."""
    return {"model": name, "note": note, "done": [], "errors": {} if error is None else {"process": error},
            "skipped": {}, "timings": {}, "parity": {}, "decode": None, "throughput": {},
            "graphs": {"on": {}, "off": {}, "same_tokens": {}}}


class Steps:
    """Runs each step of a model wrapped: an error is printed and recorded, and the next step still runs.
    The results are written to `out` after every step (a crash keeps the finished ones)."""

    def __init__(self, result: dict, out: Path | None) -> None:
        self.result, self.out = result, out

    def save(self) -> None:
        if self.out is not None:
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.result, default=str))
            os.replace(tmp, self.out)

    def run(self, name: str, label: str, fn, *needs: str):
        model = self.result["model"]
        missing = [n for n in needs if n not in self.result["done"]]
        if missing:
            self.result["skipped"][name] = f"needs {', '.join(missing)}"
            print(f"[{model}] {label}: skipped ({missing[0]} did not finish)", flush=True)
            self.save()
            return None
        print(f"[{model}] {label} ...", flush=True)
        start = time.perf_counter()
        value = None
        try:
            value = fn()
            self.result["done"].append(name)
        except Exception as exc:
            self.result["errors"][name] = error_line(exc)
            print(f"[{model}] {label}: ERROR {error_line(exc)}", flush=True)
            traceback.print_exc(file=sys.stdout)
        elapsed = time.perf_counter() - start
        self.result["timings"][name] = elapsed
        print(f"[{model}] {label}: {elapsed:.1f} s", flush=True)
        sys.stdout.flush()
        self.save()
        return value


def run_model(name: str, args, bandwidth: float | None, out: Path | None = None, workdir: str | None = None) -> dict:
    """Every step for one model; the result dict (also written to `out` as it grows). The random model's files
    go to a temporary directory under `workdir` (default: the system's)."""
    from kvforge.core.config import DTYPES
    from kvforge.core.loader import resolve_model

    spec = (SMOKE_MODELS if args.smoke else MODELS)[name]
    device, dtype = args.device, DTYPES[args.dtype]
    result = empty_result(name, spec.note)
    steps = Steps(result, out)
    parity_prompts = [random_prompts(1, n, seed=100 + n)[0] for n in args.parity_prompt_lens]
    pool = random_prompts(max(max(args.batches), max(args.graph_batches)), args.prompt_len, seed=1)
    max_model_len = max(max(args.parity_prompt_lens) + args.parity_tokens, args.prompt_len + args.output_len,
                        args.prompt_len + args.decode_tokens) + 32
    state: dict = {}
    tmp = tempfile.TemporaryDirectory(prefix=f"kvforge-bench-gpu-{name}-", dir=workdir)
    try:
        def build():
            if spec.family == "embedded":
                state["path"] = resolve_model(None)
                state["hf"] = None if args.no_hf else load_hf(state["path"], dtype, device)
            else:
                state["path"] = Path(tmp.name) / name
                tokenizer_dir = tokenizer_source(Path(tmp.name))
                state["hf"] = build_random_model(spec, state["path"], device, dtype, tokenizer_dir)
                if args.no_hf:
                    state.pop("hf")
            config = json.loads((state["path"] / "config.json").read_text())
            result["config"] = {k: config.get(k) for k in (
                "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings")}
            hf = state.get("hf")
            if hf is not None:
                result["hf_params"] = sum(p.numel() for p in hf.parameters())
            print(f"[{name}] {spec.note}: {result['config']}", flush=True)

        steps.run("build", "build model" + ("" if args.no_hf else " + HF model on the device"), build)

        if not args.no_hf and "build" in result["done"]:
            def hf_parity():
                state["refs"] = hf_reference(state["hf"], parity_prompts, args.parity_tokens, device)

            def hf_throughput():
                hf = state["hf"]
                hf_generate_rate(hf, pool[:1], 2, device)  # warm-up
                for n in args.batches:
                    if n > args.hf_max_batch:
                        print(f"[{name}] HF generate batch {n}: skipped (--hf-max-batch {args.hf_max_batch})")
                        continue
                    hf_generate_rate(hf, pool[:n], 2, device)  # warm-up at this shape
                    rate = hf_generate_rate(hf, pool[:n], args.output_len, device)
                    result["throughput"].setdefault(str(n), {})["hf"] = rate
                    print(f"[{name}] HF generate batch {n}: {rate['output_tok_s']:.1f} output tok/s "
                          f"({rate['wall_s']:.2f} s)", flush=True)
                    steps.save()

            steps.run("hf_parity_reference", "2. HF reference (greedy, logprobs)", hf_parity, "build")
            steps.run("hf_throughput", f"4. HF generate at batches {args.batches}", hf_throughput, "build")
        state.pop("hf", None)  # the HF model goes before the engines come
        free_memory(device)

        for graphs in (True, False):
            tag = "on" if graphs else "off"
            engine_step = f"engine_graphs_{tag}"

            def start(graphs=graphs, tag=tag):
                t0 = time.perf_counter()
                engine = make_engine(state["path"], args, graphs, max_model_len)
                state["engine"] = engine
                result[f"engine_start_s_graphs_{tag}"] = time.perf_counter() - t0
                runtime = engine.runtime()
                result["weight_bytes"] = runtime.weight_bytes
                result["kv_cache_bytes"] = runtime.kv_cache_bytes
                kernels, sizes = runtime.kernels, runtime.cuda_graph_batch_sizes
                result[f"engine_graphs_{tag}"] = {"kernels": kernels, "graph_batch_sizes": sizes}
                cfg = engine.config
                print(f"[{name}] engine (cuda_graphs={graphs}): device {cfg.device}, dtype {cfg.dtype}, kernels "
                      f"{cfg.kernels} -> {kernels}, CUDA graphs for batches {sizes or 'none'}, weights "
                      f"{result['weight_bytes'] / 1e9:.3f} GB, KV cache {runtime.kv_cache_bytes / (1 << 30):.2f} GiB, "
                      f"start-up {result[f'engine_start_s_graphs_{tag}']:.1f} s", flush=True)
                if is_cuda(args.device) and args.kernels != "torch" and kernels != "triton":
                    result["errors"][f"engine_graphs_{tag}_kernels"] = (
                        f"kernels={args.kernels!r} on CUDA resolved to {kernels!r}, not the Triton kernels")
                if is_cuda(args.device) and graphs and not sizes:
                    result["errors"]["engine_graphs_on_capture"] = (
                        "cuda_graphs=True but no graph was captured (see the warning above): decode ran eagerly")
                start_warm = time.perf_counter()
                run_batch(engine, [pool[0]], 4)  # warm-up: compiles, first launches
                print(f"[{name}] first request (warm-up) {time.perf_counter() - start_warm:.1f} s", flush=True)

            steps.run(engine_step, f"kvforge engine start (cuda_graphs={graphs})", start, "build")
            try:
                if graphs:
                    _engine_on_steps(steps, state, args, name, parity_prompts, pool, bandwidth)
                else:
                    _engine_off_steps(steps, state, args, name, parity_prompts, pool)
            finally:
                engine = state.pop("engine", None)
                if engine is not None:
                    try:
                        engine.close()
                    except Exception as exc:
                        print(f"[{name}] engine close: {error_line(exc)}", flush=True)
                    del engine
                free_memory(device)
    finally:
        state.clear()
        free_memory(device)
        tmp.cleanup()
        steps.save()
    return result


def _graph_decode(steps: Steps, state: dict, args, name: str, pool: list[list[int]], tag: str) -> None:
    result = steps.result
    for n in args.graph_batches:
        run = run_batch(state["engine"], pool[:n], args.output_len)
        result["graphs"][tag][str(n)] = run["decode_tok_s"]
        state.setdefault("graph_tokens", {}).setdefault(tag, {})[n] = run["token_ids"]
        rate = "n/a" if run["decode_tok_s"] is None else f"{run['decode_tok_s']:.1f}"
        print(f"[{name}] cuda_graphs {tag}, batch {n}: {rate} decode tok/s", flush=True)
        steps.save()


def _engine_on_steps(steps: Steps, state: dict, args, name: str, parity_prompts, pool, bandwidth) -> None:
    result = steps.result

    def check_parity():
        report = parity(state["engine"], parity_prompts, state["refs"], args.parity_tokens, args.logprob_tol)
        result["parity"]["graphs_on"] = report
        diff = report["first_token_max_abs_logprob_diff"]
        print(f"[{name}] parity vs HF ({args.dtype}): {report['verdict']}; first-token max |dlogprob| "
              f"{'n/a' if diff is None else f'{diff:.4f}'} (tol {args.logprob_tol}); "
              + "; ".join(f"len {r['prompt_len']}: {r['equal_prefix']}/{r['tokens']} equal"
                          + (f", {r['reason']}" if r["reason"] else "") for r in report["prompts"]), flush=True)

    def decode():
        engine = state["engine"]
        rates = [run_batch(engine, [pool[0]], args.decode_tokens)["decode_tok_s"] for _ in range(args.repeats)]
        rates = [r for r in rates if r is not None]
        if not rates:
            raise ValueError("--decode-tokens must be >= 2 to time decode steps")
        tok_s = statistics.median(rates)
        runtime = engine.runtime()
        weights = runtime.weight_bytes
        weight_read = weights - runtime.embedding_bytes
        kv_per_token = runtime.kv_bytes_per_token
        kv_read = kv_per_token * (args.prompt_len + args.decode_tokens / 2)  # the mean context's KV
        per_token = weight_read + kv_read
        roofline = bandwidth / per_token if bandwidth else None
        result["decode"] = {"tok_s": tok_s, "runs": rates, "weight_bytes": weights,
                            "weight_bytes_read_per_token": weight_read, "kv_bytes_read_per_token": kv_read,
                            "bytes_per_token": per_token, "bandwidth_bytes_per_s": bandwidth,
                            "roofline_tok_s": roofline, "fraction_of_roofline": tok_s / roofline if roofline else None,
                            "target": TARGET_ROOFLINE}
        share = f"{tok_s / roofline:.1%}" if roofline else "n/a"
        print(f"[{name}] batch-1 decode {tok_s:.1f} tok/s; roofline {roofline or 0:.1f} tok/s "
              f"({per_token / 1e9:.3f} GB per token); {share} of roofline (target {TARGET_ROOFLINE:.0%})", flush=True)

    def throughput():
        engine = state["engine"]
        for n in args.batches:
            run_batch(engine, pool[:n], 3)  # warm-up at this batch size
            run = run_batch(engine, pool[:n], args.output_len)
            row = result["throughput"].setdefault(str(n), {})
            row["kvforge"] = {k: run[k] for k in ("wall_s", "generated_tokens", "output_tok_s", "decode_tok_s")}
            hf = row.get("hf")
            row["ratio"] = run["output_tok_s"] / hf["output_tok_s"] if hf else None
            versus = f"; HF {hf['output_tok_s']:.1f} tok/s; {row['ratio']:.2f}x" if hf else "; HF n/a"
            print(f"[{name}] kvforge batch {n}: {run['output_tok_s']:.1f} output tok/s ({run['wall_s']:.2f} s)"
                  f"{versus}", flush=True)
            steps.save()

    steps.run("parity", "2. parity vs HF (cuda_graphs on)", check_parity, "engine_graphs_on", "hf_parity_reference")
    steps.run("decode", "3. batch-1 decode vs roofline", decode, "engine_graphs_on")
    steps.run("throughput", f"4. kvforge throughput at batches {args.batches}", throughput, "engine_graphs_on")
    steps.run("graphs_on", f"5. decode, cuda_graphs on, batches {args.graph_batches}",
              lambda: _graph_decode(steps, state, args, name, pool, "on"), "engine_graphs_on")


def _engine_off_steps(steps: Steps, state: dict, args, name: str, parity_prompts, pool) -> None:
    result = steps.result

    def graphs_off():
        _graph_decode(steps, state, args, name, pool, "off")
        tokens = state.get("graph_tokens", {})
        for n in args.graph_batches:
            on, off = tokens.get("on", {}).get(n), tokens.get("off", {}).get(n)
            if on is not None and off is not None:
                same = sum(a == b for a, b in zip(on, off))
                result["graphs"]["same_tokens"][str(n)] = f"{same}/{n}"

    def check_parity():
        report = parity(state["engine"], parity_prompts, state["refs"], args.parity_tokens, args.logprob_tol)
        result["parity"]["graphs_off"] = report
        print(f"[{name}] parity vs HF (cuda_graphs off): {report['verdict']}", flush=True)

    steps.run("graphs_off", f"5. decode, cuda_graphs off, batches {args.graph_batches}", graphs_off,
              "engine_graphs_off")
    steps.run("parity_graphs_off", "2. parity vs HF (cuda_graphs off)", check_parity, "engine_graphs_off",
              "hf_parity_reference")
