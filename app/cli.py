"""The `kvforge` command line: generate, chat, bench, plugins."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default: float32)")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help=KV_CACHE_HELP)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV of equal prefixes")
    _plugin_args(parser, default="none")
    _tp_arg(parser)
    _device_args(parser)


KV_CACHE_HELP = ("KV cache budget in GiB (default: 1 on CPU; on a GPU what --gpu-memory-utilization leaves after "
                 "the weights and activations)")


def _device_args(parser: argparse.ArgumentParser) -> None:
    """Where the model runs and the GPU fast path's switches (defaults None: settings / EngineConfig decide)."""
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when a GPU is present)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of the GPU's memory kvforge may use: weights, activations and KV (default: 0.9)")
    parser.add_argument("--kernels", choices=("auto", "triton", "torch"), default=None,
                        help="Triton kernels or the torch ones (default auto: Triton on CUDA)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="no CUDA graphs: run every decode step eagerly")


def resolve_device(device: str | None) -> str:
    """--device: None / "auto" is cuda when torch sees a GPU, else cpu."""
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def tp_ranks(value: str) -> int:
    """--tp: an integer >= 1 (argparse names the flag in its error)."""
    try:
        ranks = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if ranks < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {ranks}")
    return ranks


def torchrun_world_size() -> int:
    """How many ranks torchrun started (1 when it did not start this process)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def check_tp(tp: int) -> int:
    """A tensor-parallel rank count from anywhere (flag, settings file, environment): >= 1, else an error
    naming --tp, raised before a model loads."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp (setting tp) must be an integer >= 1, got {tp!r}")
    return tp


def _tp_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=tp_ranks, default=None, metavar="N",
                        help="tensor-parallel ranks: N processes, each holding 1/N of the weights and KV heads "
                        "(default 1)")


def _plugin_args(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument("--quant", default=default, help="quantization plugin (see `kvforge plugins`; default: none, "
                        "or what a quantized checkpoint says)")
    parser.add_argument("--quant-options", default=None,
                        help='the plugin\'s options as JSON, e.g. \'{"kernel": "dequant"}\'')
    parser.add_argument("--decoding", default=default,
                        help="speculative decoding plugin, e.g. ngram or draft (see `kvforge plugins`; default: none)")
    parser.add_argument("--decoding-options", default=None,
                        help='the decoding plugin\'s options as JSON, e.g. \'{"k": 4}\' or '
                        '\'{"model": "path/to/draft"}\'')


def json_options(raw: str | dict | None, flag: str) -> dict:
    """A plugin's options flag (--quant-options, --decoding-options): a JSON object (or already a table,
    from a TOML settings file)."""
    if raw is None or isinstance(raw, dict):
        return dict(raw or {})
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def _sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    parser.add_argument("--temperature", type=float, default=temperature,
                        help=f"0 = greedy (default: {temperature})")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: 0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _engine(args: argparse.Namespace, quant: str | None = None, quant_options: dict | None = None,
            decoding: str | None = None, decoding_options: dict | None = None, **persist: Any):
    from kvforge.core import LLMEngine
    from kvforge.core.config import EngineConfig

    quant = quant or getattr(args, "quant", None) or "none"
    options = quant_options if quant_options is not None else options_of(args, "quant")
    from kvforge.app.models import check_decoding

    decoding = decoding or getattr(args, "decoding", None) or "none"
    if decoding_options is None:
        decoding_options = options_of(args, "decoding")
    check_decoding(decoding, decoding_options)  # an unknown plugin or a bad option fails before the model loads
    tp = getattr(args, "tp", None)
    tp = 1 if tp is None else tp
    if tp == 1 and torchrun_world_size() > 1:  # under torchrun every rank is a tensor-parallel rank
        tp = torchrun_world_size()
    check_tp(tp)
    gpu = {name: getattr(args, name) for name in ("gpu_memory_utilization", "kernels")
           if getattr(args, name, None) is not None}
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size, quant=quant,
                                  quant_options=options, decoding=decoding, decoding_options=decoding_options,
                                  kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)) if args.kv_cache_gb else None,
                                  num_threads=args.threads, enable_prefix_caching=not args.no_prefix_caching,
                                  tp_size=tp, device=resolve_device(getattr(args, "device", None)),
                                  cuda_graphs=not getattr(args, "enforce_eager", False), **gpu, **persist))


def options_of(args: argparse.Namespace, plugin: str) -> dict:
    """The parsed --quant-options / --decoding-options (`plugin`: "quant" or "decoding")."""
    return json_options(getattr(args, f"{plugin}_options", None), f"--{plugin}-options")


