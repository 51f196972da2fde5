"""Every `kvforge serve` setting, declared once: its default, type, help and bounds. From these
declarations come the command-line flags (app/cli/parser.py), the KVFORGE_* environment variables, the
TOML keys and their validation (resolve, highest first: flags, environment, TOML file, defaults). The
engine's knobs take their defaults from EngineConfig (core/config.py); `kvforge generate` / `chat` take
the settings marked `shared` as flags too.

TOML keys are the flag names with underscores, at the top level or under [serve]:
    port = 8080
    dtype = "bfloat16"
    models_dir = "~/models"
    decoding = "ngram"
    decoding_options = { k = 4 }
    tp = 2  # tensor-parallel ranks (--tp): 2 processes, each with half the weights and KV heads
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvforge.app.http.limits import DEFAULT_MAX_REQUEST_BYTES
from kvforge.app.models.keep_alive import parse_keep_alive
from kvforge.core.config import DECODE_ATTENTION, GGUF_WEIGHTS, KERNELS, KV_CACHE_DTYPES, LINEAR_KERNELS, engine_default

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

GIB = 1 << 30
CONTEXT_OVERFLOW = ("truncate", "error")  # --context-overflow: app/generate/context_fit.py


def tp_ranks(value: str) -> int:
    """--tp, --pp: an integer >= 1 (argparse names the flag in its error)."""
    try:
        ranks = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if ranks < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {ranks}")
    return ranks


def check_tp(tp: int, flag: str = "tp") -> int:
    """A tensor-parallel rank (or, flag "pp", pipeline stage) count from anywhere (flag, settings file, environment):
    >= 1, else an error naming the flag, raised before a model loads."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--{flag} (setting {flag}) must be an integer >= 1, got {tp!r}")
    return tp


def resolve_device(device: str | None) -> str:
    """--device: None / "auto" is cuda when torch sees a GPU, else cpu."""
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def one_of(*choices: str) -> Callable[[str, Any], None]:
    """A check of a setting with choices, wherever it comes from (argparse checks only the flag)."""
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"setting {name}: must be one of {', '.join(choices)}, got {value!r}")
    return check


def at_least(low: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value < low:
            raise ValueError(f"setting {name}: must be >= {low}, got {value}")
    return check


def keep_alive_seconds(value: str | float) -> float:
    """--keep-alive in seconds (math.inf: until room is needed); ValueError naming the setting."""
    try:
        return parse_keep_alive(float(value) if re.fullmatch(r"-?\d+(\.\d+)?", str(value)) else value)
    except ValueError as exc:
        raise ValueError(f"setting keep_alive: {exc}") from None


def positive(name: str, value: float | None) -> None:
    if value is not None and not (0 < value < float("inf")):
        raise ValueError(f"setting {name}: must be a number > 0, got {value}")


def seconds(name: str, value: float | None) -> None:
    if value is not None and not (0 < value < float("inf")):
        raise ValueError(f"setting {name}: must be a number of seconds > 0, got {value}")


@dataclass(frozen=True)
class Setting:
    """What a ServeSettings field's metadata holds: everything a flag, a variable or a TOML key needs."""

    help: str  # the flag's help; "{default}" stands for the default
    kind: type = str  # how a value from the environment or a TOML file converts; bool: an on/off flag
    check: Callable[[str, Any], None] | None = None  # raises ValueError (naming the setting) when out of bounds
    arg_type: Callable[[str], Any] | None = None  # argparse's type, when it is not `kind`
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    shared: bool = False  # also a flag of `kvforge generate` / `chat`: the engine is built from it
    engine: str | None = None  # the EngineConfig knob it sets (ModelSpec's fields are set by the spec)
    to_engine: Callable[[Any], Any] = lambda value: value

    def flag_help(self, default: Any) -> str:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        return self.help.replace("{default}", shown)


def setting(default: Any, help: str, kind: type = str, **declared: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(help, kind, **declared)})


def serve_default(name: str) -> Any:
    """The default of `kvforge serve`'s setting `name` (what the app's own defaults read: one declaration)."""
    return next(f.default for f in fields(ServeSettings) if f.name == name)


def engine_setting(default: Any, help: str, kind: type = str, **declared: Any) -> Any:
    """A setting of serve, generate and chat; `default`: read from EngineConfig (engine_default)."""
    return setting(default, help, kind, shared=True, **declared)


KV_CACHE_HELP = ("KV cache budget in GiB (default: 1 on CPU; on a GPU what --gpu-memory-utilization leaves after "
                 "the weights and activations)")
OPTIONS_HELP = "the plugin's options as JSON, e.g. '{\"kernel\": \"dequant\"}'"
DECODING_OPTIONS_HELP = "the decoding plugin's options as JSON, e.g. '{\"k\": 4}' or '{\"model\": \"path/to/draft\"}'"


