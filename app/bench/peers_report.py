"""`kvforge bench peers`' rows (one per engine and batch, with the same-run ratios) and its printed table."""

from __future__ import annotations

from kvforge.app.bench.peer_engines import EngineRun
from kvforge.app.bench.report import fmt, ms, percentile

REFERENCES = {"vs_hf": "hf-fp32", "vs_vllm_bf16": "vllm-bf16", "vs_llama_cpp": "llama.cpp"}
RATIO_TITLES = {"vs_hf": "vs HF", "vs_vllm_bf16": "vs vLLM bf16", "vs_llama_cpp": "vs llama.cpp"}

def measurement_rows(runs: list[EngineRun], output_tokens: int, prompt_lens: list[int]) -> list[dict]:
    """One row per engine and batch measured, with the ratios against the reference engines' rows of the same
    batch in this run."""
    rows = []
    for run in runs:
        for m in run.measurements:
            if "skipped" in m:
                continue
            ttft, tpot = m.get("ttft_s"), m.get("tpot_s")
            rows.append({
                "engine": run.engine.name, "kind": run.engine.kind, "dtype": run.engine.dtype, "batch": m["batch"],
                "requests": m["requests"], "waves": m["requests"] // m["batch"], "output_tokens": output_tokens,
                "prompt_tokens": m["prompt_tokens"] if m.get("prompt_tokens") is not None
                else sum(prompt_lens[:m["requests"]]), "generated_tokens": m["generated_tokens"],
                "wall_s": m["wall_s"], "output_tok_s": m["generated_tokens"] / m["wall_s"],
                "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)} if ttft else None,
                "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)} if tpot else None,
                "timing": m.get("timing")})
    by_key = {(r["engine"], r["batch"]): r for r in rows}
    for r in rows:
        for key, ref_name in REFERENCES.items():
            ref = by_key.get((ref_name, r["batch"]))
            r[key] = r["output_tok_s"] / ref["output_tok_s"] if ref else None
    return rows


def engine_summary(rounds: list[list[EngineRun]], rows: list[dict], roofline_tok_s: float | None) -> list[dict]:
    """Per engine that ran: its load time and memory (the worker's process tree: resident after load, the peak; the
    medians over the rounds, the peak their largest), its batch-1 decode rate (1 / TPOT p50 of the batch-1 row;
    its output tok/s where TPOT is unknown) and that as a fraction of the roofline (--shape), and its output tok/s
    per batch (the rows': medians over the rounds)."""
    by_engine: dict[str, list[EngineRun]] = {}
    for runs in rounds:
        for run in runs:
            if run.status != "skipped":
                by_engine.setdefault(run.engine.name, []).append(run)
    summary = []
    for name, runs in by_engine.items():
        def median(key: str, runs: list[EngineRun] = runs):
            known = [r.info[key] for r in runs if r.info.get(key) is not None]
            return percentile(known, 50) if known else None

        peaks = [r.info["peak_rss_bytes"] for r in runs if r.info.get("peak_rss_bytes") is not None]
        mine = {r["batch"]: r for r in rows if r["engine"] == name}
        one = mine.get(1)
        tpot = (one or {}).get("tpot_s") or {}
        decode = 1 / tpot["p50"] if tpot.get("p50") else (one["output_tok_s"] if one else None)
        summary.append({
            "engine": name, "status": "ok" if any(r.status == "ok" for r in runs) else "failed",
            "load_s": median("load_s"), "ready_s": median("ready_s"),
            "rss_after_load_bytes": median("rss_bytes_after_load"),
            "rss_anon_after_load_bytes": median("rss_anon_bytes_after_load"),
            "peak_rss_bytes": max(peaks) if peaks else None, "processes": median("processes_end"),
            "decode_tok_s_batch_1": decode, "decode_from": "1 / TPOT p50" if tpot.get("p50") else "output tok/s",
            "of_roofline": decode / roofline_tok_s if decode and roofline_tok_s else None,
            "output_tok_s": {str(b): r["output_tok_s"] for b, r in sorted(mine.items())}})
    return summary


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One row per engine and batch from each round's rows: tok/s, TTFT and TPOT the medians over the rounds that
    measured it, each ratio the median of the rounds' own same-run ratios; `rounds_tok_s` and `rounds_<ratio>` keep
    every round's figure. One round: its rows, as they are."""
    if len(rounds) == 1:
        return rounds[0]
    grouped: dict[tuple[str, int], list[dict]] = {}
    for rows in rounds:
        for row in rows:
            grouped.setdefault((row["engine"], row["batch"]), []).append(row)
    merged = []
    for rows in grouped.values():
        row = dict(rows[0])
        row["output_tok_s"] = percentile([r["output_tok_s"] for r in rows], 50)
        row["wall_s"] = percentile([r["wall_s"] for r in rows], 50)
        row["rounds_tok_s"] = [r["output_tok_s"] for r in rows]
        for stat in ("ttft_s", "tpot_s"):
            known = [r[stat] for r in rows if r[stat]]
            row[stat] = {q: percentile([s[q] for s in known], 50) for q in ("p50", "p99")} if known else None
        for key in REFERENCES:
            ratios = [r[key] for r in rows if r[key] is not None]
            row[key] = percentile(ratios, 50) if ratios else None
            row[f"rounds_{key}"] = ratios
        merged.append(row)
    return merged