def _params(args: argparse.Namespace):
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
    params, engine = _params(args), _engine(args)  # bad sampling values fail before the model loads
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    try:
        stream(engine, prompt, params)
    finally:
        engine.close()  # queued KV writes; tensor-parallel ranks
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params, engine = _params(args), _engine(args)  # bad sampling values fail before the model loads
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


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def served_model_name(args: argparse.Namespace) -> str:
    from pathlib import Path

    from kvforge.core.loader import EMBEDDED_ALIASES, EMBEDDED_MODEL

    if args.served_model_name:
        return args.served_model_name
    if args.model in EMBEDDED_ALIASES:
        return EMBEDDED_MODEL
    return Path(args.model).stem if Path(args.model).exists() else args.model


def cmd_serve(args: argparse.Namespace) -> int:
    from kvforge.app.settings import resolve

    settings = resolve(args)
    check_tp(settings.tp)  # a bad tp from the settings file or KVFORGE_TP fails before anything starts
    if args.api_key is not None:
        print("kvforge: warning: --api-key on the command line is visible to other users (ps); set KVFORGE_API_KEY "
              "or use --api-key-file", file=sys.stderr, flush=True)
    args = argparse.Namespace(**{**vars(args), **vars(settings)})  # the resolved values drive everything below
    if not is_loopback(settings.host) and not settings.api_key:
        raise ValueError(f"refusing to bind {settings.host} without an API key: set KVFORGE_API_KEY or pass "
                         "--api-key-file, or bind 127.0.0.1")
    import asyncio
    from pathlib import Path

    import uvicorn

    from kvforge.app.access import AccessPolicy, split_list
    from kvforge.app.limits import connection_limits
    from kvforge.app.models import ModelHost, ModelSpec
    from kvforge.app.server import create_app
    from kvforge.core import AsyncEngine
    from kvforge.core.async_engine import build_off_main_thread
    from kvforge.core.private_files import private_dir
    from kvforge.core.store import Store, default_data_dir, default_db_url

    data_dir = private_dir(settings.data_dir if settings.data_dir else default_data_dir())
    db_url = settings.db or default_db_url(data_dir)
    store = Store.open(db_url)  # created (or upgraded) on first start
    persist = dict(persist_kv=not settings.no_persist_kv, data_dir=str(data_dir), db_url=db_url,
                   kv_disk_budget_bytes=int(settings.kv_disk_gb * (1 << 30)))

    def factory(spec: ModelSpec) -> AsyncEngine:
        args_for = argparse.Namespace(**{**vars(args), "model": spec.model, "dtype": spec.dtype, "tp": spec.tp,
                                         "kv_cache_gb": spec.kv_cache_gb or args.kv_cache_gb})
        return AsyncEngine(_engine(args_for, quant=spec.quant, quant_options=spec.quant_options,
                                   decoding=spec.decoding, decoding_options=spec.decoding_options, **persist),
                           on_fatal=stop_serving)

    fatal: list[str] = []

    def stop_serving(why: str) -> None:
        """A tensor-parallel rank died: say so, shut down (open streams have failed already), exit 1."""
        print(f"kvforge: error: {why}; shutting down", file=sys.stderr, flush=True)
        fatal.append(why)
        server.should_exit = True

    spec = ModelSpec(args.model, args.dtype, args.quant, options_of(args, "quant"), served_name=served_model_name(args),
                     decoding=args.decoding, decoding_options=options_of(args, "decoding"), tp=args.tp)
    first = build_off_main_thread(lambda: factory(spec))
    host = ModelHost(factory, spec, first, Path(args.models_dir).expanduser() if args.models_dir else None)
    access = AccessPolicy(settings.api_key, settings.host, split_list(settings.allowed_hosts),
                          split_list(settings.allowed_origins))
    app = create_app(host, max_pending=settings.max_pending, default_max_tokens=settings.default_max_tokens,
                     store=store, ui=not settings.no_ui, access=access, max_request_bytes=settings.max_request_bytes,
                     request_timeout_s=settings.request_timeout)

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM / Ctrl-C: end every open stream now (each gets its final chunk), then shut down
            if host.engine is not None:
                host.engine.abort_all()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            # Close engines (writing queued KV blocks to disk) here: uvicorn re-raises the signal after
            # serving, which would end the process before any code after server.run().
            await asyncio.to_thread(host.close)

    server = GracefulServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                           timeout_graceful_shutdown=5, **connection_limits(settings)))
    ui = "" if settings.no_ui else f"chat UI on http://{settings.host}:{settings.port}/, "
    print(f"kvforge: serving {spec.name}: {ui}API on http://{settings.host}:{settings.port}/v1 "
          f"(sessions: {store.engine.url.render_as_string()}; KV on disk: "
          f"{'off' if settings.no_persist_kv else data_dir / 'kv'}; {runs_on(first.engine)})", flush=True)
    del first  # the host owns it: a model swap must be able to free it
    try:
        server.run()
    finally:
        host.close()
    return 1 if fatal else 0


