"""The KV cache type (and the model's placement inputs) in the UI without a browser: the settings panel's memory
estimate counts the chosen type's bytes (the GGUF's own blocks and a converted checkpoint alike, as `kvforge models`
does), Apply builds the spec with it, and the dashboard shows the type and the tokens the pool holds (the model
card's kv_cache_tokens). The browser drives the same panel in tests/ui/test_settings.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvforge.app.cli.cache import human_bytes
from kvforge.app.models.catalog import describe
from kvforge.app.models.spec import ModelSpec
from kvforge.core.config import KV_CACHE_DTYPES
from kvforge.core.loader import EMBEDDED_MODEL, embedded_gguf_path
from kvforge.ui.dashboard import DashboardSampler, dashboard_markdown
from kvforge.ui.settings import SettingsHandlers, memory_estimate_markdown


class PanelService:
    """What the settings panel asks of UIService, with no model loaded: the embedded model's GGUF and its
    conversion; the specs Apply loads are kept."""

    def __init__(self, converted: Path) -> None:
        self.converted, self.loaded = converted, []

    def gguf_file(self, model: str) -> Path | None:
        return embedded_gguf_path() if model == EMBEDDED_MODEL else None

    def local_model_dir(self, model: str) -> Path | None:
        return self.converted if model == EMBEDDED_MODEL else None

    def running_config(self) -> None:
        return None

    def last_spec(self) -> ModelSpec:
        return ModelSpec()

    def model_choice(self) -> str:
        return EMBEDDED_MODEL

    def model_name(self) -> str:
        return EMBEDDED_MODEL

    def replies_in_flight(self) -> int:
        return 0

    async def load_model(self, spec: ModelSpec) -> None:
        self.loaded.append(spec)


@pytest.fixture(scope="module")
def service(embedded_path) -> PanelService:
    return PanelService(embedded_path)


def kv_part(text: str) -> str:
    """The estimate's KV figure: "+ KV 96.0 MiB (int8) = ..." -> "96.0 MiB (int8)"."""
    return text.split("+ KV ", 1)[1].split(" = ", 1)[0]


def test_the_gguf_estimate_counts_the_kv_cache_type_as_kvforge_models_does(service):
    on = SettingsHandlers(service)
    texts = {k: on.update_estimate(EMBEDDED_MODEL, "bfloat16", 8192, "none", "{}", 1, k) for k in KV_CACHE_DTYPES}
    for kv_cache_dtype, text in texts.items():
        entry = describe(EMBEDDED_MODEL, embedded_gguf_path(), 8192, "bfloat16", kv_cache_dtype)
        assert human_bytes(entry.memory_bytes - entry.weights_bytes) in kv_part(text), (kv_cache_dtype, text)
        assert f"**{human_bytes(entry.memory_bytes)}**" in text
    assert texts["int8"] != texts["auto"] and "(int8)" in texts["int8"] and "(" not in kv_part(texts["auto"])
    # the six inputs the Gradio API's callers send still give the estimate, in the model's dtype
    assert on.update_estimate(EMBEDDED_MODEL, "bfloat16", 8192, "none", "{}", 1) == texts["auto"]


def test_pipeline_stages_split_the_estimate_as_the_engine_splits_the_layers(service):
    """The panel's pipeline stages: each stage's layers as core/distributed.py splits them (the embedded model's 30:
    11 + 19, tests/core/test_pp.py) and its share, the shares summing to the whole, for the GGUF (`kvforge models
    --pp`) and the checkpoint paths alike."""
    on = SettingsHandlers(service)
    whole = on.update_estimate(EMBEDDED_MODEL, "bfloat16", 8192, "none", "{}", 1, "auto")
    assert "pipeline" not in whole
    entry = describe(EMBEDDED_MODEL, embedded_gguf_path(), 8192, "bfloat16", "auto", pp=2)
    first, last = entry.stages
    assert (first["layers"], last["layers"]) == ([0, 11], [11, 30])
    assert first["total_bytes"] + last["total_bytes"] == pytest.approx(entry.memory_bytes, abs=2)
    for quant in ("none", "bnb-int8"):  # the GGUF's own blocks, and its conversion (estimate_memory)
        text = on.update_estimate(EMBEDDED_MODEL, "bfloat16", 8192, quant, "{}", 1, "auto", 2)
        assert "on 2 pipeline stages" in text and "stage 0 (layers 0-10, embedding + LM head)" in text, text
        assert "stage 1 (layers 11-29)" in text, text
    assert f"**{human_bytes(first['total_bytes'])}**" in on.update_estimate(EMBEDDED_MODEL, "bfloat16", 8192, "none",
                                                                             "{}", 1, "auto", 2)


