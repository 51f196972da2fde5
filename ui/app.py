"""The browser UI: a Gradio chat mounted in the `kvforge serve` process (UI at /, API at /v1).

Conversations come from the session store (the same ChatService as /v1/sessions, so a reload or a
restart shows the same history); replies stream; Stop aborts the request (the partial reply is
kept); Regenerate and Edit rework the last turn. Model settings (model, dtype, quant plugin and its
options, speculative decoding plugin and its options, KV budget, tensor-parallel ranks) swap through
the same ModelHost as the admin API: in-flight replies finish first, a refused choice keeps the old
model (not when both are tensor-parallel: see ModelHost.load). The dashboard
reads the one server-side sampler every second. Nothing is fetched from outside 127.0.0.1: a built-in
theme with bundled fonts, no analytics (GRADIO_ANALYTICS_ENABLED is off before gradio is imported).
"""

from __future__ import annotations

import os

for _name, _value in (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_OFFLINE", "1"),
                      ("HF_HUB_DISABLE_TELEMETRY", "1")):
    os.environ.setdefault(_name, _value)

import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gradio as gr  # noqa: E402 - after the offline switches above
import pandas as pd  # noqa: E402

from kvforge.app.cache import human_bytes  # noqa: E402
from kvforge.app.chat_service import DEFAULT_TITLE, ChatService  # noqa: E402
from kvforge.app.errors import APIError  # noqa: E402
from kvforge.app.models import ModelSpec  # noqa: E402
from kvforge.core.estimate import estimate_memory  # noqa: E402
from kvforge.core.loader import EMBEDDED_ALIASES, EMBEDDED_MODEL, load_config, resolve_model  # noqa: E402
from kvforge.core.plugins import DECODING_GROUP, QUANT_GROUP, discover, resolve_quant  # noqa: E402
from kvforge.core.store import Conversation, NotFound  # noqa: E402
from kvforge.ui.dashboard import DashboardSampler  # noqa: E402

KV_BUDGET_INFO = ("Empty: the server's --kv-cache-gb, or without one automatic: 1 GiB on CPU; on a GPU, what "
                  "--gpu-memory-utilization leaves after the weights.")
CSS = """
#reply-stats { font-size: 0.85em; opacity: 0.8; }
#dashboard table { font-size: 0.85em; }
"""


def reply_stats_markdown(message: dict | None) -> str:
    """Per-reply stats under the chat: tokens, tok/s, TTFT, cached tokens."""
    if not message or message.get("role") != "assistant":
        return ""
    parts = [f"{message.get('completion_tokens', '?')} tokens"]
    if message.get("tokens_per_s"):
        parts.append(f"{message['tokens_per_s']:.1f} tok/s")
    if message.get("ttft_s") is not None:
        parts.append(f"TTFT {message['ttft_s'] * 1000:.0f} ms")
    parts.append(f"{message.get('cached_tokens') or 0} cached tokens")
    if message.get("finish_reason") == "abort":
        parts.append("stopped")
    return "Last reply: " + " · ".join(parts)


def dashboard_markdown(sampler: DashboardSampler) -> str:
    s = sampler.latest()
    st = s.stats
    if not st:
        return "**No model loaded**"
    decoding = s.config.get("decoding") or "none"
    tp = s.config.get("tp") or 1
    header = (f"**Model** {s.model} · {s.config.get('dtype')} · quant **{s.config.get('quant')}** · "
              f"decoding **{decoding}**" + (f" · tp **{tp}**" if tp > 1 else ""))
    lines = [header, "", "| Engine | Now |", "|---|---|"]
    if s.gpus:
        for g in s.gpus:
            lines.append(f"| VRAM {g['device']} | {human_bytes(g['used'])} / {human_bytes(g['total'])} |")
    else:
        lines.append(f"| Process RSS | {human_bytes(s.rss_bytes)} |")
    lines += [
        f"| KV pool | {human_bytes(st['kv_cache_bytes'])}"
        + (" (automatic)" if s.config.get("kv_cache_bytes") is None else "") + " |",
        f"| KV blocks used / cached / free | {st['kv_blocks_used']} / {st['kv_blocks_cached']} / "
        f"{st['kv_blocks_free']} |",
        f"| Requests running / waiting | {st['running']} / {st['waiting']} |",
        f"| Generation tok/s | {st['generation_tokens_per_s']:.1f} |",
        f"| Prefix cache hit rate | {st['prefix_cache_hit_rate'] * 100:.0f}% |",
    ]
    if decoding != "none":  # speculation: how many drafts the target accepts, tokens gained per step
        lines += [
            f"| Draft acceptance rate | {st.get('spec_acceptance_rate', 0.0) * 100:.0f}% "
            f"({st.get('spec_accepted_tokens_total', 0)} / {st.get('spec_drafted_tokens_total', 0)}) |",
            f"| Mean accepted length | {st.get('spec_mean_accepted_length', 0.0):.2f} tokens per step |",
        ]
    if s.config.get("persist_kv"):
        lines.append(f"| KV on disk | {st['kv_disk_blocks']} blocks, {human_bytes(st['kv_disk_bytes'])} |")
    ttfts = sampler.recent_ttfts()[-5:]
    if ttfts:
        lines.append(f"| Recent TTFT | {', '.join(f'{t * 1000:.0f} ms' for t in reversed(ttfts))} |")
    return "\n".join(lines)


