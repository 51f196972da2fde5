"""The import boundaries: `import kvforge.core`, and an LLM without the persisted KV tier, import no database
or web layer (SQLAlchemy, Alembic, FastAPI, Starlette, Gradio), each checked in a fresh interpreter; the packages
import one way (core <- plugins <- app <- ui) and no module imports itself back, checked on the source."""

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


def module_graph() -> dict[str, set[str]]:
    """Every kvforge module (by dotted name) -> the kvforge modules it imports, at any depth of its code (imports
    under `if TYPE_CHECKING:` are annotations only and do not count)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    folders = {"core": "kvforge.core", "plugins/quant": "kvforge.plugins.quant",
               "plugins/decoding": "kvforge.plugins.decoding", "app": "kvforge.app", "ui": "kvforge.ui"}
    files = {}
    for folder, package in folders.items():
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            files[".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_no_module_imports_itself_back():
    """No import cycle between modules, lazy (function-level) imports included: each module can be read, and
    loaded, after those it uses. A cycle found is printed as its path."""
    graph, state, cycles = module_graph(), {}, []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