def test_the_checkpoint_estimate_counts_the_kv_cache_type(service):
    """A quant plugin other than gguf loads the conversion: estimate_memory's KV at the type's bytes, 8-bit about half
    of bf16's, q4 about 0.31x (head_dim 64: 66 and 40 bytes a row against 128)."""
    kv = {}
    for kv_cache_dtype in ("auto", "int8", "q4"):
        text = memory_estimate_markdown(service, EMBEDDED_MODEL, "bfloat16", 4096, "bnb-int8", "{}", 1, kv_cache_dtype)
        assert "bnb-int8" in text, text
        value, unit = kv_part(text).split()[:2]
        kv[kv_cache_dtype] = float(value) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    assert kv["int8"] / kv["auto"] == pytest.approx(66 / 128, rel=0.01)
    assert kv["q4"] / kv["auto"] == pytest.approx(40 / 128, rel=0.01)


def test_apply_loads_the_kv_cache_type_chosen_and_keeps_the_default_for_older_callers(service):
    on = SettingsHandlers(service)

    async def apply(*values) -> list[str]:
        return [status async for status in on.apply_settings(*values)]

    statuses = asyncio.run(apply(EMBEDDED_MODEL, "bfloat16", "none", "{}", "none", "{}", 0.25, 1, "q4"))
    assert service.loaded[-1].kv_cache_dtype == "q4" and "KV cache q4" in statuses[-1], statuses
    asyncio.run(apply(EMBEDDED_MODEL, "bfloat16", "none", "{}", "none", "{}", 0.25, 1))  # the eight earlier inputs
    assert service.loaded[-1].kv_cache_dtype == "auto"


def test_apply_places_a_moe_models_experts_in_host_memory_when_asked(service):
    """The panel's last input, "Experts in host memory": Apply loads the spec with cpu_experts (the engine's --cpu-
    experts) and says so; a caller of the earlier inputs gets the default (off). The loaded placement itself:
    tests/core/test_moe.py and the admin test."""
    on = SettingsHandlers(service)

    async def apply(*values) -> list[str]:
        return [status async for status in on.apply_settings(*values)]

    statuses = asyncio.run(apply(EMBEDDED_MODEL, "bfloat16", "none", "{}", "none", "{}", 0.25, 1, "auto", 1, True))
    assert service.loaded[-1].cpu_experts is True and "experts in host memory" in statuses[-1], statuses
    asyncio.run(apply(EMBEDDED_MODEL, "bfloat16", "none", "{}", "none", "{}", 0.25, 1, "auto", 1))
    assert service.loaded[-1].cpu_experts is False


def test_the_dashboard_shows_the_kv_cache_type_and_the_tokens_the_pool_holds(embedded_llm):
    engine = embedded_llm.engine
    sampler = DashboardSampler(SimpleNamespace(engine=engine, name=EMBEDDED_MODEL))
    text = dashboard_markdown(SimpleNamespace(latest_sample=sampler.sample, recent_ttfts=list))
    runtime = engine.runtime()
    tokens = int(runtime.kv_cache_bytes // runtime.kv_bytes_per_token)  # the model card's kv_cache_tokens
    row = next(line for line in text.splitlines() if line.startswith("| KV cache type / tokens held |"))
    assert f"float32 (auto) / {tokens:,} tokens" in row, row  # the fixture's engine: fp32, KV unquantized
    assert human_bytes(round(runtime.kv_bytes_per_token)) in row