def throughput_frame(sampler: DashboardSampler) -> pd.DataFrame:
    samples = sampler.history()
    if not samples:
        return pd.DataFrame({"seconds ago": [], "tok/s": []})
    now = samples[-1].time
    return pd.DataFrame({"seconds ago": [round(s.time - now, 1) for s in samples],
                         "tok/s": [s.stats.get("generation_tokens_per_s", 0.0) for s in samples]})


def current_model_name(host) -> str:
    model = host.spec.model
    return EMBEDDED_MODEL if model in EMBEDDED_ALIASES else Path(model).name


def memory_estimate_markdown(host, model: str, dtype: str, context_tokens: float, quant: str = "none",
                             options: str = "{}", tp: float | None = 1) -> str:
    """Weights (at the quant plugin's bits per weight; a quantized checkpoint decides its own) + KV for
    the chosen context length, before anything is loaded."""
    try:
        if model in EMBEDDED_ALIASES:
            path = resolve_model(None)
        elif host.models_dir is not None and (host.models_dir / model / "config.json").is_file():
            path = host.models_dir / model
        else:
            return f"No estimate for {model!r} before it is converted (GGUF)."
        hf_config = load_config(path)
        quant, quant_options = resolve_quant(quant or "none", json.loads(options or "{}"), hf_config, path)
        bits = discover(QUANT_GROUP).get(quant).bits_per_weight(quant_options)
        ranks = int(tp or 1)
        e = estimate_memory(hf_config, dtype, int(context_tokens), bits, tp_size=ranks)
    except Exception as exc:  # a broken config or option: say so, never break the page
        return f"No estimate: {type(exc).__name__}: {exc}"
    layers = f"{quant} at {bits:.2f} bits per weight" if bits else f"dense {dtype}"
    return (f"Estimate for {int(context_tokens)} tokens of context: weights {human_bytes(e['weights_bytes'])} "
            f"({e['parameters'] / 1e6:.1f}M parameters, {layers}) + KV {human_bytes(e['kv_bytes'])} = "
            f"**{human_bytes(e['total_bytes'])}**"
            + (f"; on {ranks} tensor-parallel ranks the largest share is **{human_bytes(e['rank_total_bytes'])}** "
               f"(weights {human_bytes(e['rank_weights_bytes'])} + KV {human_bytes(e['rank_kv_bytes'])})"
               if ranks > 1 else ""))


def kv_budget_gb(host) -> float | None:
    """The KV budget the running model was configured with, in GiB (None: sized automatically); with no model
    loaded, the last load's."""
    core = host.engine.engine.config if host.engine is not None else None
    if core is None:
        return host.spec.kv_cache_gb
    return None if core.kv_cache_bytes is None else round(core.kv_cache_bytes / (1 << 30), 3)


def kv_budget_update(host):
    """The KV budget box: the configured value, or empty (automatic) with the pool's present size as placeholder."""
    value = kv_budget_gb(host)
    pool = host.engine.stats().kv_cache_bytes if host.engine is not None and value is None else None
    return gr.update(value=value, placeholder=f"automatic ({human_bytes(pool)} now)" if pool else "automatic")


