"""`kvforge serve` as a real subprocess for end-to-end tests: started on a free port, waited for,
read through /metrics, stopped with SIGTERM or kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from kvforge.app.http.threaded_server import free_port


class ServeProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "kvforge.app.cli", "serve", "--port", str(self.port), "--log-level",
                "warning", *args]
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the server
        self.process = subprocess.Popen(argv, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                                        stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.process.kill()
        raise AssertionError("the server did not start")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> dict[str, float]:
        """Every Prometheus gauge and counter without labels, by name without the kvforge_ prefix."""
        lines = httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines()
        return {p[0].removeprefix("kvforge_"): float(p[1]) for p in map(str.split, lines)
                if len(p) == 2 and p[0].startswith("kvforge_")}

    def metric(self, name: str) -> float:
        """One of them, e.g. metric("kv_blocks_used")."""
        value = self.metrics().get(name)
        assert value is not None, f"no metric {name}"
        return value

    def stop(self, how: str = "sigterm") -> None:
        if self.process.poll() is None:
            if how == "sigterm":
                self.process.send_signal(signal.SIGTERM)
                assert self.process.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
            else:
                self.process.kill()
                self.process.wait(timeout=30)
        self.log.close()


def readme_serve(data_dir, *args: str) -> ServeProcess:
    """`kvforge serve` as README command 1 starts it: no setting from the environment (KVFORGE_*) or a settings
    file reaches it, only the port, a data dir and `args`."""
    from dataclasses import fields

    import pytest

    from kvforge.app.settings import ServeSettings

    with pytest.MonkeyPatch.context() as env:
        for name in [f.name for f in fields(ServeSettings)] + ["config"]:
            env.delenv(f"KVFORGE_{name.upper()}", raising=False)
        return ServeProcess("--data-dir", str(data_dir), *args)
