"""Turning measurements into what the benches print: percentiles, milliseconds, one JSON object or a table,
and `kvforge bench gpu`'s summary with its targets and verdicts."""

from __future__ import annotations

import json
from collections.abc import Callable

from kvforge.app.bench.references import TOP_K

TARGET_ROOFLINE = 0.70  # batch-1 decode: at least this share of the bandwidth roofline
TARGET_HF_RATIO = 10.0  # at the largest batch (256): at least this many times HF generate's output tok/s


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def p50_p99(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def ms(seconds: float | None, unit: str = "") -> str:
    """Seconds as milliseconds, e.g. "12.3" (with `unit`: "12.3 ms"); "n/a" for None."""
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}{unit}"


def fmt(value, spec: str = ".1f", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def error_line(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]


def emit(report, as_json: bool, print_table: Callable[[dict], None]) -> None:
    """A bench's result as one JSON object on stdout, or as its table."""
    if as_json:
        print(json.dumps(report))
    else:
        print_table(report)


# --- `kvforge bench gpu` ------------------------------------------------------------------------------


def _phase_time(results: list[dict], names: tuple[str, ...]) -> float:
    return sum(r["timings"].get(n, 0.0) for r in results for n in names)


def print_summary(report: dict) -> None:
    results = report["models"]
    parity_steps, throughput_steps = ("hf_parity_reference", "parity", "parity_graphs_off"), ("hf_throughput",
                                                                                              "throughput")
    print(f"\n== 2/5 parity with HF transformers ({report['options']['dtype']}; top-{TOP_K} logprob rule, first-token "
          f"|dlogprob| <= {report['options']['logprob_tol']}) [{_phase_time(results, parity_steps):.1f} s] ==")
    for r in results:
        on, off = r["parity"].get("graphs_on"), r["parity"].get("graphs_off")
        if on is None:
            print(f"{r['model']:<12} {_why_missing(r, ('hf_parity_reference', 'parity'))}")
            continue
        diff = on["first_token_max_abs_logprob_diff"]
        cells = "; ".join(f"len {p['prompt_len']}: {p['equal_prefix']}/{p['tokens']} equal"
                          + ("" if p["ok"] else " FAIL") for p in on["prompts"])
        print(f"{r['model']:<12} {on['verdict']} (graphs on), {off['verdict'] if off else 'n/a'} (graphs off); "
              f"first-token max |dlogprob| {fmt(diff, '.4f')}; {cells}")

    print(f"\n== 3/5 batch-1 decode vs the bandwidth roofline [{_phase_time(results, ('decode',)):.1f} s] ==")
    print(f"{'model':<12} {'weights GB':>10} {'GB/token':>9} {'tok/s':>9} {'roofline':>9} {'share':>7}  target")
    for r in results:
        d = r.get("decode")
        if not d:
            print(f"{r['model']:<12} {_why_missing(r, ('decode',))}")
            continue
        share = d["fraction_of_roofline"]
        verdict = "n/a" if share is None else ("PASS" if share >= TARGET_ROOFLINE else "MISS")
        print(f"{r['model']:<12} {d['weight_bytes'] / 1e9:>10.3f} {d['bytes_per_token'] / 1e9:>9.3f} "
              f"{d['tok_s']:>9.1f} {fmt(d['roofline_tok_s']):>9} {fmt(share and share * 100, '.1f'):>6}%  "
              f">= {TARGET_ROOFLINE:.0%}: {verdict}")

    print(f"\n== 4/5 throughput: N sequences at once, {report['options']['prompt_len']} prompt + "
          f"{report['options']['output_len']} output tokens, vs HF generate "
          f"[{_phase_time(results, throughput_steps):.1f} s] ==")
    print(f"{'model':<12} {'N':>5} {'kvforge tok/s':>14} {'HF tok/s':>10} {'ratio':>8}")
    for r in results:
        if not r["throughput"]:
            print(f"{r['model']:<12} {_why_missing(r, ('hf_throughput', 'throughput'))}")
        for n, row in sorted(r["throughput"].items(), key=lambda kv: int(kv[0])):
            kv, hf = row.get("kvforge"), row.get("hf")
            ratio = row.get("ratio")
            print(f"{r['model']:<12} {n:>5} {fmt(kv and kv['output_tok_s']):>14} "
                  f"{fmt(hf and hf['output_tok_s']):>10} {fmt(ratio, '.2f') + 'x' if ratio else 'n/a':>8}")

    graph_time = _phase_time(results, ("graphs_on", "graphs_off"))
    print(f"\n== 5/5 CUDA graphs on vs off: decode tok/s [{graph_time:.1f} s] ==")
    print(f"{'model':<12} {'N':>5} {'graphs on':>10} {'graphs off':>11} {'on/off':>8}  same greedy tokens")
    for r in results:
        on, off, same = r["graphs"]["on"], r["graphs"]["off"], r["graphs"]["same_tokens"]
        if not on and not off:
            print(f"{r['model']:<12} {_why_missing(r, ('graphs_on', 'graphs_off'))}")
        for n in sorted(set(on) | set(off), key=int):
            a, b = on.get(n), off.get(n)
            speedup = f"{a / b:.2f}x" if a and b else "n/a"
            print(f"{r['model']:<12} {n:>5} {fmt(a):>10} {fmt(b):>11} {speedup:>8}  {same.get(n, 'n/a')}")

    print("\n== timings per model (s) ==")
    for r in results:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items())
        print(f"{r['model']:<12} total {sum(r['timings'].values()):.1f}: {steps}")

    print("\n== targets ==")
    for line in report["targets"]:
        print(line)
    if report["failures"]:
        print("\n== failures ==")
        for line in report["failures"]:
            print(line)


