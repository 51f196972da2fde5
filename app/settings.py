"""One settings object for `kvforge serve`, fed by (highest first) command-line flags, KVFORGE_*
environment variables, an optional TOML file (--config or KVFORGE_CONFIG), then defaults.

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
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from kvforge.app.limits import DEFAULT_MAX_REQUEST_BYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # better from KVFORGE_API_KEY or api_key_file: a flag is visible in `ps`
    api_key_file: str | None = None  # a file holding the key (its first line)
    allowed_hosts: str | None = None  # comma-separated names served beside loopback and the bound host
    allowed_origins: str | None = None  # comma-separated browser origins allowed to call the API (CORS)
    models_dir: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "float32"
    quant: str = "none"  # a quantized checkpoint picks its own plugin when this is "none"
    quant_options: str | None = None  # JSON object (a TOML table works too)
    decoding: str = "none"  # speculative decoding plugin (ngram, draft...); "none": off
    decoding_options: str | None = None  # JSON object (a TOML table works too)
    tp: int = 1  # tensor-parallel ranks (--tp), one process each; checked (>= 1) before the model loads
    kv_cache_gb: float | None = None  # None: 1 GiB on CPU; on a GPU, sized from gpu_memory_utilization
    device: str | None = None  # cpu | cuda | cuda:N; None: cuda when a GPU is present
    gpu_memory_utilization: float = 0.9
    kernels: str = "auto"  # auto | triton | torch
    enforce_eager: bool = False  # no CUDA graphs
    block_size: int = 16
    threads: int | None = None
    no_prefix_caching: bool = False
    data_dir: str | None = None  # conversations + persisted KV; default: the user data dir
    db: str | None = None  # SQLAlchemy URL of the store; default: sqlite in data_dir
    no_persist_kv: bool = False
    kv_disk_gb: float = 2.0
    no_ui: bool = False
    max_pending: int = 256
    default_max_tokens: int = 512
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body gets 413 before it is parsed
    request_timeout: float | None = None  # seconds a request may generate before it is aborted; None: no limit
    max_connections: int = 1024  # open connections and requests before uvicorn answers 503
    header_timeout: float = 10.0  # seconds a connection may take to send a request's head
    log_level: str = "info"


def _convert(name: str, raw, target: type) -> object:
    if raw is None:
        return None
    if isinstance(raw, dict):  # quant_options / decoding_options as a TOML table under [serve]
        return json.dumps(raw)
    if isinstance(raw, list):  # allowed_hosts / allowed_origins as a TOML list
        return ",".join(map(str, raw))
    kind = target if isinstance(target, type) else str(target)
    try:
        if kind in (bool, "bool"):
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if "int" in str(kind) and "float" not in str(kind):
            return int(raw)
        if "float" in str(kind):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ValueError(f"setting {name}: invalid value {raw!r}") from None


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeSettings:
    """Flags given on the command line win over the environment, which wins over the TOML file."""
    environ = os.environ if environ is None else environ
    config_path = getattr(args, "config", None) or environ.get("KVFORGE_CONFIG")
    table: dict = {}
    if config_path:
        path = Path(config_path).expanduser()
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"config file {path}: {exc}") from None
        names = {f.name for f in fields(ServeSettings)}
        # other tables are sections ([serve]); an options table (quant_options = {...}) is a setting
        table = {**{k: v for k, v in data.items() if not isinstance(v, dict) or k in names}, **data.get("serve", {})}
        unknown = sorted(set(table) - names)
        if unknown:
            raise ValueError(f"config file {path}: unknown settings {', '.join(unknown)}")
    settings = ServeSettings()
    for f in fields(ServeSettings):
        value = table.get(f.name)
        env = environ.get(f"KVFORGE_{f.name.upper()}")
        if env is not None:
            value = env
        flag = getattr(args, f.name, None)
        if flag is not None and flag is not False:
            value = flag
        if value is not None:
            setattr(settings, f.name, _convert(f.name, value, f.type))
    if settings.api_key is None and settings.api_key_file:
        settings.api_key = read_key_file(Path(settings.api_key_file).expanduser())
    for name, low in (("max_request_bytes", 1), ("max_connections", 1), ("max_pending", 1)):
        if getattr(settings, name) < low:
            raise ValueError(f"setting {name}: must be >= {low}, got {getattr(settings, name)}")
    for name in ("header_timeout", "request_timeout"):
        value = getattr(settings, name)
        if value is not None and not (0 < value < float("inf")):
            raise ValueError(f"setting {name}: must be a number of seconds > 0, got {value}")
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
