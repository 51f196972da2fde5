"""`kvforge generate` (one prompt) and `kvforge chat` (a conversation in the terminal), streamed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvforge.app.settings import resolve


def engine_from_flags(args: argparse.Namespace):
    """The engine the flags describe: generate and chat read no environment and no settings file."""
    from kvforge.app.models.factory import build_engine, spec_from_settings

    settings = resolve(args, environ={})
    return build_engine(spec_from_settings(settings), settings)


def sampling_params(args: argparse.Namespace):
    from kvforge.core import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop)


def stream(engine, prompt: Any, params, out=sys.stdout) -> str:
    """Run one request to the end, writing its text as it is generated."""
    request_id = engine.add_request(prompt, params)
    text = ""
    try:
        while engine.has_unfinished():
            for output in engine.step():
                if output.request_id == request_id:
                    out.write(output.delta_text)
                    out.flush()
                    text = output.text
    except KeyboardInterrupt:
        engine.abort(request_id)
        out.write(" [stopped]")
    out.write("\n")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    params, engine = sampling_params(args), engine_from_flags(args)  # bad sampling values fail before the model loads
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    try:
        stream(engine, prompt, params)
    finally:
        engine.close()  # queued KV writes; tensor-parallel ranks
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params, engine = sampling_params(args), engine_from_flags(args)  # bad sampling values fail before the model loads
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print("kvforge chat: type a message; /reset clears the conversation, /exit (or Ctrl-D) quits.")
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(system + history)
        try:
            reply = stream(engine, prompt, params)
        except ValueError as exc:  # e.g. the conversation outgrew the context: say so, keep going
            history.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})