def print_report(report: dict) -> None:
    cpu, o, p = report["cpu"], report["options"], report["prompts"]
    http = o.get("http")
    if http:
        print(f"kvforge bench peers --http: {report['model']}; greedy, {o['output_tokens']} output tokens per "
              "request (EOS ignored), prefix caching off; each engine's OpenAI-compatible server a subprocess of "
              "its own, one after another, streamed chat requests")
    else:
        print(f"kvforge bench peers: {report['model']}; greedy, {o['output_tokens']} output tokens per request "
              f"(EOS ignored), prefix caching off; each engine in its own process, one after another")
    family = (f", family {cpu['family']} model {cpu['model_number']} stepping {cpu['stepping']}"
              if cpu.get("family") is not None else "")
    print(f"CPU: {cpu['model']} ({cpu['machine']}{family}); ISA: {' '.join(cpu['isa']) or 'no AVX2'}; "
          f"{cpu['usable_cpus']} of {cpu['logical_cpus']} logical CPUs usable; {o['threads']} "
          f"thread{'s' if o['threads'] > 1 else ''} per engine"
          + (f" (vLLM bound to CPU ids {o['vllm_cpus']})" if o.get("vllm_cpus") else ""))
    shape = report.get("shape")
    if shape:
        bw, step = shape["bandwidth"], shape["decode_step"]
        print(f"shape {shape['shape']}: {shape['description']}; {shape['quant'].upper()} GGUF of "
              f"{shape['gguf_bytes'] / GIB:.2f} GiB" + (f"; the dense engines its bf16 twin {shape['twin']}"
                                                         if shape.get("twin") else ""))
        print(f"streaming-read bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s ({bw['how']}); a decode step reads "
              f"{step['bytes'] / 1e9:.2f} GB of the GGUF ({step['tensors']} weight tensors, head {step['head']}"
              + (f", {step['experts']} experts a layer" if step.get("experts") else "")
              + f"): roofline {shape['roofline_tok_s']:.1f} tok/s at batch 1")
    if http:
        gen = o["load_generator"]
        print(f"load generator: {gen['description']}" + (f" ({gen['why']})" if gen.get("why") else ""))
    if http and p.get("source") == "random":
        print(f"prompts: random, {p['input_tokens']} tokens each (vllm bench serve --dataset-name random --seed "
              f"{p['seed']}: the same for every server; the server's chat template adds its own); at concurrency C "
              f"ceil({o['prompts']} / C) * C of them, at most C in flight")
    elif http:
        print(f"prompts: {p['count']} chat prompts, the same messages for every server ({p['min_tokens']}-"
              f"{p['max_tokens']} tokens with kvforge's chat template, mean {p['mean_tokens']:.0f}); at concurrency"
              f" C the first ceil({o['prompts']} / C) * C of them, at most C in flight")
    else:
        print(f"prompts: {p['count']} chat prompts, the same token ids for every engine ({p['min_tokens']}-"
              f"{p['max_tokens']} tokens, mean {p['mean_tokens']:.0f}); at batch B the first "
              f"ceil({o['prompts']} / B) * B of them, in waves of B submitted at once")
    print("engines:")
    for e in report["engines"]:
        name = e["engine"] + (f" #{e['round']}" if o.get("rounds", 1) > 1 else "")
        line = f"  {name:<15} {e['status']:<8}"
        if e["status"] == "skipped":
            line += f" {e['why']}"
        else:
            line += f" {fmt(e['seconds'], '.0f')} s"
            line += (f" ({'up' if http else 'load'} {e['info']['load_s']:.0f} s)"
                     if e["info"].get("load_s") is not None else "")
            line += f"; {e['info']['library']}" if e["info"].get("library") else ""
            line += f"; {e['why']}" if e["why"] else ""
        print(line)
        for batch, why in e["skipped_batches"].items():
            print(f"  {'':<15} {'':<8} batch {batch} skipped: {why}")
    rows = report["rows"]
    level = "concurrency" if http else "batch"
    for batch in o["batches"]:
        here = [r for r in rows if r["batch"] == batch]
        requests = report["requests_per_batch"][str(batch)]
        if http:
            how = "one at a time" if batch == 1 else f"at most {batch} in flight"
        else:
            how = "one at a time" if batch == 1 else f"in waves of {batch} submitted at once"
        print(f"\n== {level} {batch}: {requests} requests {how} ==")
        if not here:
            print(f"(no engine measured this {level})")
            continue
        ratios = [k for k in REFERENCES if any(r[k] is not None for r in here)]
        header = (f"{'engine':<15} {'tok/s':>8} {'TTFT p50':>10} {'TPOT p50':>10}"
                  + "".join(f" {RATIO_TITLES[k]:>13}" for k in ratios))
        print(header)
        print("-" * len(header))
        for r in here:
            print(f"{r['engine']:<15} {r['output_tok_s']:>8.1f} {p50_ms(r['ttft_s']):>10} {p50_ms(r['tpot_s']):>10}"
                  + "".join(f" {fmt(r[k], '.2f', '-') + ('x' if r[k] is not None else ''):>13}" for k in ratios))
        if o.get("rounds", 1) > 1:
            print(f"medians of {o['rounds']} rounds; each round's tok/s" + "".join(
                f", {RATIO_TITLES[k]}" for k in ratios) + ":")
            for r in here:
                print(f"  {r['engine']:<15} " + " / ".join(f"{v:.1f}" for v in r["rounds_tok_s"]) + "".join(
                    "; " + " / ".join(f"{v:.2f}x" for v in r[f"rounds_{k}"]) for k in ratios if r[f"rounds_{k}"]))
    if report.get("summary") and not http:
        print_summary(report["summary"], o["batches"], shape is not None)
    timings = {}
    for r in rows:
        timings.setdefault(r["kind"], r["timing"])
    if http and rows:
        print(f"\nTTFT / TPOT in ms, p50 over the requests, measured by the load generator: {rows[0]['timing']}")
    elif timings:
        print("\nTTFT / TPOT in ms, p50 over the requests (\"-\": not measurable on that engine):")
        for kind, how in timings.items():
            print(f"  {kind}: {how}")
    failed = [e for e in report["engines"] if e["status"] == "failed"]
    for e in failed:
        print(f"\n{e['engine']} FAILED ({e['why']}); the tail of its stderr:")
        for line in (e["stderr_tail"] or "(empty)").splitlines():
            print(f"  | {line}")


