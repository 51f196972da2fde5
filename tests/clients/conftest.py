"""One `kvforge serve` for every client test of this folder (package-scoped: one model load).

It serves the embedded model dequantized in fp32 (`--dtype float32 --gguf-dense`): the dtype and weights of
lm-eval's own `hf` model on the same local checkpoint, so that lm-eval's loglikelihoods through the server can be
compared with the ones it computes itself (within 1e-4); on a 2-core CPU this configuration also starts and decodes
faster than the default one (Q4_1 blocks in bf16), so the other clients use it as well. Otherwise the server is
started as README command 1 starts it (readme_serve: no KVFORGE_* setting reaches it)."""

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


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    process = readme_serve(tmp_path_factory.mktemp("data"), "--no-ui", "--dtype", "float32", "--gguf-dense")
    # the first generation picks and warms kernels (~20 s on 2 cores): here, not in the first test's time
    warm = httpx.post(f"{process.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      timeout=300)
    assert warm.status_code == 200, warm.text
    yield process
    process.stop()