def _why_missing(result: dict, names: tuple[str, ...]) -> str:
    for n in names:
        if n in result["errors"]:
            return f"ERROR in {n}: {result['errors'][n]}"
        if n in result["skipped"]:
            return f"skipped ({n}: {result['skipped'][n]})"
    if "process" in result["errors"]:
        return f"ERROR: {result['errors']['process']}"
    return "n/a"


def verdicts(report: dict) -> tuple[list[str], list[str]]:
    """The one-line verdict per target and model, and every failure."""
    smoke = " (smoke run on CPU: the figures mean nothing)" if report["options"]["smoke"] else ""
    largest = max(report["options"]["batches"])
    targets, failures = [], []
    for r in report["models"]:
        d = r.get("decode")
        share = d and d.get("fraction_of_roofline")
        targets.append(f"{r['model']:<12} batch-1 decode >= {TARGET_ROOFLINE:.0%} of roofline: "
                       + ("n/a" if share is None else f"{'PASS' if share >= TARGET_ROOFLINE else 'MISS'} "
                                                      f"({share:.1%}){smoke}"))
        ratio = r["throughput"].get(str(largest), {}).get("ratio")
        targets.append(f"{r['model']:<12} {largest}-sequence throughput >= {TARGET_HF_RATIO:.0f}x HF generate: "
                       + ("n/a" if ratio is None else f"{'PASS' if ratio >= TARGET_HF_RATIO else 'MISS'} "
                                                      f"({ratio:.2f}x){smoke}"))
        for step, error in r["errors"].items():
            failures.append(f"{r['model']}: {step}: {error}")
        for key, rep in r["parity"].items():
            if not rep["ok"]:
                failures.append(f"{r['model']}: parity ({key.replace('_', ' ')}) FAIL: "
                                + "; ".join(p["reason"] for p in rep["prompts"] if p["reason"])
                                + f" first-token max |dlogprob| {fmt(rep['first_token_max_abs_logprob_diff'], '.4f')}")
    for phase, error in report["errors"].items():
        failures.append(f"{phase}: {error}")
    return targets, failures
