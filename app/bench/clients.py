"""`kvforge bench clients`: real clients too heavy for the test suite, driven against a real `kvforge serve`, run
before each release; its table is what the README's client table says of them.

Open WebUI 0.12.4 (its own virtualenv in the peers dir: `../shared/peers/setup.sh openwebui`, ~1 GB)
is started against a `kvforge serve --no-ui` (the embedded model unless --model; a temporary data directory) through
both of its connections at once, Ollama (OLLAMA_BASE_URL) and OpenAI (OPENAI_API_BASE_URL), offline, without
authentication and with everything that would download or call out switched off (embeddings / RAG, image
generation, web search, title / tag / follow-up generation, update checks). Then, through Open WebUI's own HTTP
API (the token its /api/v1/auths/signin hands out when WEBUI_AUTH=False), one row per check and connection:

- models: /api/models lists the model once per connection, under distinct ids (`<name>:latest` from Ollama,
  `<name>` from OpenAI);
- chat: /api/chat/completions as an API caller sends it (no chat saved), whole and streamed, returns text;
- ui chat: the same request as the browser sends it (a new saved chat, a session id: Open WebUI runs it as a
  background task, with its built-in tools, and saves the reply), polled until the reply is done: it has text;
- usage: the token figures Open WebUI saved with that reply (from Ollama's eval counts, from llama.cpp's
  `timings` or `usage` over OpenAI) are non-zero;
- loaded: /ollama/api/ps through Open WebUI lists the model with an `expires_at` it parses, and /api/models marks
  the Ollama entry `loaded` (Open WebUI parses `expires_at` with datetime.fromisoformat and drops it silently when
  that fails);
- reasoning: Open WebUI shows a reasoning block for a model that reasons (`thinking` in /api/show's
  capabilities); n/a for one that does not (the embedded model).

Prints a table (check, connection, result, detail), --json PATH writes it too; exit status 1 when a check fails.
Without the virtualenv Open WebUI is reported as skipped, with the command that builds it, and nothing starts
(exit 0). Both servers run as process groups of their own and are stopped however the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from kvforge.app.bench.http_client import wait_until_serving
from kvforge.app.bench.peer_engines import add_peer_options, find_peer, last_lines, say
from kvforge.app.bench.peers_http import stop_server
from kvforge.app.bench.report import error_line
from kvforge.app.http.threaded_server import free_port

OPENWEBUI = "Open WebUI 0.12.4"
SETUP = "../shared/peers/setup.sh openwebui"  # from the repository root: builds <peers dir>/openwebui
PROMPT = "Name three colours."
MAX_TOKENS = 32
LOG_TAIL_LINES = 30
# Open WebUI offline and quiet: nothing that downloads a model or calls out, no extra model requests per chat
OPENWEBUI_ENV = {
    "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1", "WEBUI_AUTH": "False", "ENABLE_OLLAMA_API": "True",
    "ENABLE_OPENAI_API": "True", "OPENAI_API_KEY": "unused", "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",
    "RAG_EMBEDDING_ENGINE": "openai", "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
    "RAG_RERANKING_MODEL_AUTO_UPDATE": "False", "WHISPER_MODEL_AUTO_UPDATE": "False",
    "ENABLE_WEB_SEARCH": "False", "ENABLE_IMAGE_GENERATION": "False", "ENABLE_IMAGE_EDIT": "False",
    "ENABLE_CODE_INTERPRETER": "False", "ENABLE_CODE_EXECUTION": "False", "ENABLE_TITLE_GENERATION": "False",
    "ENABLE_TAGS_GENERATION": "False", "ENABLE_FOLLOW_UP_GENERATION": "False",
    "ENABLE_AUTOCOMPLETE_GENERATION": "False", "ENABLE_RETRIEVAL_QUERY_GENERATION": "False",
    "ENABLE_SEARCH_QUERY_GENERATION": "False", "ENABLE_VERSION_UPDATE_CHECK": "False",
    "ENABLE_EVALUATION_ARENA_MODELS": "False", "ENABLE_MEMORIES": "False", "ENABLE_COMMUNITY_SHARING": "False",
    "ENABLE_OTEL": "False", "SCARF_NO_ANALYTICS": "true", "DO_NOT_TRACK": "true", "ANONYMIZED_TELEMETRY": "false",
    "WEBUI_SECRET_KEY": "kvforge-bench-clients",  # else it writes .webui_secret_key into its working directory
}


@dataclass
class Check:
    check: str
    connection: str  # ollama | openai | both | - (Open WebUI itself)
    result: str  # pass | fail | n/a | skipped
    detail: str = ""


# --- parsing what Open WebUI returns (pure: unit-tested) --------------------------------------------------------

def connection_models(models: list[dict], name: str) -> dict[str, list[str]]:
    """The ids /api/models lists for the served `name`, per connection (Open WebUI's owned_by: ollama | openai)."""
    found: dict[str, list[str]] = {"ollama": [], "openai": []}
    for model in models:
        model_id, owner = str(model.get("id", "")), model.get("owned_by")
        if owner in found and model_id.split(":")[0] == name.split(":")[0]:
            found[owner].append(model_id)
    return found


def stream_text(body: str) -> tuple[str, str, dict]:
    """A streamed reply's text, reasoning and last usage: SSE `data:` lines of OpenAI chunks (Open WebUI converts
    Ollama's stream to them) or, should it pass Ollama's NDJSON through, its lines. An error event raises."""
    text, reasoning, usage = [], [], {}
    for raw in body.splitlines():
        line = raw.strip()
        if line.startswith("data:"):
            line = line[len("data:"):].strip()
        if not line or line == "[DONE]" or not line.startswith("{"):
            continue
        chunk = json.loads(line)
        if chunk.get("error"):
            raise RuntimeError(f"stream error: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
        message = chunk.get("message") or {}  # Ollama NDJSON
        text.append(message.get("content") or "")
        reasoning.append(message.get("thinking") or "")
        usage = {**(chunk.get("usage") or {}), **(chunk.get("timings") or {})} or usage
    return "".join(text), "".join(reasoning), usage


def whole_text(body: dict) -> tuple[str, str]:
    """A whole reply's text and reasoning (OpenAI chat completion, as Open WebUI returns both connections')."""
    message = ((body.get("choices") or [{}])[0]).get("message") or {}
    return (message.get("content") or "", message.get("reasoning_content") or message.get("reasoning") or "")


def saved_reply(message: dict) -> tuple[str, str]:
    """The text and reasoning of an assistant message Open WebUI saved: its `content`, else the text of its
    `output` items (OpenAI Responses-style), the reasoning from the `reasoning` items (or a <details
    type="reasoning"> block in the content)."""
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    reasoning = ""
    for item in message.get("output") or []:
        parts = [p.get("text") or "" for p in item.get("content") or [] if isinstance(p, dict)]
        parts += [p.get("text") or "" for p in item.get("summary") or [] if isinstance(p, dict)]
        if item.get("type") == "reasoning":
            reasoning += "".join(parts)
        elif not content:
            text += "".join(parts)
    if '<details type="reasoning"' in text:
        reasoning = reasoning or text.split('<details type="reasoning"', 1)[1].split("</details>", 1)[0]
        text = text.rsplit("</details>", 1)[-1]
    return text.strip(), reasoning.strip()


USAGE_TOKENS = ("output_tokens", "completion_tokens", "eval_count", "predicted_n")  # as Open WebUI's normalize_usage


def usage_figures(usage: dict) -> dict:
    """The token counts of a saved reply's usage that Open WebUI shows (those that are numbers)."""
    keys = (*USAGE_TOKENS, "input_tokens", "prompt_tokens", "prompt_eval_count", "prompt_n", "cache_n", "total_tokens",
            "predicted_per_second", "response_token/s")
    return {k: usage[k] for k in keys if isinstance(usage.get(k), int | float)}


def usage_check(connection: str, usage: dict | None) -> Check:
    figures = usage_figures(usage or {})
    source = ("timings" if "predicted_n" in (usage or {}) else "eval counts" if "eval_count" in (usage or {})
              else "usage")
    out = next((figures[k] for k in USAGE_TOKENS if figures.get(k)), 0)
    ok = out > 0 and (figures.get("input_tokens") or figures.get("prompt_tokens") or 0) > 0
    detail = ", ".join(f"{k}={v:g}" for k, v in figures.items()) or f"no usage saved ({usage!r})"
    return Check("usage", connection, "pass" if ok else "fail", f"from {source}: {detail}" if figures else detail)


def loaded_check(ps: dict, models: list[dict], ollama_id: str | None) -> Check:
    """/ollama/api/ps through Open WebUI lists the model with an expires_at that datetime.fromisoformat reads (as
    Open WebUI does), and /api/models marks the Ollama entry loaded."""
    from datetime import datetime

    entry = next((m for m in ps.get("models") or [] if m.get("model") == ollama_id or m.get("name") == ollama_id),
                 None)
    if entry is None:
        return Check("loaded", "ollama", "fail", f"/ollama/api/ps does not list {ollama_id}: {json.dumps(ps)[:300]}")
    expires = entry.get("expires_at")
    try:
        when = datetime.fromisoformat(str(expires))
    except ValueError:
        return Check("loaded", "ollama", "fail", f"expires_at {expires!r} does not parse (datetime.fromisoformat)")
    listed = next((m for m in models if m.get("id") == ollama_id), {})
    if not listed.get("loaded"):
        return Check("loaded", "ollama", "fail", f"/api/models: {ollama_id} not marked loaded (expires_at {expires})")
    return Check("loaded", "ollama", "pass", f"expires_at {expires} ({when.isoformat(timespec='seconds')}); "
                                             "/api/models: loaded")


# --- the servers -------------------------------------------------------------------------------------------------

@contextmanager
def process_group(argv: list[str], env: dict, cwd: Path, log: Path, url: str, path: str, timeout: float,
                  what: str) -> Iterator[subprocess.Popen]:
    """A server in a process group of its own, its output in `log`; yields once GET `path` answers 200; stopped
    (SIGTERM to the group, then SIGKILL) however the block ends."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        try:
            wait_until_serving(proc, url, time.monotonic() + timeout, path)
        except RuntimeError as exc:
            raise RuntimeError(f"{what}: {exc}:\n{last_lines(log.read_text(errors='replace'), LOG_TAIL_LINES)}") \
                from None
        yield proc
    finally:
        stop_server(proc, grace=15)


def kvforge_argv(args: argparse.Namespace, port: int, data_dir: Path) -> list[str]:
    """`kvforge serve` as README command 1 starts it (its defaults: the embedded model), API only."""
    argv = [sys.executable, "-m", "kvforge.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--no-ui",
            "--log-level", "warning", "--data-dir", str(data_dir)]
    return argv + (["--model", str(args.model)] if args.model else [])


def openwebui_env(kvforge_url: str, port: int, data_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "OLLAMA_", "KVFORGE_"))}
    return {**env, **OPENWEBUI_ENV, "OLLAMA_BASE_URL": kvforge_url, "OPENAI_API_BASE_URL": f"{kvforge_url}/v1",
            "DATA_DIR": str(data_dir), "PORT": str(port), "HOST": "127.0.0.1"}


# --- the checks --------------------------------------------------------------------------------------------------

class OpenWebUI:
    """Open WebUI's HTTP API as its browser client calls it, with the token of WEBUI_AUTH=False's single user."""

    def __init__(self, url: str, timeout: float) -> None:
        import httpx

        self.http = httpx.Client(base_url=url, timeout=timeout)
        signin = self.http.post("/api/v1/auths/signin", json={"email": "", "password": ""})
        signin.raise_for_status()
        self.http.headers["Authorization"] = f"Bearer {signin.json()['token']}"

    def get(self, path: str) -> dict:
        response = self.http.get(path)
        response.raise_for_status()
        return response.json()

    def chat(self, model: str, stream: bool) -> tuple[str, str, dict]:
        """An API caller's chat completion (no chat saved): text, reasoning, usage."""
        payload = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": stream,
                   "max_tokens": MAX_TOKENS, "temperature": 0}
        response = self.http.post("/api/chat/completions", json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        if stream:
            return stream_text(response.text)
        body = response.json()
        return (*whole_text(body), {**(body.get("usage") or {}), **(body.get("timings") or {})})

    def ui_chat(self, model: str, deadline: float) -> dict:
        """The browser's request: a new saved chat with a session id, run by Open WebUI as a background task; the
        saved assistant message once done."""
        user_id, reply_id = str(uuid.uuid4()), str(uuid.uuid4())
        user_message = {"id": user_id, "parentId": None, "childrenIds": [reply_id], "role": "user",
                        "content": PROMPT, "timestamp": int(time.time()), "models": [model]}
        payload = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                   "params": {"max_tokens": MAX_TOKENS, "temperature": 0}, "parent_id": None,
                   "user_message": user_message, "id": reply_id, "session_id": f"kvforge-bench-{uuid.uuid4().hex}",
                   "features": {}, "variables": {}}
        response = self.http.post("/api/chat/completions", json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        chat_id = response.json().get("chat_id")
        if not chat_id:
            raise RuntimeError(f"no chat_id in {response.text[:300]}")
        while True:
            chat = self.get(f"/api/v1/chats/{chat_id}")
            message = (((chat.get("chat") or {}).get("history") or {}).get("messages") or {}).get(reply_id) or {}
            if message.get("done") or message.get("error"):
                return message
            if time.monotonic() > deadline:
                raise RuntimeError(f"the saved reply was not done in time: {json.dumps(message)[:300]}")
            time.sleep(0.5)


def served_names(kvforge_url: str) -> tuple[str, str, bool]:
    """The model as kvforge serves it: its OpenAI id, its Ollama name, and whether it reasons."""
    import httpx

    name = httpx.get(f"{kvforge_url}/v1/models", timeout=30).json()["data"][0]["id"]
    tags = httpx.get(f"{kvforge_url}/api/tags", timeout=30).json()["models"]
    tagged = tags[0]["name"] if tags else f"{name}:latest"
    show = httpx.post(f"{kvforge_url}/api/show", json={"model": tagged}, timeout=30).json()
    return name, tagged, "thinking" in (show.get("capabilities") or [])


def attempt(checks: list[Check], check: str, connection: str, run) -> object:
    """Run one check; an exception is its failure row (the other checks still run)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 (a failed check is a row, not the end of the run)
        checks.append(Check(check, connection, "fail", error_line(exc)))
        return None


def text_check(check: str, connection: str, text: str, reasoning: str, seconds: float) -> Check:
    if not text.strip():
        return Check(check, connection, "fail", f"empty text ({seconds:.1f} s)" +
                     (f"; reasoning only: {reasoning[:80]!r}" if reasoning else ""))
    return Check(check, connection, "pass", f"{len(text)} chars in {seconds:.1f} s: {text.strip()[:60]!r}")


def run_checks(webui: OpenWebUI, kvforge_url: str, timeout: float) -> list[Check]:
    checks: list[Check] = []
    name, tagged, reasons = served_names(kvforge_url)
    models = webui.get("/api/models").get("data") or []
    found = connection_models(models, name)
    ids = {"ollama": tagged if tagged in found["ollama"] else (found["ollama"] or [None])[0],
           "openai": name if name in found["openai"] else (found["openai"] or [None])[0]}
    for connection, expected in (("ollama", tagged), ("openai", name)):
        ok = found[connection] == [expected]
        checks.append(Check("models", connection, "pass" if ok else "fail",
                            f"{', '.join(found[connection]) or 'none'}" + ("" if ok else f" (expected {expected})")))
    distinct = ids["ollama"] and ids["openai"] and ids["ollama"] != ids["openai"]
    checks.append(Check("distinct ids", "both", "pass" if distinct else "fail", f"{ids['ollama']} / {ids['openai']}"))
    reasoning_seen: dict[str, str] = {}
    for connection, model in ids.items():
        if model is None:
            checks.append(Check("chat", connection, "fail", "no model listed for this connection"))
            continue
        for stream in (False, True):
            label = "chat streamed" if stream else "chat whole"
            start = time.perf_counter()
            reply = attempt(checks, label, connection, lambda m=model, s=stream: webui.chat(m, s))
            if reply is not None:
                text, reasoning, _ = reply
                checks.append(text_check(label, connection, text, reasoning, time.perf_counter() - start))
                reasoning_seen[connection] = reasoning_seen.get(connection) or reasoning
        start = time.perf_counter()
        message = attempt(checks, "ui chat", connection,
                          lambda m=model: webui.ui_chat(m, time.monotonic() + timeout))
        if message is not None:
            if message.get("error"):
                checks.append(Check("ui chat", connection, "fail", f"error saved: {message['error']}"))
            else:
                text, reasoning = saved_reply(message)
                checks.append(text_check("ui chat", connection, text, reasoning, time.perf_counter() - start))
                reasoning_seen[connection] = reasoning_seen.get(connection) or reasoning
            checks.append(usage_check(connection, message.get("usage")))
    ps = attempt(checks, "loaded", "ollama", lambda: webui.get("/ollama/api/ps"))
    if ps is not None:
        checks.append(loaded_check(ps, webui.get("/api/models").get("data") or [], ids["ollama"]))
    for connection in ids:
        if not reasons:
            checks.append(Check("reasoning", connection, "n/a", "the model does not reason (no `thinking` capability)"))
        else:
            seen = reasoning_seen.get(connection, "")
            checks.append(Check("reasoning", connection, "pass" if seen else "fail",
                                f"{len(seen)} chars: {seen[:50]!r}" if seen else "no reasoning shown"))
    return checks


# --- the command -------------------------------------------------------------------------------------------------

def print_table(report: dict) -> None:
    print(f"{report['client']} against `kvforge serve` ({report['model']}); {report['seconds']:.0f} s")
    rows = [("check", "connection", "result", "detail")] + [
        (c["check"], c["connection"], c["result"], c["detail"]) for c in report["checks"]]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    failed = sum(c["result"] == "fail" for c in report["checks"])
    print(f"{failed} failed" if failed else "all passed" if report["status"] == "ran" else report["status"])


def run_clients(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    report = {"client": OPENWEBUI, "model": args.model or "the embedded model", "status": "ran", "checks": []}
    python, why = find_peer("openwebui", args)
    if python is None:
        report["status"] = "skipped"
        report["checks"] = [asdict(Check("Open WebUI", "-", "skipped", f"{why}; to build it, run {SETUP} "
                                         "(~10 minutes, ~1 GB) from the repository root"))]
    else:
        report["python"] = python
        # SIGTERM as an exception, so that the servers' process groups are stopped on the way out (they run in
        # sessions of their own: nothing else would stop them)
        previous = signal.signal(signal.SIGTERM, terminated)
        try:
            report["checks"] = [asdict(c) for c in drive_openwebui(args, python)]
        finally:
            signal.signal(signal.SIGTERM, previous)
    report["seconds"] = time.perf_counter() - start
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if any(c["result"] == "fail" for c in report["checks"]) else 0


def terminated(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def drive_openwebui(args: argparse.Namespace, python: str) -> list[Check]:
    """Start both servers, run the checks, stop both (a server that does not start is one failed row)."""
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-clients-") as tmp, ExitStack() as servers:
        work = Path(tmp)
        (work / "kvforge").mkdir()
        (work / "openwebui").mkdir()
        kv_port, ui_port = free_port(), free_port()
        kvforge_url, ui_url = f"http://127.0.0.1:{kv_port}", f"http://127.0.0.1:{ui_port}"
        env = {**os.environ, "KVFORGE_DATA_DIR": str(work / "kvforge")}
        env.pop("KVFORGE_DB", None)  # the sessions in the temporary data directory
        stage = "start"  # the row a failure is reported as: start (a server), then checks (sign-in, model lists)
        try:
            say(f"starting kvforge serve on {kvforge_url}", "clients")
            servers.enter_context(process_group(kvforge_argv(args, kv_port, work / "kvforge"), env, work,
                                                work / "kvforge.log", kvforge_url, "/health", args.timeout,
                                                "kvforge serve"))
            say(f"starting Open WebUI ({python}) on {ui_url}", "clients")
            command = Path(python).with_name("open-webui")
            argv = ([str(command)] if command.exists() else [python, "-m", "open_webui"]) + [
                "serve", "--host", "127.0.0.1", "--port", str(ui_port)]
            servers.enter_context(process_group(argv, openwebui_env(kvforge_url, ui_port, work / "openwebui"),
                                                work / "openwebui", work / "openwebui.log", ui_url, "/health",
                                                args.timeout, "Open WebUI"))
            say("both up: running the checks", "clients")
            stage = "checks"
            return run_checks(OpenWebUI(ui_url, args.timeout), kvforge_url, args.timeout)
        except Exception as exc:  # noqa: BLE001 (reported as a failed row; the servers still stop)
            log = work / "openwebui.log"
            tail = f"\n{last_lines(log.read_text(errors='replace'), LOG_TAIL_LINES)}" if log.exists() else ""
            say(f"failed: {exc}{tail}", "clients")
            return [Check(stage, "-", "fail", error_line(exc))]


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `clients` on the `kvforge bench` subcommands."""
    parser = bench_sub.add_parser(
        "clients", help=f"drive a real {OPENWEBUI} (when its virtualenv is in the peers dir) against a real "
                        "`kvforge serve` through both its connections; a pass / fail table (run before each release)")
    parser.add_argument("--model", default=None, help="the model kvforge serves (default: the embedded one)")
    add_peer_options(parser, ("openwebui",), f"skip {OPENWEBUI}")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds for each server to start and for each request (default: 600)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    parser.set_defaults(func=run_clients)
    return parser