@dataclass
class ServeSettings:
    host: str = setting("127.0.0.1", "bind address (default: {default})")
    port: int = setting(8000, "default: {default}", int)
    api_key: str | None = setting(  # better from KVFORGE_API_KEY or api_key_file: a flag is visible in `ps`
        None, "required to bind any non-loopback address; with a key every route but /health needs it (clients "
        "send 'Authorization: Bearer <key>', browsers log in). Prefer KVFORGE_API_KEY or --api-key-file: a flag "
        "is visible to other users in ps")
    api_key_file: str | None = setting(None, "read the API key from this file (its first line)")
    allowed_hosts: str | None = setting(  # comma-separated (a TOML list works too)
        None, "comma-separated host names served besides localhost, IP addresses and the bound host "
        "('.example.com' covers subdomains; '*': any); other Host headers get 403 (DNS rebinding)")
    allowed_origins: str | None = setting(
        None, "comma-separated browser origins allowed to call the API from their pages, e.g. "
        "http://localhost:3000 (patterns like http://localhost:*; '*': any); default: none (no CORS)")
    image_url_hosts: str | None = setting(
        None, "comma-separated host names whose http(s) image URLs the server fetches for a vision model's requests "
        "(exact names; redirects are not followed); default: none, a remote image URL is refused")
    max_request_bytes: int = setting(DEFAULT_MAX_REQUEST_BYTES, "larger request bodies get 413 before they are read "
                                     "(default: {default})", int, check=at_least(1))
    request_timeout: float | None = setting(None, "seconds a request may generate before it is aborted and its KV "
                                            "freed (default: none)", float, check=seconds)
    max_connections: int = setting(1024, "open connections before new requests get 503 (default: {default})", int,
                                   check=at_least(1))
    header_timeout: float = setting(10.0, "seconds a connection may take to send a request head before it is "
                                    "closed (default: {default})", float, check=seconds)
    served_model_name: str | None = setting(None, "the model id clients use")
    max_pending: int = setting(256, "requests in flight before 503 ({default})", int, check=at_least(1))
    default_max_tokens: int = setting(0, "when a request sets none; 0: what is left of the context, as OpenAI, vLLM "
                                      "and Ollama ({default})", int, check=at_least(0))
    context_overflow: str = setting(
        "truncate", "a chat longer than its context: truncate (leave out its oldest whole turns, keeping the system "
        "prompt and the newest turn; the response says so) or error (400 context_length_exceeded) (default: "
        "{default})", choices=CONTEXT_OVERFLOW, check=one_of(*CONTEXT_OVERFLOW))
    log_level: str = setting("info", "uvicorn log level ({default})")
    models_dir: str | None = setting(None, "models the admin API, the UI and requests naming them may load (paths "
                                     "stay inside it)")
    max_loaded_models: int = setting(3, "models resident at once, the server's own included: a request naming "
                                     "another model of --models-dir loads it, unloading the least recently used idle "
                                     "one beyond this (default: {default})", int, check=at_least(1))
    models_memory_gb: float | None = setting(None, "GiB the resident models' weights and KV pools may take together "
                                             "(default: no limit but --max-loaded-models)", float, check=positive)
    keep_alive: str = setting("5m", "how long a model loaded on demand stays loaded once idle: seconds or a duration "
                              "such as 30s, 5m, 1h; negative: until room is needed (default: {default}; a request's "
                              "Ollama keep_alive overrides it)", check=lambda name, value: keep_alive_seconds(value))
    embedding_model: str | None = setting(None, "a model of --models-dir that answers the embedding requests naming no "
                                          "model or the server's own (loaded on demand; default: the server's own "
                                          "model embeds)")
    model_aliases: str | None = setting(None, "names requests may use for models of --models-dir, as JSON, e.g. "
                                        "'{\"qwen\": \"Qwen2.5-0.5B-Instruct-Q4_K_M.gguf\"}' (a TOML table works "
                                        "too)")
    model_sampling: str | None = setting(
        None, "sampling defaults per model, over the model's own (generation_config.json or its family's), as JSON "
        "by model name, e.g. '{\"SmolLM2-135M-Instruct\": {\"temperature\": 0.3, \"top_p\": 0.9}}' (a TOML "
        "table [model_sampling.\"NAME\"] too); a request's own fields still win",
        check=lambda name, value: model_sampling_table(value))
    # what an engine is built from (flags of generate and chat too); ModelSpec takes the model-defining ones
    model: str | None = engine_setting(engine_default("model"), "HF model directory, .gguf file or hub id (default: "
                                       "the embedded SmolLM2-135M-Instruct)")
    dtype: str = engine_setting(engine_default("dtype"), "auto | float32 | bfloat16 | float16 (default: {default}: "
                                "bfloat16 where the CPU computes it natively (AVX512_BF16 / AMX) or on a GPU, "
                                "else float32)")
    kv_cache_gb: float | None = engine_setting(engine_default("kv_cache_bytes"), KV_CACHE_HELP, float)
    kv_cache_dtype: str = engine_setting(
        engine_default("kv_cache_dtype"), "how the KV cache stores K and V: auto (the model's dtype), int8, fp8_e4m3, "
        "fp8_e5m2 (8 bits: about half of bf16's bytes, twice the tokens) or q4 (4 bits: about 3.5x the tokens); "
        "llama.cpp's -ctk/-ctv q8_0 and q4_0, vLLM's --kv-cache-dtype fp8 (default: {default})",
        choices=KV_CACHE_DTYPES)
    block_size: int = engine_setting(engine_default("block_size"), "tokens per KV block (default: {default})", int,
                                     engine="block_size")
    gguf_dense: bool = engine_setting(engine_default("gguf_dense"), "load a .gguf model dequantized into dense "
                                      "weights, as transformers does, instead of from its own quantized blocks "
                                      "(the gguf quant plugin)", bool, engine="gguf_dense")
    gguf_weights: str = engine_setting(engine_default("gguf_weights"), "a .gguf model's blocks: mapped (served from "
                                       "the file's pages: shared, reclaimable) or copied (read once into memory on "
                                       "huge pages: faster decode, the whole file resident; llama.cpp's --no-mmap); "
                                       "auto: copied by one CPU process when the file takes at most 3/4 of the "
                                       "available memory (default: {default})", choices=GGUF_WEIGHTS,
                                       engine="gguf_weights")
    cpu_experts: bool = engine_setting(engine_default("cpu_experts"), "mixture-of-experts models: keep every "
                                       "expert's weights in host memory and compute them on the CPU (llama.cpp's "
                                       "--cpu-moe); the rest of the model stays on --device", bool)
    quant: str = engine_setting(  # a quantized checkpoint picks its own plugin when this is "none"
        engine_default("quant"), "quantization plugin (see `kvforge plugins`; default: {default}, or what a "
        "quantized checkpoint says)")
    quant_options: str | None = engine_setting(None, OPTIONS_HELP)  # JSON object (a TOML table works too)
    decoding: str = engine_setting(engine_default("decoding"), "speculative decoding plugin, e.g. ngram or draft "
                                   "(see `kvforge plugins`; default: {default})")
    decoding_options: str | None = engine_setting(None, DECODING_OPTIONS_HELP)  # JSON object (or a TOML table)
    tp: int = engine_setting(engine_default("tp_size"), "tensor-parallel ranks: N processes, each holding 1/N of the "
                             "weights and KV heads (default {default})", int, check=lambda _, tp: check_tp(tp),
                             arg_type=tp_ranks, metavar="N")
    pp: int = engine_setting(engine_default("pp_size"), "pipeline stages: N groups of --tp processes, each holding "
                             "consecutive layers and their KV, one step in flight per stage (default {default})", int,
                             check=lambda _, pp: check_tp(pp, "pp"), arg_type=tp_ranks, metavar="N")
    device: str | None = engine_setting(None, "cpu | cuda | cuda:N (default: cuda when a GPU is present)",
                                        engine="device", to_engine=resolve_device)
    gpu_memory_utilization: float = engine_setting(
        engine_default("gpu_memory_utilization"), "share of the GPU's memory kvforge may use: weights, activations "
        "and KV (default: {default})", float, engine="gpu_memory_utilization")
    kernels: str = engine_setting(engine_default("kernels"), "Triton kernels or the torch ones (default auto: Triton "
                                  "on CUDA)", choices=KERNELS, engine="kernels")
    linear_kernels: str = engine_setting(engine_default("linear_kernels"), "CPU matmul of dense linears: torch "
                                         "(F.linear), onednn (prepacked) or auto: the faster here, timed per shape "
                                         "at load and cached (default: {default})", choices=LINEAR_KERNELS,
                                         engine="linear_kernels")
    decode_attention: str = engine_setting(engine_default("decode_attention"), "CPU decode attention: bmm (fp32 "
                                           "batched matmuls), bmm-native (in the model dtype), sdpa (fused, in the "
                                           "model dtype) or auto: the faster here, timed at load and cached; in "
                                           "bf16 / fp16 auto keeps to fp32 math, as prefill (default: {default})",
                                           choices=DECODE_ATTENTION, engine="decode_attention")
    enforce_eager: bool = engine_setting(not engine_default("cuda_graphs"), "no CUDA graphs: run every decode step "
                                         "eagerly", bool, engine="cuda_graphs", to_engine=operator.not_)
    threads: int | None = engine_setting(engine_default("num_threads"), "CPU threads for torch (default: torch's)",
                                         int, engine="num_threads")
    no_prefix_caching: bool = engine_setting(
        not engine_default("enable_prefix_caching"), "do not reuse KV of equal prefixes (turns the persisted "
        "tier off too)", bool, engine="enable_prefix_caching", to_engine=operator.not_)
    # the conversations and the persisted KV tier (serve only)
    data_dir: str | None = setting(engine_default("data_dir"), "conversations (SQLite) and persisted KV files "
                                   "(default: the user data dir, e.g. ~/.local/share/kvforge)")
    db: str | None = setting(engine_default("db_url"), "SQLAlchemy URL of the session store, e.g. "
                             "postgresql+psycopg://user:pw@host/db (default: sqlite in --data-dir)")
    no_persist_kv: bool = setting(False, "keep prefix KV in memory only (no disk tier)", bool)  # serve persists
    kv_disk_gb: float = setting(engine_default("kv_disk_budget_bytes") / GIB, "disk budget of the persisted KV in "
                                "GiB, least recently used evicted (default: {default})", float)
    no_ui: bool = setting(False, "API only: no browser UI at /", bool)

    def engine_knobs(self) -> dict[str, Any]:
        """The EngineConfig knobs these settings set (the model-defining ones come from a ModelSpec)."""
        return {s.engine: s.to_engine(getattr(self, name)) for name, s in SETTINGS.items() if s.engine}


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(ServeSettings)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ServeSettings)}


