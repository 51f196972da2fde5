"""The `kvforge serve` the client tests of this folder talk to (package-scoped: one model load each).

`server`: started as README command 1 starts it (readme_serve: no flag but the port and a data dir, no KVFORGE_*
setting), what the clients' users get. `fp32_server`: the embedded model dequantized in fp32 (`--dtype float32
--gguf-dense`), the dtype and weights of lm-eval's own `hf` model on the same local checkpoint, so that lm-eval's
loglikelihoods through the server can be compared with the ones it computes itself (within 1e-4)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import httpx
import pytest

from tests.clients import MODEL
from tests.helpers.optional_parts import require
from tests.helpers.server_process import readme_serve

# litellm fetches a model cost map from the internet when it is imported unless told to read its bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # openai-agents would upload traces to OpenAI


def client_module(module: str, package: str, install: str = "pip install -e '.[test]'"):
    """The client's module, or a skip naming the package to install (a failure under KVFORGE_REQUIRE_ALL=1)."""
    require(importlib.util.find_spec(module.split(".")[0]) is not None,
            f"this client test needs the package {package} ({install})")
    return importlib.import_module(module)


def warmed(process):
    """The server after a first generation, which picks and warms kernels (~20 s on 2 cores): here, not in the
    first test's time."""
    warm = httpx.post(f"{process.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      timeout=300)
    assert warm.status_code == 200, warm.text
    return process


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    process = readme_serve(tmp_path_factory.mktemp("data"), "--no-ui")
    yield warmed(process)
    process.stop()


@pytest.fixture(scope="package")
def fp32_server(tmp_path_factory):
    process = readme_serve(tmp_path_factory.mktemp("data"), "--no-ui", "--dtype", "float32", "--gguf-dense")
    yield warmed(process)
    process.stop()
