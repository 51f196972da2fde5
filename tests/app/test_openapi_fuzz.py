"""Schemathesis (a fuzzer we did not write) against the /openapi.json of a real `kvforge serve`: for every
operation the schema lists, a bounded, reproducible number of generated requests (valid ones and ones
that break the schema), each sent with the API key. None may get a 5xx, every error response is exactly
its API's error shape (OpenAI's; Ollama's under /api/), and responses conform to the schema where it
declares one.

The server runs as a user starts it (the key from KVFORGE_API_KEY, the browser UI mounted at /: requests that fall
through the API routes reach Gradio, which is part of what is fuzzed), on a tiny random-weight Llama with the
embedded model's tokenizer, chat template and context length, and one torch thread: the fuzzer's ~350 valid
generation requests are about the API, not the weights, and each costs tens of milliseconds (with a second thread,
on a busy machine every OpenMP barrier waits for a core: ~0.7 s a request).

Bounded work per request: generation length and width are not what is fuzzed here (test_server_robustness
does), so before a generated request is sent, numbers that only make the model run longer or wider are
clamped (see `_bound`); a request the schema rejects keeps its invalid value. The admin routes that swap the
model are fuzzed last (test_model_swaps) with the same treatment: a load may swap the model (the embedded one
only: the server has no --models-dir), but never with more than one tensor-parallel rank or a KV budget above
_KV_GB_CAP; after a load or an unload the default (embedded) model is loaded back, so the swaps fuzzed next start
from a server with a model.

Debugging: KVFORGE_FUZZ_REPORT=<file> keeps going after a failure (every failing request is appended to
the file as a JSON line: method, path, body, status, response) instead of stopping at the first one of
each operation."""

from __future__ import annotations

import json
import math
import os
import sys
import zlib

import httpx
import pytest

if sys.version_info < (3, 11):
    pytest.skip("schemathesis 4 needs Python 3.11 or later", allow_module_level=True)

import schemathesis  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core import NotSet  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

from tests.helpers.api_checks import assert_api_error, lax_number  # noqa: E402
from tests.helpers.server_process import ServeProcess  # noqa: E402

API_KEY = "fuzz-key-789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 6  # per operation in the fuzzing phase (valid and invalid together); the coverage phase adds its own
MAX_TOKENS_CAP = 4  # tokens a generated request may ask for (also --default-max-tokens)
N_CAP = 2  # sequences per request; values above the schema's own limit (64) are kept to be refused
N_INPUTS_CAP = 4  # inputs of an embeddings request (the schema allows 2048)
_KV_GB_CAP = 0.25  # GiB of KV a fuzzed model load may ask for (the schema allows up to 4096)
SESSIONS = 6  # conversations created up front, so that session ids in paths sometimes exist

# schemathesis's own settings (its TOML config keys): both generation modes, a fixed seed and Hypothesis'
# derandomized mode (a CI run is reproducible), no example database, no deadline (a request can wait for a
# model swap), and none of the health checks that fire on a slow server.
CONFIG = {
    "seed": 19,
    "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large", "large_base_example"],
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
    "request-timeout": 120,
    "headers": AUTH,
    # An accepted load rebuilds the engine (~2.5 s here, twice: see _restore): the coverage phase's ~90
    # bodies for this one operation held ~18 of them (~50 s). Its fuzzing phase (MAX_EXAMPLES) still runs.
    "operations": [{"include-path": "/admin/models/load", "phases": {"coverage": {"enabled": False}}}],
}

# The checks that apply to this schema (FastAPI's, generated from the routes):
# - not_a_server_error: no 5xx, ever (a 503 "no model loaded" cannot happen: an unload is undone at once).
# - response_schema_conformance: a body validates against the schema of its documented status; today the
#   200s are declared as "anything" and the 422 as FastAPI's HTTPValidationError (which kvforge never
#   sends: it answers 400), so this catches little until the schema documents the error responses.
# - the error shape of every response >= 400 (OpenAI's, Ollama's under /api/): our own check, below.
# Left out: status_code_conformance and content_type_conformance (the schema documents neither kvforge's
# 400 / 401 / 404 / 413 / 503 nor /metrics' text/plain and the SSE streams, so they would only report that
# the schema is incomplete); positive_data_acceptance (a schema-valid request may rightly be refused: an
# unknown model name or session id, a prompt too long for the context); negative_data_rejection (pydantic's
# lax mode takes 0 / 1 for booleans, false for numbers and 1.0 for integers, which the schema calls invalid;
# and the clamping below makes some invalid values valid); the stateful checks (no stateful phase here).
CHECKS = [not_a_server_error, response_schema_conformance]

