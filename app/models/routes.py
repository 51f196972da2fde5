"""The models a server runs, as routes: OpenAI's model list (GET /v1/models: the loaded models' cards, then the others
a request may name) and the admin API (GET /admin/models, POST /admin/models/load | unload: a swap without a process
restart, app/models/host.py)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from kvforge.app.context import ServerContext
from kvforge.app.http.errors import APIError
from kvforge.app.models.spec import InvalidSpec, ModelSpec
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.config import DTYPE_NAMES, KV_CACHE_DTYPES, engine_default
from kvforge.core.metrics import gpu_memory


class LoadModelRequest(BaseModel):
    """POST /admin/models/load: a model in the models directory (or the embedded default) and options -- ModelSpec's
    settings (app/models/spec.py), each of them (a test keeps the two alike), under the API's names and bounds."""
    # defaults and dtype choices: EngineConfig's (core/config.py)

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    dtype: Literal[DTYPE_NAMES] = engine_default("dtype")
    quant: str = engine_default("quant")
    quant_options: dict[str, Any] = Field(default_factory=dict)
    served_model_name: str | None = None
    kv_cache_gb: float | None = Field(default=None, ge=1 / 1024, le=4096)  # the API's sanity range: 1 MiB to 4 TiB
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = engine_default("kv_cache_dtype")
    decoding: str = engine_default("decoding")  # a speculative decoding plugin
    decoding_options: dict[str, Any] = Field(default_factory=dict)
    tp: int | None = Field(default=None, ge=1)  # tensor-parallel ranks; None: the server's --tp
    pp: int | None = Field(default=None, ge=1)  # pipeline stages; None: the server's --pp
    cpu_experts: bool | None = None  # a MoE model's experts in host memory; None: the server's --cpu-experts

    def spec(self, default_tp: int, default_pp: int = 1, default_cpu_experts: bool = False) -> ModelSpec:
        """The model to load, as the host takes it (the defaults: the server's --tp / --pp / --cpu-experts)."""
        settings = self.model_dump()
        settings["served_name"] = settings.pop("served_model_name")  # --served-model-name's name in the API
        for field, default in (("tp", default_tp), ("pp", default_pp), ("cpu_experts", default_cpu_experts)):
            if settings[field] is None:
                settings[field] = default
        return ModelSpec(**settings)



def models_router(context: ServerContext) -> APIRouter:
    router = APIRouter()
    host = context.host

    def model_card(name: str | None = None, engine: AsyncEngine | None = None) -> dict:
        """A loaded model's card (the server's own when none is given): how it runs and the memory it takes."""
        name, core = (name, engine.engine) if engine is not None else (host.name, host.current().engine)
        runtime = core.runtime()
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvforge", "loaded": True,
                "quant": core.config.quant, "quant_options": core.config.quant_options, "dtype": core.config.dtype,
                "decoding": core.config.decoding, "decoding_options": core.config.decoding_options,
                "kv_cache_dtype": core.config.kv_cache_dtype,
                # the context served, under vLLM's name and the one LM Studio's and OpenRouter's clients read
                "tp": core.config.tp_size, "pp": core.config.pp_size, "cpu_experts": core.config.cpu_experts,
                "gguf_weights": runtime.gguf_weights,
                # what a request may carry besides text (a vision model's pictures)
                "input_modalities": ["text", "image"] if core.tokenizer.takes_images else ["text"],
                "max_model_len": core.max_model_len, "context_length": core.max_model_len,
                # what a request leaving these fields out gets (core/generation_defaults.py), and from where
                "sampling_defaults": core.generation_defaults.values,
                "sampling_defaults_source": core.generation_defaults.source,
                "device": runtime.device, "kernels": runtime.kernels, "cuda_graphs": runtime.cuda_graphs,
                "memory": {"weights_bytes": runtime.weight_bytes, "kv_cache_bytes": runtime.kv_cache_bytes,
                           "kv_bytes_per_token": runtime.kv_bytes_per_token,
                           "kv_cache_tokens": int(runtime.kv_cache_bytes // runtime.kv_bytes_per_token),
                           "gpus": gpu_memory()},
                # where each part lives: a stage's layers, the embedding / LM head, its processes, device, bytes
                "stages": runtime.stages}

    @router.get("/v1/models")
    async def list_models():
        """The loaded models (the server's own first), then the others a request may name (loaded on demand)."""
        loaded = host.loaded()
        cards = [model_card(name, engine) for name, engine, _, _ in loaded]
        names = {name for name, _, _, _ in loaded} | {host.spec.name, host.default_entry}
        cards += [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvforge", "loaded": False}
                  for name in host.available() if name not in names]
        return {"object": "list", "data": cards}

    @router.get("/admin/models")
    async def admin_models():
        return {"loaded": model_card() if host.engine is not None else None, "available": host.available(),
                "in_flight": host.in_flight, "last_error": host.last_error}

    @router.post("/admin/models/load")
    async def admin_load(body: LoadModelRequest):
        try:
            await host.load(body.spec(host.default_tp, host.default_pp, host.default_cpu_experts))
        except InvalidSpec as exc:  # refused before the swap began: a path, tp or the decoding plugin / options
            raise APIError(400, str(exc), exc.param) from None
        except ValueError as exc:  # bad path, unknown plugin, bad dtype, a split the model cannot take
            about_decoding = body.decoding != "none" and f"plugin {body.decoding!r}" in str(exc)
            param = ("decoding_options" if about_decoding else "tp" if "tensor-parallel" in str(exc)
                     else "pp" if "pipeline" in str(exc)
                     else "kv_cache_dtype" if "kv_cache_dtype" in str(exc)
                     else "kv_cache_gb" if "kv_cache" in str(exc) else "model")
            after = "" if host.engine is not None else " (no model is loaded: the tensor-parallel one went first)"
            raise APIError(400, f"{exc}{after}", param) from None
        except Exception as exc:  # the old model keeps serving, unless a tensor-parallel one was closed first
            after = "the previous model keeps serving" if host.engine is not None else "no model is loaded"
            raise APIError(400, f"loading failed, {after}: {type(exc).__name__}: {exc}", "model") from None
        return {"loaded": model_card()}

    @router.post("/admin/models/unload")
    async def admin_unload():
        await host.unload()
        return {"loaded": None}

    return router
