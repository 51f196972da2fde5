"""`kvforge bench gpu` runs each model in a child process of its own (a sticky CUDA error or a crash in one
model leaves the others' figures): the parent's side starts it and relays its output, the child's side
(`python -m kvforge.app.bench.gpu_worker JOB.json`) runs the model's steps."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from kvforge.app.bench.gpu_steps import empty_result, run_model


def worker_main(argv: list[str]) -> int:
    """`python -m kvforge.app.bench.gpu_worker JOB.json`: one model's steps, in a process of its own."""
    import warnings

    job = json.loads(Path(argv[0]).read_text())
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:
        pass
    args = argparse.Namespace(**job["args"])
    result = run_model(job["model"], args, job["bandwidth"], Path(job["out"]), job.get("workdir"))
    return 1 if result["errors"] else 0


def _relay(stream, prefix: str = "  ") -> None:
    for line in stream:
        print(prefix + line.rstrip("\n"), flush=True)


def run_model_isolated(name: str, args, bandwidth: float | None, timeout: float) -> dict:
    """`run_model` in a child process (its output relayed line by line); a crash or a timeout keeps the steps
    the child finished and records what happened."""
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-gpu-job-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        options = {k: v for k, v in vars(args).items() if k != "func"}
        job.write_text(json.dumps({"args": options, "model": name, "bandwidth": bandwidth, "out": str(out),
                                   "workdir": tmp}))  # a killed child's model files go with this directory
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_TELEMETRY="1")
        proc = subprocess.Popen([sys.executable, "-m", "kvforge.app.bench.gpu_worker", str(job)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                                errors="replace")
        relay = threading.Thread(target=_relay, args=(proc.stdout,), daemon=True)
        relay.start()
        timed_out = False
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            code = proc.wait()
        relay.join(timeout=10)
        result = None
        if out.exists():
            try:
                result = json.loads(out.read_text())
            except json.JSONDecodeError:
                result = None
        if result is None:
            result = empty_result(name)
        if timed_out:
            result["errors"]["process"] = f"stopped after {timeout:.0f} s (--time-budget)"
        elif code != 0 and not result["errors"]:
            result["errors"]["process"] = f"the model's process exited with code {code}"
        result["exit_code"] = code
        return result


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
