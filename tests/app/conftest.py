"""Fixtures of the API tests: one `kvforge serve` as README command 1 starts it, shared by the modules that test
its APIs with their official clients (openai and langchain, ollama, anthropic): one model load instead of three.
Package-scoped: it stops when the tests of this folder end (a later test may require that it started no process,
as the tensor-parallel tests do)."""

from __future__ import annotations

import pytest

from tests.helpers.server_process import readme_serve


@pytest.fixture(scope="package")
def readme_server(tmp_path_factory):
    process = readme_serve(tmp_path_factory.mktemp("data"), "--no-ui")
    yield process
    process.stop()
