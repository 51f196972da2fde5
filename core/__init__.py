"""kvforge's engine: `from kvforge.core import LLM, SamplingParams`.

The public names are imported on first use, so that importing a light submodule (the sandbox worker's templates and
grammars: core/sandbox/) does not load torch and the engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "AsyncEngine": "async_engine", "RequestStream": "async_engine", "EngineConfig": "config", "LLMEngine": "engine",
    "LLM": "llm", "CompletionOutput": "llm", "RequestOutput": "output", "PoolingParams": "pooling",
    "SamplingParams": "sampling", "RequestRejected": "scheduler",
}
__all__ = ["LLM", "LLMEngine", "AsyncEngine", "RequestStream", "EngineConfig", "SamplingParams", "PoolingParams",
           "CompletionOutput", "RequestOutput", "RequestRejected"]

if TYPE_CHECKING:
    from kvforge.core.async_engine import AsyncEngine, RequestStream
    from kvforge.core.config import EngineConfig
    from kvforge.core.engine import LLMEngine
    from kvforge.core.llm import LLM, CompletionOutput
    from kvforge.core.output import RequestOutput
    from kvforge.core.pooling import PoolingParams
    from kvforge.core.sampling import SamplingParams
    from kvforge.core.scheduler import RequestRejected


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvforge.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvforge.core.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value
