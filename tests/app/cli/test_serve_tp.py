"""`kvforge serve --tp 2` as a real process: the `openai` client gets the tokens a one-rank engine gives; admin
swaps between tensor-parallel layouts replace the rank processes; a shutdown leaves no rank process behind; a
rank that dies makes the server report it and exit (no hang)."""

from __future__ import annotations

import signal
import time

import httpx
import psutil

from tests.helpers.processes import rank_processes
from tests.helpers.server_process import ServeProcess

QUESTION = "Name three primary colors."
MAX_TOKENS = 24


def _serve(tmp_path) -> tuple[ServeProcess, psutil.Process]:
    # fp32: two ranks sum partial products in another order than one; in fp32 the tokens still agree exactly
    server = ServeProcess("--tp", "2", "--data-dir", str(tmp_path), "--kv-cache-gb", "0.0625", "--no-ui",
                          "--dtype", "float32")
    (rank1,) = rank_processes(server.process.pid)
    return server, rank1


def _gone(process: psutil.Process, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def test_serve_tp2_answers_the_openai_client_and_leaves_no_process(tmp_path, reference_text):
    from openai import OpenAI

    server, rank1 = _serve(tmp_path)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert ask(client) == reference_text
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=MAX_TOKENS, stream=True,
            messages=[{"role": "user", "content": QUESTION}]) if chunk.choices)
        assert streamed == reference_text
        (card,) = client.models.list().data
        assert card.model_extra["tp"] == 2

        # swaps: tensor-parallel to tensor-parallel (the old ranks go first), then back to one rank
        loaded = httpx.post(f"{server.url}/admin/models/load", json={"tp": 2, "dtype": "bfloat16"}, timeout=120)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["loaded"]["tp"] == 2 and loaded.json()["loaded"]["dtype"] == "bfloat16"
        assert _gone(rank1)
        (new_rank1,) = rank_processes(server.process.pid)
        assert ask(client)
        # a tensor-parallel load that fails after the old ranks went first leaves no model (and says so) ...
        refused = httpx.post(f"{server.url}/admin/models/load", json={"tp": 4}, timeout=120)
        assert refused.status_code == 400 and "3 KV heads cannot be split across 4" in refused.text, refused.text
        assert "no model is loaded" in refused.text and refused.json()["error"]["param"] == "tp"
        assert _gone(new_rank1) and not rank_processes(server.process.pid)
        loaded = httpx.post(f"{server.url}/admin/models/load", json={"tp": 1, "dtype": "float32"}, timeout=120)
        assert loaded.status_code == 200 and loaded.json()["loaded"]["tp"] == 1, loaded.text
        assert ask(client) == reference_text
        # ... while from one rank the old model keeps serving
        refused = httpx.post(f"{server.url}/admin/models/load", json={"tp": 4}, timeout=120)
        assert refused.status_code == 400 and "no model is loaded" not in refused.text, refused.text
        assert not rank_processes(server.process.pid)
        assert ask(client) == reference_text
    finally:
        server.stop("sigterm")
    assert _gone(rank1), "rank 1 outlived the server"


def ask(client) -> str:
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=MAX_TOKENS,
                                          messages=[{"role": "user", "content": QUESTION}]).choices[0].message.content


def test_a_dying_rank_makes_the_server_report_it_and_exit(tmp_path):
    server, rank1 = _serve(tmp_path)
    try:
        rank1.send_signal(signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1
        assert "tensor-parallel rank 1 exited" in server.output()
    finally:
        server.stop("kill")