def runs_on(engine) -> str:
    """Where and how the engine runs, e.g. "cuda:0, bfloat16, Triton kernels, CUDA graphs, KV 61.2 GiB"."""
    runner = engine.runner
    parts = [str(runner.device), engine.config.dtype, f"{runner.kernels.capitalize()} kernels"]
    if runner.graphs is not None:
        parts.append("CUDA graphs")
    parts.append(f"KV {runner.kv_cache_bytes / (1 << 30):.2f} GiB")
    return ", ".join(parts)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvforge.app.bench import run_latency

    run_latency(args)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from kvforge.app.bench import run_throughput

    run_throughput(args)
    return 0


def describe_setting(schema: dict) -> str:
    """One line for a plugin option: its type, choices, default and description."""
    parts = [schema.get("type", "any")]
    if "enum" in schema:
        parts.append("one of " + " / ".join(map(str, schema["enum"])))
    if "default" in schema:
        parts.append(f"default {json.dumps(schema['default'])}")
    text = ", ".join(parts)
    return f"{text}: {schema['description']}" if schema.get("description") else text


def cmd_plugins(args: argparse.Namespace) -> int:
    from kvforge.core.plugins import DECODING_GROUP, QUANT_GROUP, discover

    for group in (QUANT_GROUP, DECODING_GROUP):
        registry = discover(group)
        print(f"{group}:")
        if not registry.plugins and not registry.errors:
            print("  (none installed)")
        for name, cls in sorted(registry.plugins.items()):
            devices = " / ".join(getattr(cls, "devices", ()) or ("any",))
            print(f"  {name:<12} {registry.sources[name]:<24} {getattr(cls, 'description', '')} [{devices}]")
            for option, schema in getattr(cls, "settings", {}).items():
                print(f"      {option}: {describe_setting(schema)}")
        for name, error in sorted(registry.errors.items()):
            print(f"  {name:<12} FAILED: {error}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description="A workstation chat server for local LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible REST server (default http://127.0.0.1:8000/v1)",
                           description="Settings come from flags, then KVFORGE_<NAME> environment variables, "
                           "then a TOML file (--config / KVFORGE_CONFIG), then defaults.")
    serve.add_argument("--config", default=None, help="TOML settings file (keys = flag names with underscores)")
    serve.add_argument("--host", default=None, help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="default: 8000")
    serve.add_argument("--api-key", default=None, help="required to bind any non-loopback address; with a key "
                       "every route but /health needs it (clients send 'Authorization: Bearer <key>', browsers log "
                       "in). Prefer KVFORGE_API_KEY or --api-key-file: a flag is visible to other users in ps")
    serve.add_argument("--api-key-file", default=None, help="read the API key from this file (its first line)")
    serve.add_argument("--allowed-hosts", default=None, help="comma-separated host names served besides "
                       "localhost, IP addresses and the bound host ('.example.com' covers subdomains; '*': any); "
                       "other Host headers get 403 (DNS rebinding)")
    serve.add_argument("--allowed-origins", default=None, help="comma-separated browser origins allowed to call the "
                       "API from their pages, e.g. http://localhost:3000 (patterns like http://localhost:*; '*': "
                       "any); default: none (no CORS)")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="larger request bodies get 413 before they are read (default: 4194304)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may generate before it is aborted and its KV freed (default: none)")
    serve.add_argument("--max-connections", type=int, default=None,
                       help="open connections before new requests get 503 (default: 1024)")
    serve.add_argument("--header-timeout", type=float, default=None,
                       help="seconds a connection may take to send a request head before it is closed (default: 10)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use")
    serve.add_argument("--max-pending", type=int, default=None, help="requests in flight before 503 (256)")
    serve.add_argument("--default-max-tokens", type=int, default=None, help="when a request sets none (512)")
    serve.add_argument("--log-level", default=None, help="uvicorn log level (info)")
    serve.add_argument("--models-dir", default=None, help="models the admin API may load (paths stay inside it)")
    serve.add_argument("--model", default=None,
                       help="HF model directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32)")
    serve.add_argument("--kv-cache-gb", type=float, default=None, help=KV_CACHE_HELP)
    serve.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: 16)")
    _plugin_args(serve, default=None)
    _tp_arg(serve)
    _device_args(serve)
    serve.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    serve.add_argument("--no-prefix-caching", action="store_true", default=None,
                       help="do not reuse KV of equal prefixes (turns the persisted tier off too)")
    serve.add_argument("--data-dir", default=None,
                       help="conversations (SQLite) and persisted KV files (default: the user data dir, "
                       "e.g. ~/.local/share/kvforge)")
    serve.add_argument("--db", default=None, help="SQLAlchemy URL of the session store, e.g. "
                       "postgresql+psycopg://user:pw@host/db (default: sqlite in --data-dir)")
    serve.add_argument("--no-persist-kv", action="store_true", default=None,
                       help="keep prefix KV in memory only (no disk tier)")
    serve.add_argument("--kv-disk-gb", type=float, default=None,
                       help="disk budget of the persisted KV in GiB, least recently used evicted (default: 2)")
    serve.add_argument("--no-ui", action="store_true", default=None, help="API only: no browser UI at /")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete one prompt and stream the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _engine_args(gen)
    _sampling_args(gen, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streamed")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_args(chat)
    _sampling_args(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks against HF transformers, measured in the same run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    latency = bench_sub.add_parser("latency", help="prefill tok/s and batch-1 decode tok/s")
    latency.add_argument("--model", default=None)
    latency.add_argument("--dtypes", default="float32,bfloat16", help="kvforge dtypes to measure")
    latency.add_argument("--prompt-tokens", type=int, default=256)
    latency.add_argument("--decode-tokens", type=int, default=64)
    latency.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is kept")
    latency.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    latency.add_argument("--threads", type=int, default=None, help="CPU threads in all (split among --tp ranks)")
    latency.add_argument("--tp", default="1", metavar="N[,N...]",
                         help="kvforge tensor-parallel rank counts to measure, e.g. 1,2 (default: 1)")
    latency.set_defaults(func=cmd_bench)
    throughput = bench_sub.add_parser(
        "throughput", help="output tok/s of many chat requests at once, against HF sequential and static batches")
    throughput.add_argument("--model", default=None)
    throughput.add_argument("--dtype", default="float32", help="kvforge and HF dtype (default: float32)")
    throughput.add_argument("--no-prefix-caching", action="store_true",
                            help="kvforge: no reuse of the shared system prompt's KV")
    throughput.add_argument("--num-requests", type=int, default=64, help="chat requests, submitted at once")
    throughput.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    throughput.add_argument("--max-num-seqs", type=int, default=64, help="kvforge: sequences in one step")
    throughput.add_argument("--max-num-batched-tokens", type=int, default=2048, help="kvforge: tokens in one step")
    throughput.add_argument("--kv-cache-gb", type=float, default=1.0, help="kvforge KV cache budget in GiB")
    throughput.add_argument("--hf-sequential-requests", type=int, default=4,
                            help="requests HF generates one at a time (default: 4)")
    throughput.add_argument("--hf-batch-size", type=int, default=16, help="HF static batch size (default: 16)")
    throughput.add_argument("--hf-batches", type=int, default=None,
                            help="HF static batches to run (default: all, covering every request)")
    throughput.add_argument("--no-hf", action="store_true", help="skip the HF transformers baselines")
    throughput.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    throughput.add_argument("--threads", type=int, default=None, help="CPU threads in all (split among --tp ranks)")
    throughput.add_argument("--tp", type=tp_ranks, default=1, metavar="N", help="kvforge tensor-parallel ranks")
    throughput.set_defaults(func=cmd_bench_throughput)
    from kvforge.app.bench_chat import add_parser as add_chat_bench
    from kvforge.app.bench_gpu import add_parser as add_gpu_bench
    from kvforge.app.bench_quant import add_parser as add_quant_bench
    from kvforge.app.bench_serve import add_parser as add_serve_bench
    from kvforge.app.bench_spec import add_parser as add_spec_bench
    from kvforge.app.cache import add_parser as add_cache

    add_serve_bench(bench_sub)
    add_chat_bench(bench_sub)
    add_quant_bench(bench_sub)
    add_spec_bench(bench_sub)
    add_gpu_bench(bench_sub)
    add_cache(sub)
    from kvforge.app.quantize import add_parser as add_quantize

    add_quantize(sub)

    plugins = sub.add_parser("plugins", help="list installed quantization and decoding plugins")
    plugins.set_defaults(func=cmd_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    if torchrun_world_size() > 1 and os.environ["RANK"] != "0":
        # a rank > 0 started by torchrun (multi-machine tensor parallelism): whatever the command line,
        # it serves rank 0's commands; rank 0 runs the command and sends it the model to load
        from kvforge.core.tp import worker_main

        worker_main()
        return 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from kvforge.core.loader import ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, ValueError) as exc:  # user errors: one clear line, no traceback
        print(f"kvforge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
