"""`kvforge serve`: the settings resolved (flags, KVFORGE_*, TOML, defaults), the store opened, the first
engine built, then uvicorn until SIGTERM / Ctrl-C (open streams end with a final chunk).

Stopping is bounded whatever threads are doing: requests get GRACEFUL_SHUTDOWN_S to finish (then they are
cancelled), the engines (writing their queued KV blocks) and the store get what is left of SHUTDOWN_DEADLINE_S, and
the process then ends without waiting for threads a request left behind (a download, a stuck render: the interpreter
would join them at exit). Should a thread hold the interpreter so that none of this can run, the exit watchdog
(app/cli/exit_watchdog.py) kills the process at SHUTDOWN_DEADLINE_S.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import threading

from kvforge.app.settings import GIB, ServeSettings, json_options, keep_alive_seconds, resolve

GRACEFUL_SHUTDOWN_S = 5  # after SIGTERM / Ctrl-C: open requests may finish within this, then they are cancelled
SHUTDOWN_DEADLINE_S = 10  # ... and the process is gone within this (closing gets the rest; the watchdog enforces it)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def served_model_name(settings: ServeSettings) -> str:
    from pathlib import Path

    from kvforge.core.loader import EMBEDDED_ALIASES, EMBEDDED_MODEL

    if settings.served_model_name:
        return settings.served_model_name
    if settings.model in EMBEDDED_ALIASES:
        return EMBEDDED_MODEL
    return Path(settings.model).stem if Path(settings.model).exists() else settings.model


UI_ENTRY_POINTS = "kvforge.ui"  # the group the browser UI is installed under (pyproject.toml)


def browser_ui(name: str = "gradio"):
    """The browser UI's mount (kvforge.ui.app.mount_ui), found by its entry point: the app does not import the UI
    package, which is built over the app's sessions API."""
    found = [ep for ep in importlib.metadata.entry_points(group=UI_ENTRY_POINTS) if ep.name == name]
    if not found:
        sys.exit(f"kvforge serve: no browser UI {name!r} is installed (the {UI_ENTRY_POINTS!r} entry points; "
                 "reinstall kvforge, or serve with --no-ui)")
    return found[0].load()