schema = schemathesis.pytest.from_fixture("api_schema")
SWAPS = "^/admin/models/(load|unload)$"  # swap the served model: fuzzed last, by test_model_swaps


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request):
    """schemathesis 4.32's from_fixture reads and renames `request.node._nodeid`, which pytest 9.2 no longer
    has (it keeps the id in `_id`): give it one to read (its renaming is then cosmetic only)."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_path):
    from kvforge.core.loader import load_config
    from tests.helpers.tiny_models import save_tiny_model, tiny_configs

    model = tmp_path_factory.mktemp("fuzz-model") / "tiny-llama"
    config = tiny_configs()["llama3"]
    config.max_position_embeddings = load_config(embedded_path).max_position_embeddings
    save_tiny_model("llama3", model, embedded_path, seed=0, config=config, chat_template=True)
    data_dir = tmp_path_factory.mktemp("fuzz-data")
    process = ServeProcess("--model", str(model), "--threads", "1", "--data-dir", str(data_dir),
                           "--default-max-tokens", str(MAX_TOKENS_CAP), env={"KVFORGE_API_KEY": API_KEY})
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def session_ids(client):
    """Conversations that exist (two of them with a message), substituted into some generated paths."""
    ids = []
    for i in range(SESSIONS):
        response = client.post("/v1/sessions", json={"title": f"fuzz {i}",
                                                    "sampling": {"max_tokens": MAX_TOKENS_CAP}})
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    for session_id in ids[:2]:
        response = client.post(f"/v1/sessions/{session_id}/messages", json={"content": "Hi", "stream": False})
        assert response.status_code == 200, response.text
    return ids


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH, timeout=60,
                                         config=schemathesis.Config.from_dict(CONFIG))


def _cap(body: dict, key: str, cap: float, limit: float = math.inf) -> None:
    """body[key] = cap where it reads as a number in (cap, limit]: the request stays as valid or as
    invalid as it was, only cheaper."""
    number = lax_number(body.get(key))
    if number is not None and cap < number <= limit:
        body[key] = cap


def _bound(body) -> None:
    """Clamp what would make one request expensive (generation length and width, an embeddings batch, a model
    load's tensor-parallel ranks and KV budget), in place. Session bodies carry sampling defaults for later replies."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        _cap(body, key, MAX_TOKENS_CAP)
    _cap(body, "n", N_CAP, limit=64)
    _cap(body, "tp", 1)  # each rank is a process loading the model
    _cap(body, "kv_cache_gb", _KV_GB_CAP, limit=4096)  # the KV pool is allocated up front
    if isinstance(body.get("sampling"), dict):
        _bound(body["sampling"])
    if isinstance(body.get("input"), list) and len(body["input"]) > N_INPUTS_CAP:  # embeddings: one request each
        body["input"] = body["input"][:N_INPUTS_CAP]
    options = body.get("options")  # Ollama's; num_predict -1 / -2 fill the context
    if isinstance(options, dict):
        if options.get("num_predict") in (-1, -2):
            options["num_predict"] = MAX_TOKENS_CAP
        _cap(options, "num_predict", MAX_TOKENS_CAP)


def _use_existing_session(case, session_ids: list[str]) -> None:
    """In about half of the cases, the session id in the path becomes one that exists: which ones is a pure
    function of the generated case (its path and body, as the coverage phase repeats one id with many
    bodies), so a run is reproducible and a failing example still shrinks."""
    path = case.path_parameters or {}
    if "session_id" in path:
        pick = zlib.crc32(json.dumps([path, case.body], sort_keys=True, default=repr).encode())
        if pick % 2 == 0:
            path["session_id"] = session_ids[(pick // 2) % len(session_ids)]


def _restore(case, response, client: httpx.Client, session_ids: list[str]) -> None:
    """Undo what would change the ground under the operations fuzzed next."""
    if response.status_code != 200:
        return
    if case.method.upper() == "POST" and case.path in ("/admin/models/load", "/admin/models/unload"):
        # the default model again (a fuzzed load may have left a tiny KV pool or another served name)
        reload = client.post("/admin/models/load", json={"model": "embedded"})
        assert reload.status_code == 200, reload.text
    elif case.method.upper() == "DELETE" and case.path == "/v1/sessions/{session_id}":
        gone = case.path_parameters["session_id"]
        if gone in session_ids:
            fresh = client.post("/v1/sessions", json={"title": "fuzz"})
            assert fresh.status_code == 200, fresh.text
            session_ids[session_ids.index(gone)] = fresh.json()["id"]


def _json_or_repr(value):
    if isinstance(value, NotSet):
        return None
    return value if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)


def _describe(case, response) -> str:
    body = "(no body)" if isinstance(case.body, NotSet) else json.dumps(_json_or_repr(case.body), default=repr)
    return f"{case.method.upper()} {case.formatted_path} {body[:1000]} -> {response.status_code} {response.text[:1000]}"


def _report(case, response, error: BaseException) -> None:
    with open(os.environ["KVFORGE_FUZZ_REPORT"], "a") as out:
        out.write(json.dumps({
            "operation": f"{case.method.upper()} {case.path}", "path": case.formatted_path,
            "body": _json_or_repr(case.body), "query": _json_or_repr(case.query),
            "headers": {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"},
            "status": response.status_code if response is not None else None,
            "response": response.text[:2000] if response is not None else None,
            "error": f"{type(error).__name__}: {error}"[:2000]}, default=repr) + "\n")


@schema.exclude(path_regex=SWAPS).parametrize()
def test_openapi_operations(case, client, session_ids):
    """Every operation but the model swaps, on the model the server started with."""
    _fuzz(case, client, session_ids)


@schema.include(path_regex=SWAPS).parametrize()
def test_model_swaps(case, client, session_ids):
    """Loads and unloads (each success undone by loading the embedded model), after every other operation."""
    _fuzz(case, client, session_ids)


def _fuzz(case, client, session_ids) -> None:
    _bound(case.body)
    _use_existing_session(case, session_ids)
    response = None
    try:
        response = case.call(headers=AUTH)
        _restore(case, response, client, session_ids)
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            try:
                assert_api_error(response, case.path)
            except AssertionError as exc:
                raise AssertionError(f"not its API's error shape ({exc}): {_describe(case, response)}") from None
    except (Exception, FailureGroup) as exc:  # FailureGroup: schemathesis' checks, an exception group
        if not os.environ.get("KVFORGE_FUZZ_REPORT"):
            raise
        _report(case, response, exc)