GIB = 1 << 30


def print_summary(summary: list[dict], batches: list[int], roofline: bool) -> None:
    others = [b for b in batches if b != 1]
    header = (f"{'engine':<15} {'load s':>7} {'ready s':>8} {'RSS loaded':>11} {'peak RSS':>9} {'b1 decode':>10}"
              + (f" {'of roofline':>12}" if roofline else "") + "".join(f" {f'b{b} tok/s':>10}" for b in others))
    print("\nper engine: load time (the model, its library imported) and from the worker's start (ready: the "
          "library's import too); resident memory of its processes (GiB) once loaded and at the peak (kvforge's and "
          "vLLM's with their KV pool, --kv-cache-gb); batch-1 decode tok/s (1 / TPOT p50)"
          + (" and its fraction of the roofline" if roofline else "")
          + "; output tok/s per batch")
    print(header)
    print("-" * len(header))
    for e in summary:
        line = (f"{e['engine']:<15} {fmt(e['load_s'], '.1f', '-'):>7} {fmt(e.get('ready_s'), '.1f', '-'):>8} "
                f"{_gib(e['rss_after_load_bytes']):>11} "
                f"{_gib(e['peak_rss_bytes']):>9} {fmt(e['decode_tok_s_batch_1'], '.2f', '-'):>10}")
        if roofline:
            share = e["of_roofline"]
            line += f" {'-' if share is None else f'{100 * share:.0f}%':>12}"
        line += "".join(f" {fmt(e['output_tok_s'].get(str(b)), '.1f', '-'):>10}" for b in others)
        print(line)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def p50_ms(stat: dict | None) -> str:
    return "-" if not stat or stat.get("p50") is None else ms(stat["p50"])
