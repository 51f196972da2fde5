"""`kvforge bench profile --json`, run as a real subprocess on the embedded model with the default dtype (tiny sizes,
no timing assertions: the report's shape and the arithmetic that ties it together)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvforge.app.bench.profile import OP_CLASSES, OUTSIDE, op_class
from kvforge.core.config import EngineConfig

BATCHES, STEPS = [1, 3], 2


@pytest.fixture(scope="module")
def report(embedded_path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "profile", "--batches",
                             ",".join(map(str, BATCHES)), "--steps", str(STEPS), "--top", "6", "--threads", "1",
                             "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_each_batch_is_profiled_on_the_default_dtype(report):
    assert report["dtype"] == EngineConfig().dtype and report["cpu"]
    assert [b["batch"] for b in report["batches"]] == BATCHES
    for b in report["batches"]:
        assert b["steps"] == STEPS and b["threads"] == 1
        assert b["tok_s"] == pytest.approx(b["batch"] * 1000 / b["step_ms"])


def test_shares_add_up_and_the_linears_are_found(report):
    classes = set(OP_CLASSES) | {"other ops", OUTSIDE}
    for b in report["batches"]:
        assert set(b["shares"]) <= classes and sum(b["shares"].values()) == pytest.approx(1.0)
        assert all(share >= 0 for share in b["shares"].values())
        assert b["shares"]["linears"] > 0.05  # the model's matmuls ran inside the profiled steps
        top = b["top_ops"]
        assert len(top) == 6 and [op["ms_per_step"] for op in top] == sorted((op["ms_per_step"] for op in top),
                                                                             reverse=True)
        assert all(op["class"] == op_class(op["op"]) and op["calls_per_step"] > 0 for op in top)


def test_op_names_fall_in_their_classes():
    assert op_class("aten::addmm") == op_class("aten::linear") == "linears"
    assert op_class("aten::index_select") == "KV gather / write"
    assert op_class("aten::baddbmm") == "attention math" and op_class("aten::_to_copy") == "copies, conversions"
    assert op_class("aten::something_new") == "other ops"
