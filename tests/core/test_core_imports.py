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


def imports_of(folder: str) -> dict[str, set[str]]:
    """Per source file under `folder` (relative to the repository), the kvforge modules it imports (at any depth)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = {}
    for path in sorted((root / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(root))] = {n for n in names if n.startswith("kvforge.")}
    return found


def test_the_core_imports_no_plugin_and_the_app_no_ui():
    """Plugins are found through their entry points (core/plugins.py), never imported by the core; the app's
    routes do not import the UI (the CLI, the composition root, hands it to create_app)."""
    core = {f: [m for m in mods if m.startswith("kvforge.plugins")] for f, mods in imports_of("core").items()}
    assert {f: m for f, m in core.items() if m} == {}
    app = {f: [m for m in mods if m.startswith("kvforge.ui")] for f, mods in imports_of("app").items()
           if not f.startswith("app/cli/")}
    assert {f: m for f, m in app.items() if m} == {}
