"""kvforge's engine: `from kvforge.core import LLM, SamplingParams`."""

from kvforge.core.async_engine import AsyncEngine, RequestStream
from kvforge.core.config import EngineConfig
from kvforge.core.engine import LLMEngine
from kvforge.core.llm import LLM, CompletionOutput
from kvforge.core.output import RequestOutput
from kvforge.core.pooling import PoolingParams
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import RequestRejected

__all__ = ["LLM", "LLMEngine", "AsyncEngine", "RequestStream", "EngineConfig", "SamplingParams", "PoolingParams",
           "CompletionOutput", "RequestOutput", "RequestRejected"]
