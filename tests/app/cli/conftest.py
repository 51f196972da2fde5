"""The one-process reference of the `kvforge serve --tp 2` and `--pp 2` tests (test_serve_tp.py, test_serve_pp.py):
the same question, model and settings for both, so it is generated once for the folder."""

from __future__ import annotations

import pytest

from kvforge.core import LLM, SamplingParams
from tests.app.cli.test_serve_tp import MAX_TOKENS, QUESTION


@pytest.fixture(scope="package")
def reference_text(embedded_path):
    # what the server serves by default: the embedded GGUF from its own blocks, in one process (on one rank)
    llm = LLM(progress=False, kv_cache_bytes=64 << 20, dtype="float32")
    (out,) = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    llm.engine.close()
    return out.text
