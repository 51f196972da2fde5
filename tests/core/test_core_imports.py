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


PACKAGES = ("core", "plugins", "app", "ui")  # each may import only those before it (plugins and app: the core)
ALLOWED = {"core": set(), "plugins": {"core"}, "app": {"core", "plugins"}, "ui": {"core", "app"}}


def test_the_packages_import_in_one_direction():
    """No import cycle between the packages: the core imports no plugin (plugins are found through their entry
    points, core/plugins.py), the app no UI (the CLI finds the UI through its entry point), the UI builds on the
    app. Function-local imports count."""
    crossing = {}
    for package in PACKAGES:
        for path, modules in imports_of(package).items():
            wrong = sorted(m for m in modules if m.split(".")[1] not in ALLOWED[package] | {package})
            if wrong:
                crossing[path] = wrong
    assert crossing == {}