def env_name(name: str) -> str:
    return f"KVFORGE_{name.upper()}"


def json_options(raw: str | dict | None, flag: str) -> dict:
    """A plugin's options setting (--quant-options, --decoding-options): a JSON object (or already a table,
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


def model_sampling_table(raw: str | dict | None) -> dict[str, dict[str, Any]]:
    """--model-sampling: model name -> its sampling defaults, each checked (ValueError naming the setting)."""
    from kvforge.core.generation_defaults import GenerationDefaults

    table = json_options(raw, "--model-sampling")
    for model, values in table.items():
        if not isinstance(values, dict):
            raise ValueError(f"--model-sampling: the defaults of {model!r} must be a table of sampling fields")
        try:
            GenerationDefaults(values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--model-sampling: {model!r}: {exc}") from None
    return table


def _convert(name: str, raw: Any, kind: type) -> object:
    if raw is None:
        return None
    if isinstance(raw, dict):  # quant_options / decoding_options as a TOML table under [serve]
        return json.dumps(raw)
    if isinstance(raw, list):  # allowed_hosts / allowed_origins as a TOML list
        return ",".join(map(str, raw))
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"setting {name}: invalid value {raw!r}") from None


def _config_table(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"config file {path}: {exc}") from None
    # other tables are sections ([serve]); an options table (quant_options = {...}) is a setting
    table = {**{k: v for k, v in data.items() if not isinstance(v, dict) or k in SETTINGS}, **data.get("serve", {})}
    unknown = sorted(set(table) - set(SETTINGS))
    if unknown:
        raise ValueError(f"config file {path}: unknown settings {', '.join(unknown)}")
    return table


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeSettings:
    """Flags given on the command line win over the environment, which wins over the TOML file. (A flag
    not given parses as None.)"""
    environ = os.environ if environ is None else environ
    config_path = getattr(args, "config", None) or environ.get("KVFORGE_CONFIG")
    table = _config_table(Path(config_path).expanduser()) if config_path else {}
    settings = ServeSettings()
    for name, declared in SETTINGS.items():
        value = table.get(name)
        env = environ.get(env_name(name))
        if env is not None:
            value = env
        flag = getattr(args, name, None)
        if flag is not None and flag is not False:
            value = flag
        if value is not None:
            setattr(settings, name, _convert(name, value, declared.kind))
    if settings.api_key is None and settings.api_key_file:
        settings.api_key = read_key_file(Path(settings.api_key_file).expanduser())
    for name, declared in SETTINGS.items():
        if declared.check is not None:
            declared.check(name, getattr(settings, name))
    return settings


def read_key_file(path: Path) -> str:
    try:
        key = path.read_text().strip().splitlines()
    except OSError as exc:
        raise ValueError(f"setting api_key_file: cannot read {path}: {exc.strerror}") from None
    if not key or not key[0].strip():
        raise ValueError(f"setting api_key_file: {path} is empty")
    if path.stat().st_mode & 0o077:
        print(f"kvforge: warning: the API key file {path} is readable by other users (chmod 600 it)",
              file=sys.stderr)
    return key[0].strip()
