"""The core/app boundary: `import kvforge.core`, and an LLM without the persisted KV tier, import no database
or web layer (SQLAlchemy, Alembic, FastAPI, Starlette, Gradio). Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

APP_ONLY = ("sqlalchemy", "alembic", "fastapi", "starlette", "gradio")
REPORT = f"import json, sys; print(json.dumps(sorted(m for m in {APP_ONLY!r} if m in sys.modules)))"


def app_modules_loaded(code: str, *args: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", f"{code}\n{REPORT}", *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_import_core_loads_no_database_or_web_layer():
    assert app_modules_loaded("import kvforge.core") == []


def test_an_llm_without_persistence_loads_no_database_or_web_layer(embedded_path):
    code = """
import sys
from kvforge.core import LLM, SamplingParams
llm = LLM(sys.argv[1], progress=False, kv_cache_bytes=16 << 20)  # persist_kv is off by default
assert not llm.engine.config.persist_kv and llm.engine.persisted is None
llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2))
llm.engine.close()
"""
    assert app_modules_loaded(code, str(embedded_path)) == []
