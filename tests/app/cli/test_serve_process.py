"""`kvforge serve` as a real process: settings from flags / KVFORGE_* / TOML, and graceful SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvforge.app.cli import build_parser
from kvforge.app.http.threaded_server import free_port
from kvforge.app.settings import resolve


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_settings_precedence_flags_over_env_over_toml(tmp_path):
    config = tmp_path / "kvforge.toml"
    config.write_text('port = 9001\ndtype = "bfloat16"\n[serve]\nmax_pending = 7\nlog_level = "warning"\n')
    env = {"KVFORGE_PORT": "9002", "KVFORGE_NO_PREFIX_CACHING": "true"}
    settings = resolve(_args("--config", str(config)), env)
    assert (settings.port, settings.dtype, settings.max_pending, settings.no_prefix_caching) == (9002, "bfloat16", 7,
                                                                                                  True)
    settings = resolve(_args("--config", str(config), "--port", "9003"), env)
    assert settings.port == 9003 and settings.host == "127.0.0.1" and settings.log_level == "warning"
    assert resolve(_args(), {}).port == 8000


def test_tp_setting_flag_over_env_over_toml(tmp_path):
    config = tmp_path / "kvforge.toml"
    config.write_text('[serve]\ndecoding = "ngram"\ntp = 2\n')
    assert resolve(_args("--config", str(config)), {}).tp == 2
    assert resolve(_args("--config", str(config)), {"KVFORGE_TP": "3"}).tp == 3
    assert resolve(_args("--config", str(config), "--tp", "4"), {"KVFORGE_TP": "3"}).tp == 4
    top_level = tmp_path / "top.toml"
    top_level.write_text("tp = 2\n")
    assert resolve(_args("--config", str(top_level)), {}).tp == 2
    assert resolve(_args(), {}).tp == 1


@pytest.mark.parametrize("content, fragment", [("bogus_key = 1", "unknown settings"), ("port = ", "config file"),
                                               ("port = 'eighty'", "port"), ("tp = 'two'", "setting tp")])
def test_bad_settings_are_clear_errors(tmp_path, content, fragment):
    config = tmp_path / "bad.toml"
    config.write_text(content)
    with pytest.raises(ValueError, match=fragment):
        resolve(_args("--config", str(config)), {})


def test_sigterm_ends_open_streams_with_a_final_chunk_and_exits_fast(tmp_path, embedded_path):
    port = free_port()
    config = tmp_path / "serve.toml"  # settings from a TOML file are what this checks: not README command 1 on purpose
    config.write_text('served_model_name = "local-smol"\napi_key = "k1"\nlog_level = "warning"\n')
    env = dict(os.environ, HF_HUB_OFFLINE="1", KVFORGE_PORT=str(port))
    env.pop("KVFORGE_API_KEY", None)
    process = subprocess.Popen([sys.executable, "-m", "kvforge.app.cli", "serve", "--config", str(config)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k1"}
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key from the TOML file is enforced
        assert httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"] == "local-smol"
        lines: list[str] = []
        first_chunk = threading.Event()

        def stream():
            payload = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=payload, headers=headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        elapsed = time.monotonic() - start
        reader.join(timeout=15)
        assert elapsed < 7, f"took {elapsed:.1f} s to stop"
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason": "stop"' in lines[-2] or '"finish_reason": "stop"' in lines[-3]
    finally:
        if process.poll() is None:
            process.kill()
