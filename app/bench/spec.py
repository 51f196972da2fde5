"""`kvforge bench spec`: batch-1 decode speed without speculative decoding and with each proposer
configuration, on two kinds of task, greedy, in one run (machines are shared and noisy: only same-run
ratios mean anything).

- input-grounded: rewrite / fix / reformat a given text or code, so the answer copies much of its input
  (where prompt lookup, the `ngram` plugin, pays);
- open chat: open questions whose answers copy nothing.

The prompts ship in app/bench/spec_prompts.json and are rendered with the model's chat template. Each
configuration gets an engine of its own (freed before the next); each prompt runs alone, one after the
other, after one warm-up prompt. Decode tok/s is TPOT-based: generated tokens after the first, divided by
the time from the first token to the last (the request metrics' `tpot`), summed over the task's prompts
-- prefill is excluded. End-to-end tok/s (every generated token over the wall time, prefill included)
is in the JSON. Greedy speculation is lossless in exact arithmetic: every row's tokens should equal the
`none` row's ("same tokens"). In bf16 a verify forward over 1 + k tokens rounds differently from a
1-token one and can flip a near-tie, after which the outputs part: the column shows it.
"""

from __future__ import annotations

import argparse
import gc
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvforge.app.bench.arguments import add_model_options, checked_model, use_threads
from kvforge.app.bench.runs import SMALL_KV_BYTES, bench_engine, generate_one
from kvforge.app.bench.workloads import spec_prompts

TASKS = {"grounded": "input-grounded", "chat": "open chat"}


@dataclass
class Config:
    label: str  # as given: "none", "ngram k=8", "draft layers=10"
    decoding: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpecRow:
    config: str
    decoding: str
    options: dict[str, Any]
    task: str
    prompts: int
    generated_tokens: int
    decode_tok_s: float  # TPOT-based: (tokens - 1) / (last token time - first token time), summed over prompts
    e2e_tok_s: float  # every generated token over the wall time of the requests, prefill included
    speedup: float  # decode_tok_s over the `none` row's, same task, same run
    drafted_tokens: int
    accepted_tokens: int
    verify_steps: int
    acceptance_rate: float | None  # accepted / drafted (None: nothing drafted)
    mean_accepted_length: float | None  # tokens per verifying step: accepted drafts + the target's own
    same_tokens: bool  # every prompt's greedy tokens equal the `none` row's
    per_prompt: list[dict] = field(default_factory=list)
    baseline_runs: list[float] | None = None  # the `none` row: its first and last run (decode_tok_s: their mean)


