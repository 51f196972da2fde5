"""The engine's side of the plugin API's DraftTarget (core/plugins.py): what a speculative-decoding proposer gets
from the engine it drafts for -- the target's settings, tokenizer and model, and builders for a runner and a KV pool
of the drafter's own, so a plugin never assembles core parts itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvforge.core.plugins import DraftModel, DraftTarget

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

    from kvforge.core.config import EngineConfig
    from kvforge.core.kv.manager import KVCacheManager
    from kvforge.core.runner import ModelRunner
    from kvforge.core.tokenizer import Tokenizer


@dataclass
class EngineDraftTarget(DraftTarget):
    config: EngineConfig | None
    hf_config: PretrainedConfig | None
    model_path: Path | None
    tokenizer: Tokenizer | None
    model: nn.Module | None  # the target's model (a drafter may run its first layers)
    kernels: str = "torch"  # the attention / norm kernels the target's layers were built with

    def draft_config(self) -> EngineConfig:
        """The target's engine settings for a drafter: dense weights, no speculation of its own."""
        return dataclasses.replace(self.config, quant="none", quant_options={}, decoding="none",
                                   decoding_options={}, num_threads=None)

    def runner_for(self, model: nn.Module, hf_config: PretrainedConfig) -> ModelRunner:
        """A runner of the drafter's own for `model`, built on the target's layers (their kernels)."""
        from kvforge.core.runner import ModelRunner

        return ModelRunner(self.draft_config(), None, hf_config, model=model, kernels=self.kernels)

    def load_draft_model(self, model: str) -> DraftModel:
        """Load a draft model (a directory, .gguf file or embedded alias) on the target's device and dtype."""
        from kvforge.core.loader import load_config, resolve_model
        from kvforge.core.runner import ModelRunner
        from kvforge.core.tokenizer import Tokenizer

        path = resolve_model(model)
        hf_config = load_config(path)
        config = dataclasses.replace(self.draft_config(), model=str(path))
        return DraftModel(ModelRunner(config, path, hf_config, progress=False), hf_config, Tokenizer(path))

    def kv_pool(self, num_blocks: int, block_size: int) -> KVCacheManager:
        """Block tables over a pool of `num_blocks` of the drafter's own (no prefix caching)."""
        from kvforge.core.kv.blocks import BlockPool
        from kvforge.core.kv.manager import KVCacheManager

        return KVCacheManager(BlockPool(num_blocks, enable_caching=False), block_size, b"")
