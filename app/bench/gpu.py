"""`kvforge bench gpu`: the GPU fast path's evidence in one run, with no network.

Random-weight models of 0.5B-1.5B Llama / Qwen2 shapes are built from configs on the device (nothing is
downloaded), next to the embedded model, and for each:

  1. the device and its measured copy bandwidth (bytes read + written per second, median of a few);
  2. parity with HF transformers in bf16: greedy tokens compared by vLLM's `check_logprobs_close` rule
     (equal tokens, or the first divergence within each other's top-5 logprobs), and the largest
     |logprob difference| of the first generated token;
  3. batch-1 decode tok/s against the bandwidth roofline (bytes read per token / measured bandwidth);
  4. output tok/s of 1 / 16 / 64 / 256 sequences submitted at once, against HF `generate` on the same
     prompts as one batch;
  5. decode tok/s with CUDA graphs on and off.

Each model runs in a child process of its own (gpu_worker.py), and every step inside it is wrapped
(gpu_steps.py): a failing step prints its error and the others still run; the exit status is 1 when
anything failed. `--smoke` runs the same code on the CPU with tiny models, so CI proves the code paths.
The kernel tests are not part of it: run them with pytest on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from kvforge.app.bench.arguments import int_list
from kvforge.app.bench.gpu_steps import empty_result, run_model
from kvforge.app.bench.gpu_worker import run_model_isolated
from kvforge.app.bench.probe import copy_bandwidth, device_info, is_cuda
from kvforge.app.bench.random_models import MODELS, SMOKE_MODELS
from kvforge.app.bench.report import error_line, print_summary, verdicts

NEEDS_CUDA = "kvforge bench gpu needs a CUDA device (use --smoke on CPU)"

# option -> (GPU default, --smoke default)
DEFAULTS = {
    "models": (",".join(MODELS), ",".join(SMOKE_MODELS)),
    "batches": ("1,16,64,256", "1,4"),
    "graph_batches": ("1,64", "1,4"),
    "prompt_len": (128, 16),
    "output_len": (128, 8),
    "decode_tokens": (128, 8),
    "repeats": (3, 1),
    "parity_tokens": (32, 8),
    "parity_prompt_lens": ("17,64,200", "5,17,40"),
    "kv_cache_gb": (0.0, 0.0625),  # 0: sized from --gpu-memory-utilization (the profiling forward runs)
    "max_num_batched_tokens": (4096, 2048),
    "bandwidth_gib": (2.0, 0.0625),
    "time_budget": (450.0, 900.0),
}


def add_parser(bench_sub) -> None:
    gpu = bench_sub.add_parser(
        "gpu", help="the GPU fast path in one run: HF parity in bf16, batch-1 decode vs the bandwidth roofline, "
                    "throughput vs HF generate, CUDA graphs on vs off (random-weight models, no download)")
    gpu.add_argument("--smoke", action="store_true",
                     help="run every code path on the CPU with tiny random models (CI); figures mean nothing")
    gpu.add_argument("--models", default=None,
                     help=f"comma-separated, from {', '.join(MODELS)} (--smoke: {', '.join(SMOKE_MODELS)}); "
                          "default: all")
    gpu.add_argument("--device", default="cuda", help="the CUDA device (default: cuda; --smoke: cpu)")
    gpu.add_argument("--dtype", default="bfloat16", help="kvforge and HF dtype (default: bfloat16)")
    gpu.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                     help="kvforge kernels (default auto: Triton on CUDA)")
    gpu.add_argument("--batches", default=None, metavar="N[,N...]",
                     help="concurrent sequences for the throughput phase (default: 1,16,64,256; --smoke: 1,4)")
    gpu.add_argument("--graph-batches", default=None, metavar="N[,N...]",
                     help="decode batch sizes for CUDA graphs on vs off (default: 1,64; --smoke: 1,4)")
    gpu.add_argument("--prompt-len", type=int, default=None, help="throughput prompt tokens (default: 128)")
    gpu.add_argument("--output-len", type=int, default=None, help="throughput output tokens (default: 128)")
    gpu.add_argument("--decode-tokens", type=int, default=None, help="batch-1 decode tokens per run (default: 128)")
    gpu.add_argument("--repeats", type=int, default=None, help="batch-1 decode runs, the median is kept (default: 3)")
    gpu.add_argument("--parity-tokens", type=int, default=None, help="greedy tokens compared with HF (default: 32)")
    gpu.add_argument("--parity-prompt-lens", default=None, metavar="N[,N...]",
                     help="parity prompt lengths (default: 17,64,200)")
    gpu.add_argument("--logprob-tol", type=float, default=0.5,
                     help="parity: largest |logprob difference| allowed on the first generated token's top-5 "
                          "(default: 0.5; bf16 logits of magnitude 16-32 are 0.125 apart)")
    gpu.add_argument("--hf-max-batch", type=int, default=256,
                     help="HF generate runs only batches up to this size (default: 256)")
    gpu.add_argument("--no-hf", action="store_true", help="skip HF transformers (no parity, no ratios)")
    gpu.add_argument("--kv-cache-gb", type=float, default=None,
                     help="kvforge KV cache in GiB (default on a GPU: sized from --gpu-memory-utilization)")
    gpu.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                     help="the engines' share of the GPU when --kv-cache-gb is not given (default: 0.5)")
    gpu.add_argument("--max-num-batched-tokens", type=int, default=None, help="kvforge tokens per step (default: 4096)")
    gpu.add_argument("--bandwidth-gib", type=float, default=None,
                     help="copy-bandwidth buffer size in GiB (default: 2; --smoke: 1/16)")
    gpu.add_argument("--time-budget", type=float, default=None,
                     help="seconds for the whole run (default: 450; --smoke: 900): a model that cannot start within "
                          "it is skipped, one that overruns it is stopped (its finished steps are kept)")
    gpu.add_argument("--no-isolate", action="store_true",
                     help="run the models in this process instead of one child process each")
    gpu.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    gpu.set_defaults(func=cmd_bench_gpu)


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --smoke and check every option; ValueError (exit 2) for a bad one."""
    from kvforge.core.config import DTYPES

    smoke = bool(args.smoke)
    for name, (gpu_default, smoke_default) in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, smoke_default if smoke else gpu_default)
    if smoke:
        args.device = "cpu"
    known = SMOKE_MODELS if smoke else MODELS
    names = [m.strip() for m in str(args.models).split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        raise ValueError(f"--models: unknown model {unknown[0] if unknown else args.models!r} "
                         f"(choose from {', '.join(known)})")
    args.models = names
    for name in ("batches", "graph_batches", "parity_prompt_lens"):
        if isinstance(getattr(args, name), str):
            setattr(args, name, int_list(getattr(args, name), name.replace("_", "-")))
    for name in ("prompt_len", "output_len", "decode_tokens", "repeats", "parity_tokens", "hf_max_batch",
                 "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.kv_cache_gb >= 0 and 0 < args.gpu_memory_utilization <= 1):
        raise ValueError("--kv-cache-gb must be >= 0 and --gpu-memory-utilization in (0, 1]")
    for name in ("bandwidth_gib", "time_budget", "logprob_tol"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if max(args.parity_prompt_lens) > 4096:
        raise ValueError("--parity-prompt-lens: at most 4096 tokens")
    return args


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    args = resolve_options(args)
    if not args.smoke and not torch.cuda.is_available():
        raise ValueError(NEEDS_CUDA)
    if not args.smoke and not is_cuda(args.device):
        raise ValueError(f"--device must be a CUDA device (cuda or cuda:N), got {args.device!r}; "
                         "use --smoke for the CPU")
    deadline = t_start + args.time_budget
    options = {k: v for k, v in vars(args).items() if k != "func"}
    report: dict = {"options": options, "device": None, "bandwidth": None, "models": [],
                    "errors": {}, "timings": {}}
    print(f"kvforge bench gpu{' --smoke' if args.smoke else ''}: models {', '.join(args.models)}; {args.dtype}; "
          f"kernels {args.kernels}; time budget {args.time_budget:.0f} s", flush=True)

    print("\n== 1/5 device and copy bandwidth ==", flush=True)
    start = time.perf_counter()
    try:
        report["device"] = device_info(args.device)
        print("  " + ", ".join(f"{k} {v}" for k, v in report["device"].items()), flush=True)
        report["bandwidth"] = copy_bandwidth(args.device, args.bandwidth_gib)
        bw = report["bandwidth"]
        print(f"  copy bandwidth {bw['gb_per_s']:.1f} GB/s (read + write of a {bw['buffer_bytes'] / (1 << 30):.3f} "
              f"GiB bf16 buffer, median {bw['median_s'] * 1000:.3f} ms)", flush=True)
    except Exception as exc:
        report["errors"]["bandwidth"] = error_line(exc)
        print(f"  ERROR {error_line(exc)}", flush=True)
        traceback.print_exc(file=sys.stdout)
    try:  # once here (a first run converts the embedded GGUF): the models' processes then find it cached
        from kvforge.core.loader import resolve_model

        t0 = time.perf_counter()
        report["embedded_model"] = str(resolve_model(None))
        print(f"  embedded model {report['embedded_model']} ({time.perf_counter() - t0:.1f} s)", flush=True)
    except Exception as exc:  # the random models fall back to a synthetic tokenizer
        report["embedded_model"] = None
        print(f"  embedded model unavailable: {error_line(exc)}", flush=True)
    report["timings"]["1_bandwidth"] = time.perf_counter() - start
    print(f"  [{report['timings']['1_bandwidth']:.1f} s]", flush=True)

    bandwidth = report["bandwidth"]["bytes_per_s"] if report["bandwidth"] else None
    for name in args.models:
        left = deadline - time.perf_counter()
        print(f"\n== model {name}: phases 2-5 [{left:.0f} s of the time budget left] ==", flush=True)
        start = time.perf_counter()
        if left < 20:
            result = empty_result(name, error="not started: the time budget is spent")
            print(f"  skipped: {result['errors']['process']}", flush=True)
        else:
            try:
                result = run_model(name, args, bandwidth) if args.no_isolate else run_model_isolated(
                    name, args, bandwidth, left)
            except Exception as exc:
                traceback.print_exc(file=sys.stdout)
                result = empty_result(name, error=error_line(exc))
        report["models"].append(result)
        report["timings"][f"model_{name}"] = time.perf_counter() - start
        print(f"  [{name}: {report['timings'][f'model_{name}']:.1f} s]", flush=True)

    try:
        report["targets"], report["failures"] = verdicts(report)
    except Exception as exc:  # a bug here must not lose the figures: the JSON still gets written
        report["targets"], report["failures"] = [], [f"verdicts: {error_line(exc)}"]
        traceback.print_exc(file=sys.stdout)
    report["total_s"] = time.perf_counter() - t_start
    report["ok"] = not report["failures"]
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        except Exception as exc:
            print(f"writing {args.json}: {error_line(exc)}", flush=True)
            report["ok"] = False
    try:
        print_summary(report)
    except Exception as exc:
        print(f"summary: {error_line(exc)}", flush=True)
        traceback.print_exc(file=sys.stdout)
        report["ok"] = False
    outcome = "all phases ran" if report["ok"] else f"{len(report['failures'])} failure(s)"
    print(f"\ntotal {report['total_s']:.1f} s (budget {args.time_budget:.0f} s); {outcome}", flush=True)
    if args.json:
        print(f"results written to {args.json}")
    return 0 if report["ok"] else 1
