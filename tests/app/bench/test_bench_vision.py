"""`kvforge bench vision`, run as a real subprocess on a tiny random Idefics3 and its GGUF pair with kvforge (from the
checkpoint and from the pair) and HF; llama.cpp (not part of CI) pointed at an interpreter that does not exist and
reported as skipped. No timing assertions: the rows, the token counts every engine agrees on, the next turn read
from kvforge's cache with the tower run once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvforge.app.bench.hf_to_gguf import write_smolvlm_gguf_pair
from tests.helpers.tiny_models import save_tiny_idefics3


def test_every_engine_answers_both_turns_and_kvforge_keeps_the_picture(tmp_path, embedded_path):
    checkpoint = tmp_path / "checkpoint"
    model, processor = save_tiny_idefics3(checkpoint, embedded_path, seed=3, plain_rope=True)
    (tmp_path / "pair").mkdir()
    text, _ = write_smolvlm_gguf_pair(model, processor, tmp_path / "pair")
    out = tmp_path / "vision.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", KVFORGE_PEERS_DIR=str(tmp_path / "no-peers-here"))
    env.pop("KVFORGE_LLAMA_PYTHON", None)
    done = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "vision", "--model", str(checkpoint),
                           "--gguf", str(text), "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = {row["engine"]: row for row in report["rows"]}
    assert rows["llama.cpp"]["status"] == "skipped" and "not installed" in rows["llama.cpp"]["why"]
    for name in ("kvforge", "kvforge-gguf", "hf"):
        assert rows[name]["status"] == "ok", rows[name]
    tokens = {name: [turn["prompt_tokens"] for turn in rows[name]["turns"]]
              for name in ("kvforge", "kvforge-gguf", "hf")}
    assert tokens["kvforge"] == tokens["kvforge-gguf"] == tokens["hf"] and tokens["hf"][1] > tokens["hf"][0]
    for name in ("kvforge", "kvforge-gguf"):
        first, second = rows[name]["turns"]
        assert first["cached_tokens"] == 0 and second["cached_tokens"] >= first["prompt_tokens"] - 16
        assert rows[name]["tower_runs"] == 1  # the next turn's picture rows came from the cache
    assert report["cpu"] in done.stdout and "llama.cpp" in done.stdout and "skipped" in done.stdout


def test_unknown_engines_are_refused_before_anything_loads():
    done = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "vision", "--engines", "kvforge,ollama"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--engines: unknown ollama" in done.stderr
