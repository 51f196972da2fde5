"""Gradio's event queue, as build_ui leaves it: polled every QUEUE_POLL_S, not every 1 ms (gradio's default),
which woke the event loop the API streams on ~1000 times a second (no browser needed)."""

from __future__ import annotations

from types import SimpleNamespace

from kvforge.ui.app import PROGRESS_POLL_S, QUEUE_POLL_S, apply_gradio_environment, slow_queue_polling


def test_gradio_queue_polls_at_our_intervals():
    apply_gradio_environment()
    import gradio as gr

    with gr.Blocks() as demo:
        gr.Markdown("x")
    demo.queue(default_concurrency_limit=None)
    assert isinstance(demo._queue.sleep_when_free, float)  # if this fails, gradio changed its queue: look again
    slow_queue_polling(demo)
    assert demo._queue.sleep_when_free == QUEUE_POLL_S
    assert demo._queue.progress_update_sleep_when_free == PROGRESS_POLL_S


def test_a_queue_without_those_attributes_is_left_alone():
    demo = SimpleNamespace(_queue=SimpleNamespace(other=1))
    slow_queue_polling(demo)
    assert vars(demo._queue) == {"other": 1}
    slow_queue_polling(SimpleNamespace())  # no queue at all
