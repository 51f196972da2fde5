"""`kvforge bench structured`: what a JSON-schema constraint costs. The same chat prompts decoded greedily with
and without a constraint, at each batch size, in alternating rounds on one engine; then sampled outputs under
a schema, checked against it.

The timed constraint never lets an output end (an array of at least 1000 objects), so both runs decode the
same number of steps at the same batch size and their tok/s compare the step alone: the mask computation
(llguidance, on the engine thread) and its application in the sampler.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvforge.app.bench.arguments import bench_parser, checked_model, int_list, use_threads
from kvforge.app.bench.report import emit, fmt
from kvforge.app.bench.runs import bench_engine, run_batch, warm_up
from kvforge.app.bench.workloads import chat_messages

ENDLESS_RECORDS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                     "city": {"type": "string", "maxLength": 40}, "member": {"type": "boolean"}},
    "required": ["name", "age", "city", "member"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


def _validator():
    """jsonschema's check when it is installed (the test extras have it), else JSON parsing alone."""
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema.Draft202012Validator(PERSON)


def validity(engine, prompts: list[list[int]], max_tokens: int, seed: int) -> dict:
    """Sampled outputs (temperature 1) under the PERSON schema: how many finished, how many validate."""
    from kvforge.core import SamplingParams
    from kvforge.core.constraint import Constraint

    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                            constraint=Constraint.json_schema(PERSON))
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    validator, finished, valid = _validator(), 0, 0
    for rid in ids:
        out = finals[rid]
        if out.finish_reason != "stop":
            continue
        finished += 1
        try:
            value = json.loads(out.text)
            if validator is not None:
                validator.validate(value)
            valid += 1
        except ValueError:
            pass
        except Exception as exc:  # jsonschema.ValidationError
            if type(exc).__name__ != "ValidationError":
                raise
    return {"requests": len(ids), "finished": finished, "valid": valid,
            "checked_with": "jsonschema" if validator is not None else "json.loads (pip install jsonschema)"}


def run_structured(args: argparse.Namespace) -> dict:
    from kvforge.core.constraint import Constraint
    from kvforge.core.tokenizer import Tokenizer

    batch_sizes = int_list(args.batch_sizes, "batch-sizes", "batch sizes")
    path = checked_model(args, ("output_len", "rounds", "validity_requests"))
    use_threads(args.threads)
    tokenizer = Tokenizer(path)
    prompts = [tokenizer.apply_chat_template(m) for m in chat_messages(max(*batch_sizes, args.validity_requests))]
    # args.model itself, not the resolved path: a GGUF (the embedded default) is then served as `serve` does
    engine = bench_engine(model=args.model, dtype=args.dtype, max_num_seqs=max(batch_sizes))
    constraint = Constraint.json_schema(ENDLESS_RECORDS)
    try:
        engine.compile_constraint(constraint)
        warm_up(engine, prompts[0][-8:], ignore_eos=True)
        rows = []
        for size in batch_sizes:
            best = {"free": 0.0, "constrained": 0.0}
            for _ in range(args.rounds):  # alternating: a shared machine's drift hits both alike
                for kind in best:
                    run = run_batch(engine, prompts[:size], args.output_len,
                                    constraint=constraint if kind == "constrained" else None)
                    best[kind] = max(best[kind], run["decode_tok_s"] or 0.0)
            rows.append({"batch_size": size, "free_decode_tok_s": best["free"],
                         "constrained_decode_tok_s": best["constrained"],
                         "constrained_vs_free": best["constrained"] / best["free"] if best["free"] else None})
        checked = validity(engine, prompts[:args.validity_requests], 160, args.seed)
    finally:
        engine.close()
    result = {"model": engine.model_path.name, "quant": engine.config.quant, "dtype": args.dtype,
              "threads": torch.get_num_threads(),
              "output_len": args.output_len, "rounds": args.rounds, "batches": rows, "validity": checked}
    emit(result, args.json, _print_structured)
    return result


def _print_structured(r: dict) -> None:
    print(f"model {r['model']} (quant {r['quant']}); dtype {r['dtype']}; {r['threads']} threads; greedy, "
          f"{r['output_len']} tokens per request; best of {r['rounds']} alternating rounds; constraint: a JSON "
          "schema (array of records)")
    print(f"{'batch':>5}  {'free tok/s':>10}  {'constrained tok/s':>17}  {'constrained / free':>18}")
    for row in r["batches"]:
        print(f"{row['batch_size']:>5}  {row['free_decode_tok_s']:>10.1f}  {row['constrained_decode_tok_s']:>17.1f}  "
              f"{fmt(row['constrained_vs_free'], '.3f'):>18}")
    v = r["validity"]
    print(f"validity: {v['valid']} of {v['finished']} finished outputs valid ({v['requests']} sampled requests at "
          f"temperature 1; checked with {v['checked_with']})")


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `structured` on the `kvforge bench` subcommands."""
    parser = bench_parser(bench_sub, "structured", "decode tok/s with and without a JSON-schema constraint",
                          run_structured)
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens decoded per request (default: 64)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each is kept")
    parser.add_argument("--validity-requests", type=int, default=16, help="sampled requests checked for validity")
    parser.add_argument("--seed", type=int, default=0)
    return parser
