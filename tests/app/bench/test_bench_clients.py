"""`kvforge bench clients`: Open WebUI itself is not part of CI (its install takes ~10 minutes and 1 GB; the bench
is run before each release). Here the peers dir is an empty directory: Open WebUI must be reported as skipped, with
the command that builds it, without starting `kvforge serve`, exit 0. The parsing of what Open WebUI returns is
checked on the shapes its source produces (0.12.4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvforge.app.bench.clients import (
    SETUP,
    connection_models,
    loaded_check,
    saved_reply,
    stream_text,
    usage_check,
    whole_text,
)

NAME = "SmolLM2-135M-Instruct"


def test_missing_openwebui_is_skipped_without_starting_a_server(tmp_path):
    env = dict(os.environ, KVFORGE_PEERS_DIR=str(tmp_path / "empty"))
    env.pop("KVFORGE_OPENWEBUI_PYTHON", None)
    (tmp_path / "empty").mkdir()
    out = tmp_path / "clients.json"
    result = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "clients", "--json", str(out)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "starting kvforge serve" not in result.stderr  # nothing started
    report = json.loads(out.read_text())
    assert report["status"] == "skipped" and "python" not in report
    [row] = report["checks"]
    assert row["result"] == "skipped" and row["detail"].startswith("not installed: no ")
    assert str(tmp_path / "empty" / "openwebui" / "bin" / "python") in row["detail"]
    assert SETUP in result.stdout and "skipped" in result.stdout


def test_connection_models_keeps_each_connection_apart():
    models = [{"id": f"{NAME}:latest", "owned_by": "ollama"}, {"id": NAME, "owned_by": "openai"},
              {"id": "other:latest", "owned_by": "ollama"}, {"id": "arena-model", "owned_by": "arena"}]
    assert connection_models(models, NAME) == {"ollama": [f"{NAME}:latest"], "openai": [NAME]}
    assert connection_models([], NAME) == {"ollama": [], "openai": []}


def test_stream_text_reads_openai_chunks_and_usage():
    body = "\n".join([
        'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}', "",
        'data: {"choices": [{"delta": {"reasoning_content": "hm"}}]}', "",
        'data: {"choices": [{"delta": {"content": "Red, "}}]}', "",
        'data: {"choices": [{"delta": {"content": "blue"}, "finish_reason": "stop"}], '
        '"usage": {"completion_tokens": 3}, "timings": {"predicted_n": 3}}', "",
        "data: [DONE]", ""])
    assert stream_text(body) == ("Red, blue", "hm", {"completion_tokens": 3, "predicted_n": 3})


def test_stream_text_reads_ollama_ndjson_and_raises_on_error():
    body = '{"message": {"role": "assistant", "content": "Red"}, "done": false}\n{"message": {"content": ""}, ' \
           '"done": true, "eval_count": 1}\n'
    assert stream_text(body)[0] == "Red"
    try:
        stream_text('data: {"error": {"message": "Chat completion stream failed"}}\n')
    except RuntimeError as exc:
        assert "stream failed" in str(exc)
    else:
        raise AssertionError("an error event must raise")


def test_whole_text():
    body = {"choices": [{"message": {"role": "assistant", "content": "Red", "reasoning_content": "hm"}}]}
    assert whole_text(body) == ("Red", "hm")
    assert whole_text({}) == ("", "")


def test_saved_reply_reads_content_output_items_and_reasoning_blocks():
    assert saved_reply({"content": " Red "}) == ("Red", "")
    output = [{"type": "reasoning", "content": [{"type": "output_text", "text": "hm"}]},
              {"type": "message", "content": [{"type": "output_text", "text": "Blue"}]}]
    assert saved_reply({"content": "", "output": output}) == ("Blue", "hm")
    details = '<details type="reasoning" done="true">\n<summary>Thought</summary>\n> hm\n</details>\nGreen'
    text, reasoning = saved_reply({"content": details})
    assert text == "Green" and "hm" in reasoning


def test_usage_check_needs_output_and_input_tokens():
    ollama = {"eval_count": 12, "prompt_eval_count": 30, "response_token/s": 40.5, "output_tokens": 12,
              "input_tokens": 30, "total_tokens": 42}
    check = usage_check("ollama", ollama)
    assert check.result == "pass" and "eval counts" in check.detail and "output_tokens=12" in check.detail
    timings = {"predicted_n": 8, "prompt_n": 20, "predicted_per_second": 50.0, "output_tokens": 8, "input_tokens": 20}
    assert usage_check("openai", timings).result == "pass" and "timings" in usage_check("openai", timings).detail
    assert usage_check("openai", None).result == "fail"
    assert usage_check("openai", {"output_tokens": 0, "input_tokens": 0}).result == "fail"


def test_loaded_check_parses_expires_at_as_open_webui_does():
    ps = {"models": [{"name": f"{NAME}:latest", "model": f"{NAME}:latest", "expires_at": "2026-12-07T00:05:00Z"}]}
    models = [{"id": f"{NAME}:latest", "owned_by": "ollama", "loaded": True}]
    assert loaded_check(ps, models, f"{NAME}:latest").result == "pass"
    assert loaded_check(ps, [{"id": f"{NAME}:latest", "loaded": False}], f"{NAME}:latest").result == "fail"
    bad = {"models": [{**ps["models"][0], "expires_at": "soon"}]}
    assert "does not parse" in loaded_check(bad, models, f"{NAME}:latest").detail
    assert loaded_check({"models": []}, models, f"{NAME}:latest").result == "fail"