def parse_config(spec: str) -> Config:
    """"PLUGIN [OPTION=VALUE ...]", e.g. "ngram k=8 min_n=1" or "draft layers=10"; values are read as JSON
    (numbers, true / false), else kept as strings (a path)."""
    words = spec.split()
    if not words:
        raise ValueError("--config: empty configuration")
    options = {}
    for word in words[1:]:
        key, sep, raw = word.partition("=")
        if not sep or not key:
            raise ValueError(f"--config {spec!r}: expected OPTION=VALUE, got {word!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return Config(" ".join(words), words[0], options)


def draft_model_config(path: str) -> Config:
    return Config(f"draft model={Path(path).name}", "draft", {"model": path})  # the row shows the name only


def default_configs(num_layers: int, draft_model: str | None) -> list[Config]:
    configs = [Config("ngram", "ngram"), Config("ngram k=4", "ngram", {"k": 4})]
    layers = max(1, num_layers // 3)
    configs.append(Config(f"draft layers={layers}", "draft", {"layers": layers}))
    if draft_model:
        configs.append(draft_model_config(draft_model))
    return configs


def _checked(args: argparse.Namespace):
    """Every argument checked before any model loads: the model path, prompts, tasks and configurations."""
    from kvforge.core.loader import load_config
    from kvforge.core.plugins import DECODING_GROUP, discover

    path = checked_model(args, ("max_tokens",))
    if args.prompts is not None and args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"--tasks: unknown task {unknown[0] if unknown else ''!r} (choose from {', '.join(TASKS)})")
    if args.config:
        configs = [parse_config(spec) for spec in args.config]
        if args.draft_model:
            configs.append(draft_model_config(args.draft_model))
    else:
        configs = default_configs(load_config(path).num_hidden_layers, args.draft_model)
    configs = [Config("none", "none")] + [c for c in configs if c.decoding != "none"]
    installed = discover(DECODING_GROUP).plugins
    for config in configs[1:]:
        if config.decoding not in installed:
            raise ValueError(f"--config {config.label!r}: decoding plugin {config.decoding!r} is not installed "
                             f"(installed: {', '.join(sorted(installed))})")
        options = installed[config.decoding].validate_options(config.options)  # bad options fail here, not mid-run
        if config.decoding == "draft" and bool(options["model"]) == bool(options["layers"]):
            raise ValueError(f"--config {config.label!r}: plugin 'draft' needs exactly one of model=PATH and "
                             "layers=N")
    return path, tasks, configs


def _run_task(engine, prompts: list[list[int]], params) -> tuple[list, dict]:
    """Each prompt alone, one after the other; the outputs and the engine's speculation counts for them."""
    before = engine.stats().as_dict()
    outs = [generate_one(engine, ids, params) for ids in prompts]
    after = engine.stats().as_dict()
    counts = {key: after[f"spec_{key}_total"] - before[f"spec_{key}_total"]
              for key in ("drafted_tokens", "accepted_tokens", "verify_steps")}
    return outs, counts


def measure(config: Config, args, path, task_prompts: dict[str, list[list[int]]],
            baseline: dict[str, list[list[int]]] | None) -> list[tuple[SpecRow, list[list[int]]]]:
    """One row per task, with each prompt's generated tokens."""
    from kvforge.core import SamplingParams

    engine = bench_engine(model=args.model, dtype=args.dtype, kv_cache_bytes=SMALL_KV_BYTES,
                          enable_prefix_caching=False, decoding=config.decoding, decoding_options=config.options,
                          num_threads=args.threads)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        first = next(iter(task_prompts.values()))[0]
        generate_one(engine, first, SamplingParams(temperature=0, max_tokens=min(args.max_tokens, 16)))  # warm-up
        rows = []
        for task, prompts in task_prompts.items():
            outs, counts = _run_task(engine, prompts, params)
            per_prompt = []
            for out in outs:
                m = out.metrics or {}
                per_prompt.append({"generated_tokens": len(out.token_ids), "tpot": m.get("tpot"),
                                   "e2e_latency": m["e2e_latency"], "finish_reason": out.finish_reason,
                                   "spec_acceptance_rate": m.get("spec_acceptance_rate"),
                                   "spec_mean_accepted_length": m.get("spec_mean_accepted_length")})
            decode_tokens = sum(p["generated_tokens"] - 1 for p in per_prompt if p["tpot"] is not None)
            decode_time = sum(p["tpot"] * (p["generated_tokens"] - 1) for p in per_prompt if p["tpot"] is not None)
            generated = sum(p["generated_tokens"] for p in per_prompt)
            drafted, accepted, steps = counts["drafted_tokens"], counts["accepted_tokens"], counts["verify_steps"]
            tokens = [list(out.token_ids) for out in outs]
            for i, p in enumerate(per_prompt):
                p["same_tokens"] = baseline is None or tokens[i] == baseline[task][i]
            same = all(p["same_tokens"] for p in per_prompt)
            rows.append((SpecRow(
                config.label, config.decoding, config.options, task, len(prompts), generated,
                decode_tokens / decode_time if decode_time > 0 else 0.0,
                generated / sum(p["e2e_latency"] for p in per_prompt), 1.0, drafted, accepted, steps,
                accepted / drafted if drafted else None, (accepted + steps) / steps if steps else None, same,
                per_prompt), tokens))
        return rows
    finally:
        engine.close()
        del engine
        gc.collect()


def run_spec(args: argparse.Namespace) -> list[SpecRow]:
    from kvforge.core.tokenizer import Tokenizer

    path, tasks, configs = _checked(args)
    use_threads(args.threads)
    tokenizer = Tokenizer(path)
    prompts = spec_prompts()
    task_prompts = {task: [tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}])
                           for p in prompts[task][:args.prompts]] for task in tasks}
    table = args.json != "-"  # JSON on stdout replaces the table; JSON into a file comes with it
    say = print if table else (lambda *a, **k: None)
    say(f"model {path.name} ({args.dtype}); batch 1, greedy, up to {args.max_tokens} tokens per prompt; "
        f"{', '.join(f'{TASKS[t]}: {len(p)} prompts' for t, p in task_prompts.items())}; "
        f"{torch.get_num_threads()} threads; decode tok/s = (tokens - 1) / (last - first token time)")
    width = max(22, *(len(c.label) for c in configs))
    rows: list[SpecRow] = []
    base: dict[str, SpecRow] = {}
    baseline: dict[str, list[list[int]]] | None = None
    names = {task: [p["name"] for p in prompts[task][:args.prompts]] for task in tasks}
    for config in configs + configs[:1]:  # `none` runs first and again last: its mean is the reference
        measured = measure(config, args, path, task_prompts, baseline)
        for row, _ in measured:
            for entry, name in zip(row.per_prompt, names[row.task]):
                entry["name"] = name
        if baseline is None:
            base = {row.task: row for row, _ in measured}
            baseline = {row.task: tokens for row, tokens in measured}
        elif config.decoding == "none":  # the second baseline run: drift on a shared machine averages out
            for row, _ in measured:
                first = base[row.task]
                first.baseline_runs = [first.decode_tok_s, row.decode_tok_s]
                first.decode_tok_s = sum(first.baseline_runs) / 2
            break
        rows.extend(row for row, _ in measured)
    for row in rows:
        reference = base[row.task].decode_tok_s
        row.speedup = row.decode_tok_s / reference if reference else 0.0
        if table:
            _print_row(row, first=row is rows[0], width=width)
    grounded = [row for row in rows if row.task == "grounded" and row.decoding == "ngram"]
    if grounded:
        best = max(grounded, key=lambda row: row.speedup)
        say(f"input-grounded, best ngram row: {best.config} at {best.speedup:.2f}x the `none` decode tok/s "
            f"(target >= 1.8x)")
    if not all(row.same_tokens for row in rows):
        say("WARNING: some rows' greedy tokens differ from the `none` row's (see `same tokens`)")
    if args.json:
        result = {"model": path.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                  "max_tokens": args.max_tokens, "tasks": {t: len(p) for t, p in task_prompts.items()},
                  "rows": [asdict(row) for row in rows]}
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return rows


