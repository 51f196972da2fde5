"""`kvforge bench defaults`: what a newcomer's first questions get at each sampling setting, and what the repetition
guard would save. Short factual chat questions (the README's "What is the capital of France?" among them), each
sampled with several seeds, at five settings measured in the same run on one engine:

  neutral    temperature 1, top-p 1 (SamplingParams' own: what a request got before model defaults)
  old-ui     temperature 0.7, top-p 1 (the browser UI's sliders before model defaults)
  low        temperature 0.2, top-p 0.9 (SmolLM2's model card)
  greedy     temperature 0 (every seed the same reply)
  model      the model's sampling defaults (core/generation_defaults.py; the embedded model's: greedy, chosen
             from this bench's figures)

Per setting: the share of replies that contain the expected fact, that end on their own (EOS), that run to
--max-tokens, that loop (the repetition guard would have ended them: it ends a reply without changing a token
before its loop, so running the guard over each reply's tokens says exactly where), the mean tokens per reply, and
the share of all generated tokens the guard would have saved.
"""

from __future__ import annotations

import argparse

import torch

from kvforge.app.bench.arguments import bench_parser, checked_model, use_threads
from kvforge.app.bench.report import emit
from kvforge.app.bench.runs import bench_engine

# (question, words any of which is the expected fact; empty: open-ended, not checked)
QUESTIONS = (
    ("What is the capital of France?", ("Paris",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the largest planet in our solar system?", ("Jupiter",)),
    ("What is the boiling point of water in degrees Celsius?", ("100",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("What is the chemical symbol for gold?", ("Au",)),
    ("Which ocean is the largest?", ("Pacific",)),
    ("What color do you get by mixing blue and yellow?", ("green", "Green")),
    ("Explain what a CPU does in one sentence.", ()),
    ("Give me one tip for learning Python.", ()),
)


def settings(engine) -> dict[str, dict]:
    return {"neutral": {"temperature": 1.0, "top_p": 1.0}, "old-ui": {"temperature": 0.7, "top_p": 1.0},
            "low": {"temperature": 0.2, "top_p": 0.9}, "greedy": {"temperature": 0.0},
            "model": dict(engine.generation_defaults.values)}


def first_loop(token_ids: list[int]) -> int | None:
    """Where the repetition guard ends these tokens (its count of tokens), or None."""
    from kvforge.core.repetition import RepetitionGuard

    guard = RepetitionGuard()
    return next((i for i, token in enumerate(token_ids, 1) if guard.looping(token)), None)


def run_setting(engine, prompts: list[list[int]], facts: list[tuple[str, ...]], sampling: dict, seeds: int,
                max_tokens: int) -> dict:
    from kvforge.core import SamplingParams

    ids = {}
    for seed in range(seeds):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(**{**sampling, "seed": seed, "max_tokens": max_tokens})
            ids[engine.add_request(prompt, params)] = i
    finals = {}
    while engine.has_unfinished():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    replies = [(facts[i], finals[rid]) for rid, i in ids.items()]
    checked = [(words, out) for words, out in replies if words]
    loops = [first_loop(out.token_ids) for _, out in replies]
    generated = sum(len(out.token_ids) for _, out in replies)
    saved = sum(len(out.token_ids) - at for (_, out), at in zip(replies, loops) if at is not None)
    n = len(replies)
    return {"sampling": sampling, "replies": n,
            "fact_found": sum(any(w in out.text for w in words) for words, out in checked) / len(checked),
            "ended_by_eos": sum(out.finish_reason == "stop" for _, out in replies) / n,
            "ran_to_max_tokens": sum(out.finish_reason == "length" for _, out in replies) / n,
            "looping": sum(at is not None for at in loops) / n,
            "mean_tokens": generated / n, "guard_saves_tokens": saved / generated if generated else 0.0}


def run_defaults(args: argparse.Namespace) -> dict:
    from kvforge.core.tokenizer import Tokenizer

    path = checked_model(args, ("seeds", "max_tokens", "questions"))
    use_threads(args.threads)
    tokenizer = Tokenizer(path)
    chosen = QUESTIONS[:args.questions]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in chosen]
    engine = bench_engine(model=args.model, dtype=args.dtype, max_num_seqs=len(prompts) * args.seeds)
    try:
        rows = {name: run_setting(engine, prompts, [facts for _, facts in chosen], sampling, args.seeds,
                                  args.max_tokens)
                for name, sampling in settings(engine).items()}
        source = engine.generation_defaults.source
    finally:
        engine.close()
    result = {"model": engine.model_path.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "questions": len(prompts), "seeds": args.seeds, "max_tokens": args.max_tokens,
              "model_defaults_source": source, "settings": rows}
    emit(result, args.json, _print_defaults)
    return result


def _print_defaults(r: dict) -> None:
    print(f"model {r['model']}; dtype {r['dtype']}; {r['threads']} threads; {r['questions']} questions x "
          f"{r['seeds']} seeds, up to {r['max_tokens']} tokens; model defaults from {r['model_defaults_source']}")
    print(f"{'setting':<8} {'sampling':<32} {'fact':>5} {'EOS':>5} {'max':>5} {'loops':>5} {'tokens':>7} "
          f"{'guard saves':>11}")
    for name, row in r["settings"].items():
        sampling = ", ".join(f"{k} {v:g}" for k, v in row["sampling"].items()) or "neutral"
        print(f"{name:<8} {sampling:<32} {row['fact_found']:>5.0%} {row['ended_by_eos']:>5.0%} "
              f"{row['ran_to_max_tokens']:>5.0%} {row['looping']:>5.0%} {row['mean_tokens']:>7.1f} "
              f"{row['guard_saves_tokens']:>11.0%}")


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `defaults` on the `kvforge bench` subcommands."""
    parser = bench_parser(bench_sub, "defaults", "newcomer questions at neutral, old-UI and the model's sampling "
                          "defaults: facts found, EOS vs max tokens, loops the repetition guard would end",
                          run_defaults)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS),
                        help=f"how many of the built-in questions (default: all {len(QUESTIONS)})")
    parser.add_argument("--seeds", type=int, default=4, help="samples per question and setting (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most (default: 256)")
    return parser
