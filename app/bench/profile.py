"""`kvforge bench profile`: where a decode step's time goes on this CPU, at each batch size.

For each --batches B it submits B chat prompts at once (prefix caching off, EOS ignored), steps until every
sequence has its first token (prefill done), times --steps decode steps as they run (the step time), then runs
as many more under torch.profiler and adds up each torch op's own CPU time (children excluded) into classes:
linears, attention math, KV gather / write, copies and dtype conversions, elementwise (norms, rotary, SiLU,
residuals), sampling, other ops. What the profiled steps spend outside any torch op is the Python around them
(scheduling, layout, detokenizing, the per-layer module calls) plus the profiler's own cost, reported as such."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from kvforge.app.bench.arguments import bench_parser, checked_model, int_list, use_threads
from kvforge.app.bench.report import emit
from kvforge.app.bench.runs import bench_engine, decode_ready, lasting_max_tokens
from kvforge.app.bench.workloads import chat_messages

# op class -> the aten / extension op names (the part after "::") that fall in it; the first class that names an
# op wins; anything else is "other ops"
OP_CLASSES = {
    "linears": ("linear", "addmm", "mm", "matmul", "mkldnn_linear", "_weight_int4pack_mm", "_weight_int8pack_mm",
                "_weight_int4pack_mm_for_cpu", "mkldnn_rnn_layer", "_linear_pointwise", "linear_prepacked",
                "matmul_nbits", "embedding", "gguf_linear", "gguf_linear_exact", "gguf_dequant",
                "int8_linear", "dequant_int4", "dequant_int8"),
    "attention math": ("bmm", "baddbmm", "_softmax", "softmax", "scaled_dot_product_attention",
                       "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
                       "masked_fill_", "masked_fill", "paged_attention"),
    "KV gather / write": ("index_select", "index_copy_", "index_copy", "index", "gather", "index_put_", "take"),
    "copies, conversions": ("copy_", "to", "_to_copy", "clone", "contiguous", "cat", "stack", "empty_like",
                            "empty", "empty_strided", "zeros", "fill_", "zero_", "resize_", "set_"),
    "elementwise": ("mul", "mul_", "add", "add_", "sub", "neg", "silu", "rms_norm", "_fused_rms_norm", "rsqrt",
                    "pow", "mean", "cos", "sin", "div", "div_", "silu_and_mul", "where", "addcmul_", "float",
                    "add_rms_norm", "rotary"),
    "sampling": ("argmax", "topk", "sort", "multinomial", "log_softmax", "_log_softmax", "exponential_", "max",
                 "cumsum", "amax", "logsumexp"),
}
OUTSIDE = "outside torch ops"


def op_class(name: str) -> str:
    short = name.split("::")[-1]
    for cls, names in OP_CLASSES.items():
        if short in names:
            return cls
    return "other ops"


def profile_batch(engine, prompts: list[list[int]], steps: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = decode_ready(engine, prompts, max_tokens=lasting_max_tokens(engine, prompts))
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - start) / steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            profiled_s = time.perf_counter() - start
    finally:
        for rid in ids:
            engine.abort(rid)
    ops = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()
           if not e.key.startswith("ProfilerStep")]
    classes: dict[str, float] = defaultdict(float)
    for name, seconds, _ in ops:
        classes[op_class(name)] += seconds
    in_ops = sum(classes.values())
    classes[OUTSIDE] = max(0.0, profiled_s - in_ops)
    total = sum(classes.values())
    ops.sort(key=lambda op: -op[1])
    return {"batch": len(prompts), "steps": steps, "step_ms": step_s * 1000, "tok_s": len(prompts) / step_s,
            "profiled_step_ms": profiled_s * 1000 / steps, "threads": torch.get_num_threads(),
            "shares": {cls: seconds / total for cls, seconds in sorted(classes.items(), key=lambda c: -c[1])},
            "top_ops": [{"op": name, "class": op_class(name), "ms_per_step": seconds * 1000 / steps,
                         "calls_per_step": count / steps, "share": seconds / total}
                        for name, seconds, count in ops[:top]]}


def run_profile(args: argparse.Namespace) -> dict:
    from kvforge.core.cpu import describe_cpu

    batches = int_list(args.batches, "batches")
    path = checked_model(args, ("steps", "top"))
    use_threads(args.threads)
    engine = bench_engine(model=args.model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False)
    try:
        messages = chat_messages(max(batches))
        prompts = [engine.tokenizer.apply_chat_template(m) for m in messages]
        decode_ready(engine, prompts[:1], max_tokens=2)  # warm-up: first calls, allocations
        while engine.has_unfinished():
            engine.step()
        report = {"model": path.name, "dtype": args.dtype, "cpu": describe_cpu(),
                  "kernels": engine.runtime().kernel_choices,
                  "batches": [profile_batch(engine, prompts[:b], args.steps, args.top) for b in batches]}
    finally:
        engine.close()
    emit(report, args.json, print_report)
    return report


def print_report(report: dict) -> None:
    print(f"model {report['model']}; dtype {report['dtype']}; {report['cpu']}")
    for b in report["batches"]:
        print(f"\n== batch {b['batch']}: decode step {b['step_ms']:.1f} ms ({b['tok_s']:.1f} tok/s), "
              f"{b['profiled_step_ms']:.1f} ms under the profiler; {b['threads']} threads ==")
        for cls, share in b["shares"].items():
            print(f"  {cls:<22} {share * 100:5.1f}%")
        print(f"  {'top ops (own time)':<40} {'ms/step':>8} {'calls/step':>10} {'share':>6}")
        for op in b["top_ops"]:
            print(f"  {op['op'][:40]:<40} {op['ms_per_step']:>8.2f} {op['calls_per_step']:>10.0f} "
                  f"{op['share'] * 100:>5.1f}%")
    print(f"\n(shares of the profiled steps' time; '{OUTSIDE}': the Python around the ops and the profiler's cost)")


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `profile` on the `kvforge bench` subcommands."""
    parser = bench_parser(bench_sub, "profile", "where a decode step's time goes (torch.profiler) at each batch "
                          "size", run_profile, threads_help="CPU threads (default: torch's)")
    parser.add_argument("--batches", default="1,64", help="sequences decoding together (default: 1,64)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled "
                        "(default: 20)")
    parser.add_argument("--top", type=int, default=12, help="the ops with the most own time listed (default: 12)")
    return parser