def plugin_settings(name: str, group: str = QUANT_GROUP) -> dict:
    """The options schema a quant (or decoding) plugin declares: {name: {"type", "enum", "default",
    "description"}}."""
    cls = discover(group).plugins.get(name)
    return dict(getattr(cls, "settings", None) or {}) if cls is not None else {}


def option_component(name: str, spec: dict, value, kind_of_plugin: str = "quant"):
    """One input for one declared option, chosen by its schema (elem_id `<quant|decoding>-option-<name>`)."""
    label = f"{name}: {spec['description']}" if spec.get("description") else name
    elem_id = f"{kind_of_plugin}-option-{name}"
    if "enum" in spec:
        return gr.Dropdown(list(spec["enum"]), value=value, label=label, elem_id=elem_id, interactive=True)
    kind = spec.get("type")
    if kind == "boolean":
        return gr.Checkbox(value=bool(value), label=label, elem_id=elem_id, interactive=True)
    if kind in ("integer", "number"):
        return gr.Number(value=value, label=label, precision=0 if kind == "integer" else None,
                         minimum=spec.get("minimum"), maximum=spec.get("maximum"), elem_id=elem_id, interactive=True)
    return gr.Textbox(value="" if value is None else str(value), label=label, elem_id=elem_id, interactive=True)


def plugin_help(name: str, group: str = QUANT_GROUP) -> str:
    registry = discover(group)
    cls = registry.plugins.get(name)
    if cls is None:
        return registry.errors.get(name, "")
    options = "; ".join(f"`{k}`: {v}" for k, v in (getattr(cls, "settings", {}) or {}).items()) or "no options"
    devices = getattr(cls, "devices", None)  # quant methods declare theirs; proposers run where the model does
    runs_on = f" Runs on {' / '.join(devices)}." if devices else ""
    return f"{cls.description}{runs_on} Options: {options}"


def plugin_options_json(host, kind: str, name: str) -> str:
    """The options box for plugin `name` of `kind` ("quant" or "decoding"): the running plugin's own options,
    or another plugin's declared defaults ({} for a name no plugin has, e.g. decoding "none")."""
    core = host.engine.engine.config if host.engine is not None else None
    if core is not None and getattr(core, kind) == name:
        return json.dumps(getattr(core, f"{kind}_options"))
    schema = plugin_settings(name, QUANT_GROUP if kind == "quant" else DECODING_GROUP)
    return json.dumps({k: v["default"] for k, v in schema.items() if "default" in v})


def render_plugin_options(schema: dict, options: str, options_box, kind_of_plugin: str) -> None:
    """Inside a gr.render: one input per declared option, each writing its value into the options JSON box."""
    try:
        current = json.loads(options or "{}")
    except ValueError:
        current = {}
    if not isinstance(current, dict):
        current = {}
    for name, spec in schema.items():
        component = option_component(name, spec, current.get(name, spec.get("default")), kind_of_plugin)

        def set_option(value, options_json, name=name):
            try:
                values = json.loads(options_json or "{}")
            except ValueError:
                values = {}
            return json.dumps({**(values if isinstance(values, dict) else {}), name: value})

        component.change(set_option, [component, options_box], options_box, queue=False)