def _print_row(row: SpecRow, first: bool, width: int = 22) -> None:
    if first:
        print(f"{'config':<{width}} {'task':<15} {'tokens':>6} {'decode tok/s':>12} {'vs none':>8} {'e2e tok/s':>9} "
              f"{'accept rate':>11} {'mean acc len':>12} {'same tokens':>11}")
    rate = f"{row.acceptance_rate:.2f}" if row.acceptance_rate is not None else "-"
    length = f"{row.mean_accepted_length:.2f}" if row.mean_accepted_length is not None else "-"
    print(f"{row.config:<{width}} {TASKS[row.task]:<15} {row.generated_tokens:>6} {row.decode_tok_s:>12.1f} "
          f"{row.speedup:>7.2f}x {row.e2e_tok_s:>9.1f} {rate:>11} {length:>12} "
          f"{'yes' if row.same_tokens else 'NO':>11}", flush=True)


def add_parser(bench_sub) -> None:
    spec = bench_sub.add_parser("spec", help="batch-1 decode tok/s with and without speculative decoding, "
                                             "on input-grounded and open-chat prompts")
    add_model_options(spec, model_help="the target model (default: the embedded one)")
    spec.add_argument("--config", action="append", default=None, metavar="SPEC",
                      help='a speculative configuration, "PLUGIN [OPTION=VALUE ...]" (e.g. "ngram k=8 min_n=1", '
                           '"draft layers=10"); repeatable. Default: ngram, ngram k=4, draft layers=<a third of '
                           'the target\'s layers>. The `none` baseline runs first and again last (the mean of '
                           'both is the reference)')
    spec.add_argument("--draft-model", default=None, metavar="PATH",
                      help="also a row drafting with this model (same tokenizer as the target)")
    spec.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    spec.add_argument("--prompts", type=int, default=None, help="prompts per task (default: all)")
    spec.add_argument("--max-tokens", type=int, default=128, help="generated tokens per prompt at most (default: 128)")
    spec.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                      help="also write one JSON object to PATH; with no PATH (or '-') print it to stdout instead "
                           "of the table")
    spec.add_argument("--threads", type=int, default=None)
    spec.set_defaults(func=lambda args: run_spec(args) and 0)
