"""The browser UI: a Gradio page mounted in the `kvforge serve` process (UI at /, API at /v1), assembled from the
chat (ui/chat.py), the Model settings panel (ui/settings.py) and the live dashboard (ui/dashboard.py), all three
reading and changing the app through one UIService (ui/service.py).

Nothing is fetched from outside 127.0.0.1: a built-in theme with bundled fonts, no analytics, no model hub.
Gradio reads its switches when it is imported, so build_ui sets them first and every `import gradio` in ui/
sits inside a function that runs after it; importing this module changes nothing in the process.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from kvforge.app.sessions.service import ChatService
from kvforge.core.private_files import private_dir
from kvforge.ui.dashboard import DashboardSampler

if TYPE_CHECKING:
    import gradio as gr

# set before gradio is imported (unless the environment says otherwise): no analytics, no hub lookups
GRADIO_ENVIRONMENT = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
CSS = """
#reply-stats { font-size: 0.85em; opacity: 0.8; }
#dashboard table { font-size: 0.85em; }
#branches { gap: 2px; }
#branches .branch-point { align-items: center; gap: 4px; }
#branches .branch-label { font-size: 0.85em; }
.conversation-group { padding-top: 2px; padding-bottom: 2px; }
"""
# Gradio's queue looks for new events every 1 ms and for progress updates every 10 ms, also while nobody has the
# page open: ~1100 wakeups a second of the event loop the API streams on, each taking the GIL. Measured with
# `kvforge bench serve` (64 streams x 64 tokens, 2 busy cores): the server's main thread used 2.1 s of CPU in a
# ~37 s run, 0.3 s of it without the UI, 0.5 s with these intervals. Soon enough for a person clicking.
QUEUE_POLL_S, PROGRESS_POLL_S = 0.02, 0.1


def apply_gradio_environment() -> None:
    """The offline switches, for the whole process (a variable already set is kept); gradio's files (uploads, the
    chat's pictures) in a directory only this user can read, not in the shared /tmp/gradio."""
    for name, value in GRADIO_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if "GRADIO_TEMP_DIR" not in os.environ:
        os.environ["GRADIO_TEMP_DIR"] = str(private_dir(tempfile.mkdtemp(prefix="kvforge-gradio-")))


def build_ui(chat: ChatService, sampler: DashboardSampler) -> gr.Blocks:
    """The page: conversations and chat on the left, Model settings and the dashboard on the right."""
    apply_gradio_environment()
    import gradio as gr

    from kvforge.ui.chat import add_chat
    from kvforge.ui.dashboard import add_dashboard
    from kvforge.ui.service import UIService
    from kvforge.ui.settings import add_settings

    service = UIService(chat, sampler)
    with gr.Blocks(title="kvforge") as demo:
        with gr.Row():
            add_chat(demo, service)
            with gr.Column(scale=2, min_width=280):
                add_settings(demo, service)
                add_dashboard(demo, service)
    demo.queue(default_concurrency_limit=None)
    slow_queue_polling(demo)
    return demo


def slow_queue_polling(demo: gr.Blocks) -> None:
    """Poll gradio's event queue every QUEUE_POLL_S (its own default: 1 ms); gradio has no setting for it, so this
    sets the queue's attributes when they are there (and changes nothing otherwise)."""
    queue = getattr(demo, "_queue", None)
    for name, seconds in (("sleep_when_free", QUEUE_POLL_S), ("progress_update_sleep_when_free", PROGRESS_POLL_S)):
        if isinstance(getattr(queue, name, None), int | float):
            setattr(queue, name, max(getattr(queue, name), seconds))


def mount_ui(app, chat: ChatService, sampler: DashboardSampler | None = None):
    """Serve the UI at / of the FastAPI app (its /v1 routes are defined first, so they keep working); the
    dashboard samples the host and metrics of `chat` (a sampler of its own, on app.state.sampler, unless given).
    create_app takes it as its `ui` (app/server.py does not import the UI: the CLI composes the two)."""
    if sampler is None:
        sampler = app.state.sampler = DashboardSampler(chat.context.host, chat.context.metrics).start()
    demo = build_ui(chat, sampler)  # first: it sets the environment gradio is imported under
    import gradio as gr

    from kvforge.ui.chat_view import TOOLTIP_SCRIPT

    return gr.mount_gradio_app(app, demo, path="/", theme=gr.themes.Default(), css=CSS, footer_links=[],
                               head=TOOLTIP_SCRIPT)
