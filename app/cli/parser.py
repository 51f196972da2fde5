"""The `kvforge` argparse tree. The flags of `serve` (and the engine flags of `generate` / `chat`) come
from the settings' declarations (app/settings.py): a flag not given parses as None, and resolve() fills in
the environment, the settings file and the defaults."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from kvforge.app.cli.plugins import cmd_plugins
from kvforge.app.cli.repl import cmd_chat, cmd_generate
from kvforge.app.cli.serve import cmd_serve
from kvforge.app.settings import DEFAULTS, SETTINGS
from kvforge.core.sampling import SamplingParams


def add_setting_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """One flag per setting: --<name with dashes>, its type, choices and help as declared."""
    for name in names:
        declared = SETTINGS[name]
        flag, help_text = "--" + name.replace("_", "-"), declared.flag_help(DEFAULTS[name])
        if declared.kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(flag, type=declared.arg_type or (None if declared.kind is str else declared.kind),
                                default=None, choices=declared.choices, metavar=declared.metavar, help=help_text)


def add_sampling_flags(parser: argparse.ArgumentParser, temperature: float) -> None:
    """generate / chat: SamplingParams' fields and defaults (the temperature is the verb's own)."""
    default = SamplingParams.default
    parser.add_argument("--max-tokens", type=int, default=default("max_tokens"),
                        help=f"tokens to generate at most (default: {default('max_tokens')})")
    parser.add_argument("--temperature", type=float, default=temperature,
                        help=f"0 = greedy (default: {temperature})")
    parser.add_argument("--seed", type=int, default=default("seed"), help="sampling seed")
    parser.add_argument("--top-p", type=float, default=default("top_p"),
                        help=f"nucleus sampling mass (default: {default('top_p'):g} = off)")
    parser.add_argument("--top-k", type=int, default=default("top_k"),
                        help=f"sample among the k likeliest (default: {default('top_k')} = off)")
    parser.add_argument("--min-p", type=float, default=default("min_p"),
                        help="drop tokens below min_p x the top probability")
    parser.add_argument("--repetition-penalty", type=float, default=default("repetition_penalty"),
                        help="> 1 discourages repeats")
    parser.add_argument("--stop", action="append", default=default("stop"), help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description="A workstation chat server for local LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible REST server (default http://127.0.0.1:8000/v1)",
                           description="Settings come from flags, then KVFORGE_<NAME> environment variables, "
                           "then a TOML file (--config / KVFORGE_CONFIG), then defaults.")
    serve.add_argument("--config", default=None, help="TOML settings file (keys = flag names with underscores)")
    add_setting_flags(serve, SETTINGS)
    serve.set_defaults(func=cmd_serve)

    engine_flags = [name for name, declared in SETTINGS.items() if declared.shared]
    gen = sub.add_parser("generate", help="complete one prompt and stream the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_setting_flags(gen, engine_flags)
    add_sampling_flags(gen, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streamed")
    chat.add_argument("--system", default=None, help="system prompt")
    add_setting_flags(chat, engine_flags)
    add_sampling_flags(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks against HF transformers, measured in the same run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from kvforge.app.bench import add_parsers as add_bench_parsers
    from kvforge.app.cli.cache import add_parser as add_cache

    add_bench_parsers(bench_sub)
    add_cache(sub)
    from kvforge.app.quantize import add_parser as add_quantize

    add_quantize(sub)
    from kvforge.app.models.catalog import add_parser as add_models

    add_models(sub)
    from kvforge.app.models.pull import add_parser as add_pull

    add_pull(sub)

    plugins = sub.add_parser("plugins", help="list installed quantization and decoding plugins")
    plugins.set_defaults(func=cmd_plugins)
    return parser
