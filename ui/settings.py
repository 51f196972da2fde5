"""The Model settings panel: model, dtype, quant plugin and its options, speculative decoding plugin and its
options, KV budget and KV cache type, tensor-parallel ranks, and an estimate of weights + KV memory before anything
is loaded.

Apply swaps them through the same ModelHost as the admin API: in-flight replies finish first, a refused choice
keeps the old model (not when both are tensor-parallel: see ModelHost.load). Each plugin's options are inputs
rendered from the schema it declares. Gradio is imported inside the functions: build_ui imports this module
after the offline environment is set.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvforge.app.cli.cache import human_bytes
from kvforge.app.models.spec import ModelSpec
from kvforge.core.config import DTYPE_NAMES, KV_CACHE_DTYPES, loads_gguf_natively
from kvforge.core.estimate import estimate_memory
from kvforge.core.loader import load_config
from kvforge.core.plugins import (
    DECODING_GROUP,
    DENSE_MODULES_OPTION,
    QUANT_GROUP,
    checkpoint_quantization,
    discover,
    resolve_quant,
)
from kvforge.core.quant_config import QuantConfig
from kvforge.ui.service import UIService

if TYPE_CHECKING:
    import gradio as gr

KV_BUDGET_INFO = ("Empty: the server's --kv-cache-gb, or without one automatic: 1 GiB on CPU; on a GPU, what "
                  "--gpu-memory-utilization leaves after the weights.")
# bytes per token from core/kv/quant.py's row layout (head_dim 64: 66 or 40 bytes a row against bf16's 128);
# perplexity from `kvforge bench kv-quant`
KV_CACHE_INFO = ("How the KV pool stores K and V. auto: the model's dtype, exact. int8 / fp8_e4m3 / fp8_e5m2: about "
                 "half the bytes per token of bf16 (twice the tokens in the same budget), perplexity within ~1%. q4 "
                 "(V in 4 bits, K in 5): about 0.31x (3.2x the tokens), perplexity within ~1-3%.")


def memory_estimate_markdown(service: UIService, model: str, dtype: str, context_tokens: float, quant: str = "none",
                             options: str = "{}", tp: float | None = 1, kv_cache_dtype: str | None = "auto",
                             pp: float | None = 1) -> str:
    """Weights (at the quant plugin's bits per weight; a quantized checkpoint decides its own) + KV for
    the chosen context length in the chosen KV cache type, before anything is loaded; with pipeline stages, each
    stage's share."""
    kv_cache_dtype = kv_cache_dtype or "auto"
    kv_type = "" if kv_cache_dtype == "auto" else f" ({kv_cache_dtype})"
    try:
        gguf, running = service.gguf_file(model), service.running_config()
        if gguf is not None and loads_gguf_natively(quant or "none", running is not None and running.gguf_dense):
            from kvforge.app.models.catalog import describe

            entry = describe(model, gguf, int(context_tokens), dtype, kv_cache_dtype, int(pp or 1))
            if entry.error:
                raise ValueError(entry.error)
            return (f"Estimate for {int(context_tokens)} tokens of context: weights "
                    f"{human_bytes(entry.weights_bytes)} ({entry.parameters / 1e6:.1f}M parameters, the GGUF's own "
                    f"{entry.quantization} blocks) + KV {human_bytes(entry.memory_bytes - entry.weights_bytes)}"
                    f"{kv_type} = **{human_bytes(entry.memory_bytes)}**" + stages_note(entry.stages)
                    + experts_note(entry.experts_bytes))
        path = service.local_model_dir(model)
        if path is None:
            return f"No estimate for {model!r} before it is converted (GGUF)."
        hf_config = load_config(path)
        # the options the plugin declares: while the panel follows a swap, the box may still hold the last plugin's
        # (a wrong option is reported when applying)
        declared = plugin_settings(quant or "none")
        given = {k: v for k, v in json.loads(options or "{}").items() if k in declared or k == DENSE_MODULES_OPTION}
        quant, quant_options = resolve_quant(quant or "none", given, hf_config, path)
        method = discover(QUANT_GROUP).get(quant)
        bits = method.bits_per_weight(quant_options)
        # what loading builds: the method per layer, the LM head and modules_to_not_convert dense
        quant_config = QuantConfig.for_checkpoint(method, quant_options, checkpoint_quantization(hf_config, path))
        ranks = int(tp or 1)
        e = estimate_memory(hf_config, dtype, int(context_tokens), quant_config, tp_size=ranks,
                            kv_cache_dtype=kv_cache_dtype, pp_size=int(pp or 1))
    except Exception as exc:  # a broken config or option: say so, never break the page
        return f"No estimate: {type(exc).__name__}: {exc}"
    layers = f"{quant} at {bits:.2f} bits per weight" if bits else f"dense {dtype}"
    return (f"Estimate for {int(context_tokens)} tokens of context: weights {human_bytes(e['weights_bytes'])} "
            f"({e['parameters'] / 1e6:.1f}M parameters, {layers}) + KV {human_bytes(e['kv_bytes'])}{kv_type} = "
            f"**{human_bytes(e['total_bytes'])}**"
            + (f"; on {ranks} tensor-parallel ranks the largest share is **{human_bytes(e['rank_total_bytes'])}** "
               f"(weights {human_bytes(e['rank_weights_bytes'])} + KV {human_bytes(e['rank_kv_bytes'])})"
               if ranks > 1 else "") + stages_note(e.get("stages")) + experts_note(e.get("experts_bytes")))


def stages_note(stages: list[dict] | None) -> str:
    """Each pipeline stage's share (its process's; rank 0's under tensor parallelism too): layers and bytes."""
    if not stages:
        return ""
    parts = [f"stage {n} (layers {s['layers'][0]}-{s['layers'][1] - 1}{', embedding + LM head' if n == 0 else ''}) "
             f"**{human_bytes(s['total_bytes'])}**" for n, s in enumerate(stages)]
    return f"; on {len(stages)} pipeline stages, each process holds: " + ", ".join(parts)


def experts_note(experts_bytes: int | None) -> str:
    """Where a mixture-of-experts model's routed experts go: the part of the weights "Experts in host memory" moves."""
    if not experts_bytes:
        return ""
    return f"; of the weights, the experts: {human_bytes(experts_bytes)} (in host memory when that box is ticked)"


def kv_budget_gb(service: UIService) -> float | None:
    """The KV budget the running model was configured with, in GiB (None: sized automatically); with no model
    loaded, the last load's."""
    core = service.running_config()
    if core is None:
        return service.last_spec().kv_cache_gb
    return None if core.kv_cache_bytes is None else round(core.kv_cache_bytes / (1 << 30), 3)


def kv_budget_update(service: UIService):
    """The KV budget box: the configured value, or empty (automatic) with the pool's present size as placeholder."""
    import gradio as gr

    value = kv_budget_gb(service)
    pool = service.kv_pool_bytes() if value is None else None
    return gr.update(value=value, placeholder=f"automatic ({human_bytes(pool)} now)" if pool else "automatic")


def plugin_settings(name: str, group: str = QUANT_GROUP) -> dict:
    """The options schema a quant (or decoding) plugin declares: {name: {"type", "enum", "default",
    "description"}}."""
    cls = discover(group).plugins.get(name)
    return dict(getattr(cls, "settings", None) or {}) if cls is not None else {}


def plugin_help(name: str, group: str = QUANT_GROUP) -> str:
    registry = discover(group)
    cls = registry.plugins.get(name)
    if cls is None:
        return registry.errors.get(name, "")
    options = "; ".join(f"`{k}`: {v}" for k, v in (getattr(cls, "settings", {}) or {}).items()) or "no options"
    devices = getattr(cls, "devices", None)  # quant methods declare theirs; proposers run where the model does
    runs_on = f" Runs on {' / '.join(devices)}." if devices else ""
    return f"{cls.description}{runs_on} Options: {options}"


def plugin_options_json(service: UIService, kind: str, name: str) -> str:
    """The options box for plugin `name` of `kind` ("quant" or "decoding"): the running plugin's own options,
    or another plugin's declared defaults ({} for a name no plugin has, e.g. decoding "none")."""
    core = service.running_config()
    if core is not None and getattr(core, kind) == name:
        return json.dumps(getattr(core, f"{kind}_options"))
    schema = plugin_settings(name, QUANT_GROUP if kind == "quant" else DECODING_GROUP)
    return json.dumps({k: v["default"] for k, v in schema.items() if "default" in v})


def option_component(name: str, spec: dict, value, kind_of_plugin: str = "quant"):
    """One input for one declared option, chosen by its schema (elem_id `<quant|decoding>-option-<name>`)."""
    import gradio as gr

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


def parse_options(quant_json: str, decoding_json: str) -> dict[str, dict]:
    """{"quant": ..., "decoding": ...} from the two options boxes; ValueError naming the box that is not a JSON
    object."""
    parsed = {}
    for what, raw in (("quant", quant_json), ("decoding", decoding_json)):
        try:
            parsed[what] = json.loads(raw or "{}")
            if not isinstance(parsed[what], dict):
                raise ValueError(f"{what} options must be a JSON object")
        except ValueError as exc:
            raise ValueError(f"{what} options: {exc}") from None
    return parsed


class SettingsHandlers:
    """The panel's event handlers. Their names and docstrings are the UI's Gradio API (/apply_settings...)."""

    def __init__(self, service: UIService) -> None:
        self.service = service

    def settings_values(self):
        # the panel as the running model has it (model, dtype, quant, quant options, decoding, decoding options,
        # KV budget, tensor-parallel ranks, KV cache type, pipeline stages, experts in host memory); no docstring: it
        # would become the Gradio API's description
        import gradio as gr

        core = self.service.running_config()
        quants = sorted(discover(QUANT_GROUP).plugins)
        decodings = ["none"] + sorted(discover(DECODING_GROUP).plugins)
        return (gr.update(choices=self.service.available_models(), value=self.service.model_choice()),
                core.dtype if core else ModelSpec.dtype,
                gr.update(choices=quants, value=core.quant if core else "none"),
                json.dumps(core.quant_options if core else {}),
                gr.update(choices=decodings, value=core.decoding if core else "none"),
                json.dumps(core.decoding_options if core else {}), kv_budget_update(self.service),
                core.tp_size if core else self.service.last_spec().tp,
                core.kv_cache_dtype if core else self.service.last_spec().kv_cache_dtype,
                core.pp_size if core else self.service.last_spec().pp,
                core.cpu_experts if core else self.service.last_spec().cpu_experts)

    def update_estimate(self, m: str, d: str, c: float | None, q: str, o: str, t: float | None,
                        k: str | None = "auto", p: float | None = 1) -> str:
        # (model, dtype, context tokens, quant, quant options, tensor-parallel ranks, KV cache type); the short names
        # and no docstring: the Gradio API (/update_estimate) shows them as it always has. The KV cache type comes
        # last with a default (the input's initial value, for Gradio clients): a caller of the six others still works;
        # the pipeline stages after it, the same way
        return memory_estimate_markdown(self.service, m, d, c or 1, q, o, t, k, p)

    async def apply_settings(self, model: str, dtype: str, quant: str, options: str, decoding: str,
                             decoding_json: str, kv_gb: float | None, tp: int | None,
                             kv_cache_dtype: str | None = ModelSpec.kv_cache_dtype,
                             pp: int | None = ModelSpec.pp,
                             cpu_experts: bool | None = ModelSpec.cpu_experts) -> AsyncIterator[str]:
        """Swap model / dtype / quant / decoding / KV budget / tensor-parallel ranks / KV cache type / pipeline stages /
        experts in host memory without a restart; in-flight replies finish first. An empty KV budget (None) keeps the
        server's default: its --kv-cache-gb, else the automatic size."""
        if tp is None:
            yield "Refused: tensor-parallel ranks: enter a whole number >= 1"
            return
        if pp is None:
            yield "Refused: pipeline stages: enter a whole number >= 1"
            return
        decoding, kv_cache_dtype = decoding or "none", kv_cache_dtype or ModelSpec.kv_cache_dtype
        try:
            parsed = parse_options(options, decoding_json)
        except ValueError as exc:
            yield f"Refused: {exc}"
            return
        if decoding == "none":
            parsed["decoding"] = {}  # the box may still hold another plugin's options: they do not apply
        served = self.service.last_spec().served_name if model == self.service.model_choice() else None
        spec = ModelSpec(model=model, dtype=dtype, quant=quant, quant_options=parsed["quant"], served_name=served,
                         kv_cache_gb=None if kv_gb is None else float(kv_gb), kv_cache_dtype=kv_cache_dtype,
                         decoding=decoding, decoding_options=parsed["decoding"], tp=int(tp), pp=int(pp),
                         cpu_experts=bool(cpu_experts))
        what = (f"{dtype}, quant {quant}" + (f", decoding {decoding}" if decoding != "none" else "")
                + (f", tp {int(tp)}" if int(tp) != 1 else "") + (f", pp {int(pp)}" if int(pp) != 1 else "")
                + (f", KV cache {kv_cache_dtype}" if kv_cache_dtype != "auto" else "")
                + (", experts in host memory" if cpu_experts else ""))
        started = time.monotonic()
        task = asyncio.ensure_future(self.service.load_model(spec))
        while not task.done():
            in_flight = self.service.replies_in_flight()
            waiting = f"waiting for {in_flight} reply(ies) to finish, " if in_flight else ""
            yield f"Applying: {waiting}loading {model} ({what})… {time.monotonic() - started:.0f} s"
            await asyncio.wait([task], timeout=0.5)
        try:
            task.result()
        except Exception as exc:  # a bad choice: the old model keeps serving (unless a tensor-parallel one went first)
            name = self.service.model_name()
            yield f"Refused: {exc} — " + (f"{name} keeps serving." if name is not None else "no model is loaded.")
            return
        yield f"Loaded {self.service.model_name()} ({what}) in {time.monotonic() - started:.1f} s; new replies use it."


@dataclass
class SettingsPanel:
    """The panel's inputs and outputs, as the handlers take and fill them."""
    model: Any
    dtype: Any
    quant: Any
    quant_help: Any
    quant_options: Any
    decoding: Any
    decoding_help: Any
    decoding_options: Any
    kv_gb: Any
    kv_cache_dtype: Any
    tp: Any
    pp: Any
    cpu_experts: Any
    context: Any
    estimate: Any
    apply: Any
    status: Any

    def values(self) -> list:
        """What settings_values fills and apply_settings takes, in that order (the KV cache type, the pipeline stages
        and the experts' place last: the Gradio API's callers of the earlier inputs keep working)."""
        return [self.model, self.dtype, self.quant, self.quant_options, self.decoding, self.decoding_options,
                self.kv_gb, self.tp, self.kv_cache_dtype, self.pp, self.cpu_experts]

    def estimate_inputs(self) -> list:
        return [self.model, self.dtype, self.context, self.quant, self.quant_options, self.tp, self.kv_cache_dtype,
                self.pp]


def plugin_choice(kind: str, label: str, options_label: str, group: str):
    """A plugin dropdown, its help line and its options JSON box (elem_ids `settings-<kind>...`), with the
    options the chosen plugin declares rendered under them as inputs."""
    import gradio as gr

    choice = gr.Dropdown(label=label, elem_id=f"settings-{kind}")
    help_line = gr.Markdown(elem_id=f"settings-{kind}-help")
    options_box = gr.Textbox(label=options_label, value="{}", max_lines=4, elem_id=f"settings-{kind}-options")

    @gr.render(inputs=[choice, options_box], triggers=[choice.change])
    def render_options(name: str, options: str):
        """Inputs rendered from the schema the plugin declares; they edit the options JSON."""
        render_plugin_options(plugin_settings(name, group), options, options_box, kind)

    return choice, help_line, options_box


def settings_panel() -> SettingsPanel:
    """The "Model settings" accordion."""
    import gradio as gr

    with gr.Accordion("Model settings", open=False, elem_id="settings"):
        model = gr.Dropdown(label="Model", elem_id="settings-model")
        dtype = gr.Radio(list(DTYPE_NAMES), label="dtype", elem_id="settings-dtype")
        quant, quant_help, quant_options = plugin_choice("quant", "Quantization plugin",
                                                         "Quantization options (JSON)", QUANT_GROUP)
        decoding, decoding_help, decoding_options = plugin_choice("decoding", "Decoding plugin (speculative)",
                                                                  "Decoding options (JSON)", DECODING_GROUP)
        kv_gb = gr.Number(label="KV cache budget (GiB; empty: automatic)", minimum=0.01,
                          info=KV_BUDGET_INFO, elem_id="settings-kv-gb")
        # an initial value: the Gradio API's input is optional (a client sending the eight earlier ones gets auto)
        kv_cache_dtype = gr.Radio(list(KV_CACHE_DTYPES), value=ModelSpec.kv_cache_dtype, label="KV cache",
                                  info=KV_CACHE_INFO, elem_id="settings-kv-cache-dtype")
        tp = gr.Number(label="Tensor-parallel ranks", value=1, minimum=1, precision=0, elem_id="settings-tp")
        pp = gr.Number(label="Pipeline stages", value=1, minimum=1, precision=0, elem_id="settings-pp",
                       info="each stage: --tp processes holding consecutive layers and their KV")
        cpu_experts = gr.Checkbox(label="Experts in host memory (mixture-of-experts models)", value=False,
                                  elem_id="settings-cpu-experts",
                                  info="every expert's weights in RAM, computed on the CPU (llama.cpp's --cpu-moe); "
                                       "the rest of the model on the device")
        context = gr.Number(label="Context length for the estimate (tokens)", value=8192,
                            minimum=1, precision=0, elem_id="settings-context")
        estimate = gr.Markdown(elem_id="settings-estimate")
        apply = gr.Button("Apply", variant="primary", elem_id="settings-apply")
        status = gr.Markdown(elem_id="settings-status")
    return SettingsPanel(model, dtype, quant, quant_help, quant_options, decoding, decoding_help, decoding_options,
                         kv_gb, kv_cache_dtype, tp, pp, cpu_experts, context, estimate, apply, status)


def add_settings(blocks: gr.Blocks, service: UIService) -> None:
    """The Model settings panel, filled from the running model on load and again after each Apply."""
    on, panel = SettingsHandlers(service), settings_panel()
    blocks.load(on.settings_values, outputs=panel.values())
    for component in (panel.model, panel.dtype, panel.context, panel.quant_options, panel.tp, panel.kv_cache_dtype,
                      panel.pp):
        component.change(on.update_estimate, panel.estimate_inputs(), panel.estimate, queue=False)
    panel.quant.change(plugin_help, panel.quant, panel.quant_help, queue=False)

    # a new quant choice: its options first, then the estimate (never the new plugin with the old one's options,
    # which it refuses: "No estimate: ValueError: plugin 'none' has no option ...")
    panel.quant.change(lambda q: plugin_options_json(service, "quant", q), panel.quant, panel.quant_options,
                       queue=False).then(on.update_estimate, panel.estimate_inputs(), panel.estimate, queue=False)

    panel.decoding.change(lambda d: plugin_help(d, DECODING_GROUP) if d and d != "none" else "", panel.decoding,
                          panel.decoding_help, queue=False)
    panel.decoding.change(lambda d: plugin_options_json(service, "decoding", d or "none"), panel.decoding,
                          panel.decoding_options, queue=False)

    panel.apply.click(on.apply_settings, panel.values(), panel.status, concurrency_limit=1).then(
        on.settings_values, outputs=panel.values())