def build_ui(chat: ChatService, sampler: DashboardSampler) -> gr.Blocks:
    store, host = chat.store, chat.host

    def conversation_choices() -> list[tuple[str, str]]:
        return [(c.title, c.id) for c in store.list_conversations()]

    def conversation(session_id: str | None) -> Conversation | None:
        if not session_id:
            return None
        try:
            return store.get_conversation(session_id)
        except NotFound:
            return None

    def chat_history(conv: Conversation | None) -> list[dict]:
        return [] if conv is None else [{"role": m.role, "content": m.content} for m in conv.messages]

    def last_stats(conv: Conversation | None) -> str:
        return reply_stats_markdown(conv.messages[-1].to_dict()) if conv is not None and conv.messages else ""

    def show(session_id: str | None):
        """Everything that depends on the selected conversation (read once)."""
        conv = conversation(session_id)
        session_id = conv.id if conv is not None else None
        system = ((conv.settings or {}).get("system_prompt") or "") if conv is not None else ""
        return (gr.update(choices=conversation_choices(), value=session_id), session_id,
                chat_history(conv), last_stats(conv), system)

    def on_load():
        choices = conversation_choices()
        return show(choices[0][1] if choices else None)

    def new_conversation(system: str):
        conv = store.create_conversation(DEFAULT_TITLE, chat.host.name, {"system_prompt": system or None})
        return show(conv.id)

    def rename(session_id: str | None, title: str):
        if session_id and title.strip():
            store.update_conversation(session_id, title=title.strip()[:200])
        return gr.update(choices=conversation_choices(), value=session_id), ""

    def delete(session_id: str | None):
        if session_id:
            try:
                store.delete_conversation(session_id)
            except NotFound:
                pass
        choices = conversation_choices()
        return show(choices[0][1] if choices else None)

    async def send(message: str, session_id: str | None, system: str, temperature: float, top_p: float,
                   max_tokens: int):
        """Stream the reply into the chat: yields (chat, textbox, stats, conversations, session)."""
        message = (message or "").strip()
        if not message:
            yield gr.update(), gr.update(), gr.update(), gr.update(), session_id
            return
        try:
            chat.admission.check_open()  # a full server refuses before anything is stored (start_turn checks again)
        except APIError as exc:
            raise gr.Error(exc.message) from None
        if not session_id:
            session_id = store.create_conversation(DEFAULT_TITLE, chat.host.name,
                                                   {"system_prompt": system or None}).id
        else:
            conv = store.get_conversation(session_id)
            if ((conv.settings or {}).get("system_prompt") or "") != (system or ""):
                store.update_conversation(session_id, settings={**(conv.settings or {}),
                                                                "system_prompt": system or None})
        overrides = {"temperature": float(temperature), "top_p": float(top_p), "max_tokens": int(max_tokens)}
        try:
            turn = await chat.start_turn(session_id, message, overrides)
        except APIError as exc:
            raise gr.Error(exc.message) from None
        history = chat_history(conversation(session_id)) + [{"role": "assistant", "content": ""}]
        choices = gr.update(choices=conversation_choices(), value=session_id)
        yield history, "", "", choices, session_id
        async for event in turn.events():
            if event["type"] == "delta":
                history[-1]["content"] += event["content"]
                yield history, gr.update(), gr.update(), gr.update(), session_id
            elif event["type"] == "done":
                history[-1]["content"] = event["message"]["content"]
                yield history, gr.update(), reply_stats_markdown(event["message"]), gr.update(), session_id

    async def stopped_stats(session_id: str | None) -> str:
        """After Stop: the cancelled reply is stored as it ends (abort); show its stats once it is."""
        conv = conversation(session_id)
        for _ in range(40):
            if conv is None:
                return ""
            last = conv.messages[-1] if conv.messages else None
            if last is not None and last.role == "assistant" and last.finish_reason == "abort":
                break
            await asyncio.sleep(0.05)
            conv = conversation(session_id)
        return last_stats(conv)

    def drop_last_turn(session_id: str | None) -> str:
        """Remove the last user message and what follows it; returns that message."""
        if not session_id:
            return ""
        messages = store.get_conversation(session_id).messages
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if not users:
            return ""
        store.truncate_messages(session_id, users[-1])
        return messages[users[-1]].content

    def settings_values():
        core = host.engine.engine.config if host.engine is not None else None
        quants = sorted(discover(QUANT_GROUP).plugins)
        decodings = ["none"] + sorted(discover(DECODING_GROUP).plugins)
        return (gr.update(choices=host.available(), value=current_model_name(host)),
                core.dtype if core else "float32", gr.update(choices=quants, value=core.quant if core else "none"),
                json.dumps(core.quant_options if core else {}),
                gr.update(choices=decodings, value=core.decoding if core else "none"),
                json.dumps(core.decoding_options if core else {}), kv_budget_update(host),
                core.tp_size if core else host.spec.tp)

    async def apply_settings(model: str, dtype: str, quant: str, options: str, decoding: str, decoding_json: str,
                             kv_gb: float | None, tp: int | None):
        """Swap model / dtype / quant / decoding / KV budget / tensor-parallel ranks without a restart; in-flight
        replies finish first. An empty KV budget (None) keeps the server's default: its --kv-cache-gb, else the
        automatic size."""
        if tp is None:
            yield "Refused: tensor-parallel ranks: enter a whole number >= 1"
            return
        decoding = decoding or "none"
        parsed = {}
        for what, raw in (("quant", options), ("decoding", decoding_json)):
            try:
                parsed[what] = json.loads(raw or "{}")
                if not isinstance(parsed[what], dict):
                    raise ValueError(f"{what} options must be a JSON object")
            except ValueError as exc:
                yield f"Refused: {what} options: {exc}"
                return
        if decoding == "none":
            parsed["decoding"] = {}  # the box may still hold another plugin's options: they do not apply
        served = host.spec.served_name if model == current_model_name(host) else None
        spec = ModelSpec(model, dtype, quant, parsed["quant"], served, None if kv_gb is None else float(kv_gb),
                         decoding, parsed["decoding"], int(tp))
        what = (f"{dtype}, quant {quant}" + (f", decoding {decoding}" if decoding != "none" else "")
                + (f", tp {int(tp)}" if int(tp) != 1 else ""))
        started = time.monotonic()
        task = asyncio.ensure_future(host.load(spec))
        while not task.done():
            waiting = f"waiting for {host.in_flight} reply(ies) to finish, " if host.in_flight else ""
            yield f"Applying: {waiting}loading {model} ({what})… {time.monotonic() - started:.0f} s"
            await asyncio.wait([task], timeout=0.5)
        try:
            task.result()
        except Exception as exc:  # a bad choice: the old model keeps serving (unless a tensor-parallel one went first)
            yield f"Refused: {exc} — " + (f"{host.name} keeps serving." if host.engine is not None
                                          else "no model is loaded.")
            return
        yield f"Loaded {host.name} ({what}) in {time.monotonic() - started:.1f} s; new replies use it."

    def edit_last(session_id: str | None):
        text = drop_last_turn(session_id)
        conv = conversation(session_id)
        return chat_history(conv), text, last_stats(conv)

    with gr.Blocks(title="kvforge") as demo:
        session = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1, min_width=220):
                new_button = gr.Button("New chat", elem_id="new-chat", variant="secondary")
                conversations = gr.Radio(label="Conversations", choices=[], elem_id="conversations")
                title_box = gr.Textbox(label="Rename to", elem_id="rename-title", max_lines=1)
                with gr.Row():
                    rename_button = gr.Button("Rename", elem_id="rename", size="sm")
                    delete_button = gr.Button("Delete", elem_id="delete", size="sm", variant="stop")
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(elem_id="chat", height=460, label="Chat")
                stats = gr.Markdown(elem_id="reply-stats")
                with gr.Row():
                    textbox = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=5,
                                         elem_id="message", max_lines=8)
                    send_button = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                    stop_button = gr.Button("Stop", scale=1, elem_id="stop")
                with gr.Row():
                    regenerate_button = gr.Button("Regenerate", size="sm", elem_id="regenerate")
                    edit_button = gr.Button("Edit last message", size="sm", elem_id="edit-last")
                with gr.Accordion("Generation settings", open=False):
                    system_box = gr.Textbox(label="System prompt", lines=2, elem_id="system-prompt")
                    temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature")
                    top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="Top-p", elem_id="top-p")
                    max_tokens = gr.Slider(1, 4096, value=512, step=1, label="Max tokens", elem_id="max-tokens")
            with gr.Column(scale=2, min_width=280):
                with gr.Accordion("Model settings", open=False, elem_id="settings"):
                    model_choice = gr.Dropdown(label="Model", elem_id="settings-model")
                    dtype_choice = gr.Radio(["float32", "bfloat16", "float16"], label="dtype",
                                            elem_id="settings-dtype")
                    quant_choice = gr.Dropdown(label="Quantization plugin", elem_id="settings-quant")
                    quant_help = gr.Markdown(elem_id="settings-quant-help")
                    quant_options = gr.Textbox(label="Quantization options (JSON)", value="{}", max_lines=4,
                                               elem_id="settings-quant-options")

                    @gr.render(inputs=[quant_choice, quant_options], triggers=[quant_choice.change])
                    def render_options(quant: str, options: str):
                        """Inputs rendered from the schema the plugin declares; they edit the options JSON."""
                        render_plugin_options(plugin_settings(quant), options, quant_options, "quant")

                    decoding_choice = gr.Dropdown(label="Decoding plugin (speculative)", elem_id="settings-decoding")
                    decoding_help = gr.Markdown(elem_id="settings-decoding-help")
                    decoding_options = gr.Textbox(label="Decoding options (JSON)", value="{}", max_lines=4,
                                                  elem_id="settings-decoding-options")

                    @gr.render(inputs=[decoding_choice, decoding_options], triggers=[decoding_choice.change])
                    def render_decoding_options(decoding: str, options: str):
                        """The decoding plugin's declared options as inputs; they edit its options JSON."""
                        render_plugin_options(plugin_settings(decoding or "none", DECODING_GROUP), options,
                                              decoding_options, "decoding")

                    kv_gb = gr.Number(label="KV cache budget (GiB; empty: automatic)", minimum=0.01,
                                      info=KV_BUDGET_INFO, elem_id="settings-kv-gb")
                    tp_ranks = gr.Number(label="Tensor-parallel ranks", value=1, minimum=1, precision=0,
                                         elem_id="settings-tp")
                    context = gr.Number(label="Context length for the estimate (tokens)", value=8192,
                                        minimum=1, precision=0, elem_id="settings-context")
                    estimate = gr.Markdown(elem_id="settings-estimate")
                    apply_button = gr.Button("Apply", variant="primary", elem_id="settings-apply")
                    status = gr.Markdown(elem_id="settings-status")
                dashboard = gr.Markdown(elem_id="dashboard")
                plot = gr.LinePlot(x="seconds ago", y="tok/s", title="Generation tok/s", height=220,
                                   elem_id="tokens-plot")
                timer = gr.Timer(1.0)

        shown = [conversations, session, chatbot, stats, system_box]
        demo.load(on_load, outputs=shown)
        new_button.click(new_conversation, inputs=[system_box], outputs=shown)
        conversations.input(show, inputs=[conversations], outputs=shown)
        rename_button.click(rename, inputs=[session, title_box], outputs=[conversations, title_box])
        delete_button.click(delete, inputs=[session], outputs=shown)

        send_inputs = [textbox, session, system_box, temperature, top_p, max_tokens]
        send_outputs = [chatbot, textbox, stats, conversations, session]
        sending = [send_button.click(send, send_inputs, send_outputs, concurrency_limit=None),
                   textbox.submit(send, send_inputs, send_outputs, concurrency_limit=None)]
        sending.append(regenerate_button.click(edit_last, [session], [chatbot, textbox, stats]).then(
            send, send_inputs, send_outputs, concurrency_limit=None))
        stop_button.click(None, cancels=sending).then(stopped_stats, [session], [stats])
        edit_button.click(edit_last, [session], [chatbot, textbox, stats])

        settings = [model_choice, dtype_choice, quant_choice, quant_options, decoding_choice, decoding_options, kv_gb,
                    tp_ranks]
        demo.load(settings_values, outputs=settings)
        estimate_inputs = [model_choice, dtype_choice, context, quant_choice, quant_options, tp_ranks]

        def update_estimate(m, d, c, q, o, t):
            return memory_estimate_markdown(host, m, d, c or 1, q, o, t)

        for component in (model_choice, dtype_choice, context, quant_options, tp_ranks):
            component.change(update_estimate, estimate_inputs, estimate, queue=False)
        quant_choice.change(plugin_help, quant_choice, quant_help, queue=False)

        # a new quant choice: its options first, then the estimate (never the new plugin with the old one's options,
        # which it refuses: "No estimate: ValueError: plugin 'none' has no option ...")
        quant_choice.change(lambda q: plugin_options_json(host, "quant", q), quant_choice, quant_options,
                            queue=False).then(update_estimate, estimate_inputs, estimate, queue=False)

        decoding_choice.change(lambda d: plugin_help(d, DECODING_GROUP) if d and d != "none" else "", decoding_choice,
                               decoding_help, queue=False)
        decoding_choice.change(lambda d: plugin_options_json(host, "decoding", d or "none"), decoding_choice,
                               decoding_options, queue=False)

        apply_button.click(apply_settings, settings, status, concurrency_limit=1).then(
            settings_values, outputs=settings)

        timer.tick(lambda: (dashboard_markdown(sampler), throughput_frame(sampler)), outputs=[dashboard, plot],
                   queue=False, show_progress="hidden")
    demo.queue(default_concurrency_limit=None)
    return demo


def mount_ui(app, chat: ChatService, sampler: DashboardSampler):
    """Serve the UI at / of the FastAPI app (its /v1 routes are defined first, so they keep working)."""
    return gr.mount_gradio_app(app, build_ui(chat, sampler), path="/", theme=gr.themes.Default(), css=CSS,
                               footer_links=[])