def cmd_serve(args: argparse.Namespace) -> int:
    settings = resolve(args)  # a bad tp from the settings file or KVFORGE_TP fails here, before anything starts
    if args.api_key is not None:
        print("kvforge: warning: --api-key on the command line is visible to other users (ps); set KVFORGE_API_KEY "
              "or use --api-key-file", file=sys.stderr, flush=True)
    if not is_loopback(settings.host) and not settings.api_key:
        raise ValueError(f"refusing to bind {settings.host} without an API key: set KVFORGE_API_KEY or pass "
                         "--api-key-file, or bind 127.0.0.1")
    import time
    from pathlib import Path

    import uvicorn

    from kvforge.app.cli.exit_watchdog import ExitWatchdog
    from kvforge.app.http.access import AccessPolicy, split_list
    from kvforge.app.http.limits import connection_limits
    from kvforge.app.models.factory import build_async_engine, spec_from_settings
    from kvforge.app.models.host import ModelHost
    from kvforge.app.models.spec import ModelSpec
    from kvforge.app.server import create_app
    from kvforge.core import AsyncEngine
    from kvforge.core.async_engine import build_off_main_thread
    from kvforge.core.kv.sql_index import SQLKVIndex
    from kvforge.core.private_files import private_dir
    from kvforge.core.store import Store, default_data_dir, default_db_url

    data_dir = private_dir(settings.data_dir if settings.data_dir else default_data_dir())
    db_url = settings.db or default_db_url(data_dir)
    store = Store(db_url)  # created (or upgraded) on first start; closed when serving ends
    kv_index = SQLKVIndex(store)  # the sessions API and every engine (first model, swaps) share the one store
    persist = dict(persist_kv=not settings.no_persist_kv, data_dir=str(data_dir), db_url=db_url,
                   kv_disk_budget_bytes=int(settings.kv_disk_gb * GIB))

    def factory(spec: ModelSpec) -> AsyncEngine:  # the first model and every swap
        return build_async_engine(spec, settings, on_fatal=stop_serving, kv_index=kv_index, **persist)

    fatal: list[str] = []

    def stop_serving(why: str) -> None:
        """A tensor-parallel rank died: say so, shut down (open streams have failed already), exit 1."""
        print(f"kvforge: error: {why}; shutting down", file=sys.stderr, flush=True)
        fatal.append(why)
        server.should_exit = True

    spec = spec_from_settings(settings, served_model_name(settings))
    first = build_off_main_thread(lambda: factory(spec))
    host = ModelHost(factory, spec, first, Path(settings.models_dir).expanduser() if settings.models_dir else None,
                     max_loaded_models=settings.max_loaded_models,
                     models_memory_bytes=int(settings.models_memory_gb * GIB) if settings.models_memory_gb else None,
                     keep_alive_s=keep_alive_seconds(settings.keep_alive),
                     aliases=json_options(settings.model_aliases, "--model-aliases"),
                     kv_bytes=int(settings.kv_cache_gb * GIB) if settings.kv_cache_gb else None,
                     embedding_model=settings.embedding_model)
    access = AccessPolicy(settings.api_key, settings.host, split_list(settings.allowed_hosts),
                          split_list(settings.allowed_origins))
    # the composition root: the app's routes, and the UI over them unless --no-ui
    app = create_app(host, max_pending=settings.max_pending, default_max_tokens=settings.default_max_tokens,
                     store=store, ui=None if settings.no_ui else browser_ui(), access=access,
                     max_request_bytes=settings.max_request_bytes, request_timeout_s=settings.request_timeout,
                     context_overflow=settings.context_overflow,
                     image_url_hosts=split_list(settings.image_url_hosts))

    watchdog = ExitWatchdog(SHUTDOWN_DEADLINE_S)

    class GracefulServer(uvicorn.Server):
        stop_signal: int | None = None
        stop_started: float | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            watchdog.arm()  # uvicorn's signal handlers are in place: the watchdog's runs first, then theirs

        def handle_exit(self, sig, frame) -> None:
            # SIGTERM / Ctrl-C: end every open stream now (each gets its final chunk), then shut down
            if self.stop_signal is None:
                self.stop_signal, self.stop_started = sig, time.monotonic()
            for _, engine, _, _ in host.loaded():
                engine.abort_all()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)  # requests: GRACEFUL_SHUTDOWN_S, then cancelled
            # Close engines (writing queued KV blocks to disk) and the store, then end the process here: after
            # serving, uvicorn re-raises the signal (SIGINT: KeyboardInterrupt, and the interpreter would then
            # join every thread a request left running).
            started = self.stop_started or time.monotonic()
            if not close_within(host, store, SHUTDOWN_DEADLINE_S - 1 - (time.monotonic() - started)):
                print("kvforge: warning: the engines did not close in time; exiting without them", file=sys.stderr)
            exit_now(self.stop_signal, 1 if fatal else 0)

    # proxy_headers=False: a client's address is its connection's. uvicorn would take it from the X-Forwarded-For
    # of any local process, which could then name a new address for each wrong key it tries (app/http/key_throttle.py
    # counts them per address).
    server = GracefulServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, proxy_headers=False,
                                           **connection_limits(settings)))
    ui = "" if settings.no_ui else f"chat UI on http://{settings.host}:{settings.port}/, "
    print(f"kvforge: serving {spec.name}: {ui}API on http://{settings.host}:{settings.port}/v1 "
          f"(sessions: {store.engine.url.render_as_string()}; KV on disk: "
          f"{'off' if settings.no_persist_kv else data_dir / 'kv'}; {runs_on(first.engine)})", flush=True)
    del first  # the host owns it: a model swap must be able to free it
    try:
        server.run()
    finally:
        host.close()
        store.close()
    return 1 if fatal else 0


def close_within(host, store, timeout_s: float) -> bool:
    """Close the engines and the store (and run the exit handlers: temporary files, worker pools) in a thread, for
    at most `timeout_s`; whether it finished."""
    import atexit

    def close() -> None:
        host.close()
        store.close()
        atexit._run_exitfuncs()

    closing = threading.Thread(target=close, name="kvforge-close", daemon=True)
    closing.start()
    closing.join(max(timeout_s, 0.5))
    return not closing.is_alive()


def exit_now(stop_signal: int | None, code: int) -> None:
    """End the process without waiting for other threads: by the signal that stopped it, as uvicorn does (a
    supervisor sees "killed by SIGTERM"), else with `code`."""
    import logging
    import os
    import signal

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if stop_signal is not None:
        signal.signal(stop_signal, signal.SIG_DFL)
        signal.raise_signal(stop_signal)
    os._exit(code)


def runs_on(engine) -> str:
    """Where and how the engine runs, e.g. "cuda:0, bfloat16, Triton kernels, CUDA graphs, KV 61.2 GiB"."""
    runtime = engine.runtime()
    parts = [runtime.device, engine.config.dtype, f"{runtime.kernels.capitalize()} kernels"]
    if runtime.cuda_graphs:
        parts.append("CUDA graphs")
    chosen = sorted(set(runtime.kernel_choices.values()))  # timed on this CPU at load (core/kernel_choice.py)
    if chosen:
        parts.append(f"{' + '.join(chosen)} chosen by timing")
    parts.append(f"KV {runtime.kv_cache_bytes / GIB:.2f} GiB")
    if len(runtime.stages) > 1:  # pipeline stages: which layers each holds
        parts.append("stages " + " + ".join(f"layers {s['layers'][0]}-{s['layers'][1] - 1}" for s in runtime.stages))
    return ", ".join(parts)
