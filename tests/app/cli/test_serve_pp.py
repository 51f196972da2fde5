"""`kvforge serve --pp 2` as a real process: the `openai` client gets one process's tokens, the model card says how
the model runs, a swap to one process over the admin API replaces the stage process, a stage that dies makes the
server report it and exit (no hang), and no stage process is left behind."""

from __future__ import annotations

import signal

import httpx

from tests.app.cli.test_serve_tp import _gone, ask
from tests.helpers.processes import rank_processes
from tests.helpers.server_process import ServeProcess


def _serve(tmp_path) -> ServeProcess:
    return ServeProcess("--pp", "2", "--data-dir", str(tmp_path), "--kv-cache-gb", "0.0625", "--no-ui",
                        "--dtype", "float32")


def test_serve_pp2_answers_the_openai_client_swaps_and_leaves_no_process(tmp_path, reference_text):
    from openai import OpenAI

    server = _serve(tmp_path)
    (stage1,) = rank_processes(server.process.pid)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert ask(client) == reference_text
        (card,) = client.models.list().data
        assert card.model_extra["pp"] == 2 and card.model_extra["tp"] == 1
        assert [stage["layers"] for stage in card.model_extra["stages"]] == [[0, 11], [11, 30]]
        loaded = httpx.post(f"{server.url}/admin/models/load", json={"pp": 1, "dtype": "float32"}, timeout=120)
        assert loaded.status_code == 200 and loaded.json()["loaded"]["pp"] == 1, loaded.text
        assert _gone(stage1) and not rank_processes(server.process.pid)
        assert ask(client) == reference_text
    finally:
        server.stop("sigterm")
    assert _gone(stage1), "stage 1 outlived the server"


def test_a_dying_stage_makes_the_server_report_it_and_exit(tmp_path):
    server = _serve(tmp_path)
    (stage1,) = rank_processes(server.process.pid)
    try:
        stage1.send_signal(signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1
        assert "pipeline rank 1 exited" in server.output()
    finally:
        server.stop("kill")
