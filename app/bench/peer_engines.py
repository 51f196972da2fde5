"""The engines `kvforge bench peers` runs and how a peer's interpreter is found and its processes stopped: shared by
the offline run (peers.py) and the servers' run (peers_http.py)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

STDERR_TAIL_LINES = 25


@dataclass(frozen=True)
class Engine:
    name: str
    kind: str  # the worker's runner: hf | kvforge | vllm | llama.cpp
    dtype: str  # llama.cpp: the GGUF's own quantization, filled in per run from the file (q4_1, q4_k_m)
    peer: str | None = None  # vllm | llama: runs in that peer's interpreter


ENGINES = (
    Engine("hf-fp32", "hf", "float32"),
    Engine("kvforge-fp32", "kvforge", "float32"),
    Engine("kvforge-bf16", "kvforge", "bfloat16"),
    Engine("kvforge-4bit", "kvforge", "bfloat16"),
    Engine("kvforge-gguf", "kvforge", "bfloat16"),  # the GGUF itself, from its quantized blocks (gguf plugin)
    Engine("vllm-bf16", "vllm", "bfloat16", peer="vllm"),
    Engine("vllm-fp32", "vllm", "float32", peer="vllm"),
    Engine("llama.cpp", "llama.cpp", "gguf", peer="llama"),  # named without a quantization: --gguf changes it
)
# --http: the server each kind of engine runs as (HF transformers has none)
SERVERS = {"kvforge": "kvforge serve", "vllm": "vllm serve", "llama.cpp": "python -m llama_cpp.server"}

# peer -> (the Python module it needs, the virtualenv under the peers dir, its flag, its environment variable);
# openwebui is a client, not an engine: `kvforge bench clients` drives it against `kvforge serve`
PEERS = {"vllm": ("vllm", "vllm", "--vllm-python", "KVFORGE_VLLM_PYTHON"),
         "llama": ("llama_cpp", "llama", "--llama-python", "KVFORGE_LLAMA_PYTHON"),
         "openwebui": ("open_webui", "openwebui", "--openwebui-python", "KVFORGE_OPENWEBUI_PYTHON")}


@dataclass
class EngineRun:
    engine: Engine
    status: str = "ok"  # ok | skipped | failed
    why: str | None = None
    python: str | None = None
    seconds: float | None = None
    info: dict = field(default_factory=dict)
    measurements: list[dict] = field(default_factory=list)
    stderr_tail: str | None = None

    def summary(self) -> dict:
        return {"engine": self.engine.name, "kind": self.engine.kind, "dtype": self.engine.dtype,
                "status": self.status, "why": self.why, "python": self.python, "seconds": self.seconds,
                "info": self.info, "stderr_tail": self.stderr_tail,
                "skipped_batches": {str(m["batch"]): m["skipped"] for m in self.measurements if "skipped" in m}}


def default_peers_dir() -> Path:
    return Path(os.environ.get("KVFORGE_PEERS_DIR") or Path.home() / ".cache" / "kvforge-peers")


PEER_NAMES = {"vllm": "vLLM CPU", "llama": "llama-cpp-python", "openwebui": "Open WebUI"}


def add_peer_options(parser: argparse.ArgumentParser, peers: tuple[str, ...], no_peers_help: str) -> None:
    """--peers-dir, an interpreter flag per peer in `peers` and --no-peers: where find_peer looks."""
    venvs = " and ".join(f"{PEERS[p][1]}/" for p in peers)
    parser.add_argument("--peers-dir", default=None,
                        help=f"where the peers' virtualenvs are: {venvs} (default: $KVFORGE_PEERS_DIR or "
                             "~/.cache/kvforge-peers)")
    for peer in peers:
        _, _, flag, variable = PEERS[peer]
        parser.add_argument(flag, default=None, help=f"the interpreter that has {PEER_NAMES[peer]} (default: "
                                                     f"${variable} or the peers dir's)")
    parser.add_argument("--no-peers", action="store_true", help=no_peers_help)


def find_peer(peer: str, args: argparse.Namespace, needs: tuple[str, ...] = ()) -> tuple[str | None, str | None]:
    """The peer's interpreter (flag > environment variable > the peers dir), or None and why it is skipped. The
    interpreter must find the peer's module and the modules in `needs`."""
    module, venv, flag, variable = PEERS[peer]
    if args.no_peers:
        return None, "--no-peers"
    given = getattr(args, f"{peer}_python") or os.environ.get(variable)
    if given:
        python, where = Path(given).expanduser(), f"{flag} / {variable}"
    else:
        python = Path(args.peers_dir or default_peers_dir()) / venv / "bin" / "python"
        where = f"the peers dir: --peers-dir / KVFORGE_PEERS_DIR, or {flag} / {variable}"
    if not python.exists():
        return None, f"not installed: no {python} ({where})"
    try:
        check = subprocess.run([str(python), "-c", "import importlib.util, sys\n"
                                f"for m in {(module, *needs)!r}:\n"
                                "    if importlib.util.find_spec(m) is None: print(m); sys.exit(3)"],
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} does not run: {exc}"
    if check.returncode == 3:
        return None, f"not installed: {python} has no {check.stdout.strip() or module} module"
    if check.returncode != 0:
        return None, f"{python} does not run: {last_lines(check.stderr, 3) or f'exit code {check.returncode}'}"
    return str(python), None


def vllm_cpu_binding(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` threads on the CPUs this process may use (vLLM's "auto" keeps a
    core for its scheduler and one thread per physical core: on a small machine it would run on fewer threads
    than the other engines)."""
    return ",".join(str(c) for c in usable_cpus()[:threads])


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def stop_group(proc: subprocess.Popen) -> None:
    """The worker and whatever it started (vLLM's engine process)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def last_lines(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def say(text: str, bench: str = "peers") -> None:
    """Progress on stderr (stdout carries the report)."""
    print(f"[bench {bench}] {text}", file=sys.stderr, flush=True)


def all_or_none(values: list) -> list | None:
    known = [v for v in values if v is not None]
    return known if len(known) == len(values) and known else None  # no partial percentiles
