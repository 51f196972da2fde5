"""Embedding requests: a prompt prefilled through the engine's batches without sampling, its embedding pooled from the
model's last hidden states (after the final norm, what HF transformers calls `last_hidden_state`).

How they are pooled is the model's: a sentence-transformers checkpoint says it in its `modules.json` and
`1_Pooling/config.json` (mean of the tokens, the last token -- Qwen3-Embedding, gte-Qwen2, e5-mistral -- or the
first, and whether a Normalize module follows); any other model: the mean over the prompt's tokens, L2-normalised.

Every position's hidden state may be needed, so such a request never starts from the prefix cache; the runner hands
back each chunk's sum and its first and last rows, added up as the prefill goes (a preempted request starts again
with its recomputation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

# sentence-transformers' pooling flags -> ours; the others (max, mean of sqrt length, weighted mean) are not supported
POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls"}
# the sentence-transformers modules a checkpoint may list: its transformer, then pooling, then normalisation
KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's settings. `n` and `max_tokens` keep the shape admission checks read."""

    normalize: bool | None = None  # L2-normalised (cosine similarity is then a dot product); None: as the model says
    # a scoring request instead: the logits of these tokens after the prompt's last token (a yes / no reranker's
    # answer, app/generate/rerank.py); only that position is needed, so it may start from the prefix cache
    score_token_ids: tuple[int, ...] = ()
    n: ClassVar[int] = 1
    max_tokens: ClassVar[int] = 0  # nothing is generated: the prompt alone must fit the context
    logit_bias: ClassVar[None] = None
    constraint: ClassVar[None] = None


@dataclass(frozen=True)
class ModelPooling:
    """How a model's embeddings are pooled."""

    mode: str = "mean"  # mean | last | cls
    normalize: bool = True
    source: str = "default"  # "sentence-transformers": from the checkpoint's own config


def model_pooling(model_path: Path) -> ModelPooling:
    """The checkpoint's sentence-transformers pooling, or the default; ValueError for one this engine cannot do."""
    modules_file = model_path / "modules.json" if model_path.is_dir() else None
    if modules_file is None or not modules_file.exists():
        return ModelPooling()
    modules = {m["type"].rsplit(".", 1)[-1]: m for m in json.loads(modules_file.read_text())}
    unknown = sorted(set(modules) - KNOWN_MODULES)
    if unknown or "Pooling" not in modules:
        raise ValueError(f"{model_path.name}: sentence-transformers modules {', '.join(unknown) or '(no Pooling)'} "
                         f"are not supported (only {', '.join(sorted(KNOWN_MODULES))})")
    config = json.loads((model_path / modules["Pooling"]["path"] / "config.json").read_text())
    chosen = [flag for flag, on in config.items() if flag.startswith("pooling_mode_") and on]
    if len(chosen) != 1 or chosen[0] not in POOLING_FLAGS:
        raise ValueError(f"{model_path.name}: pooling {' + '.join(chosen) or 'none'} is not supported (one of "
                         f"{', '.join(POOLING_FLAGS)})")
    return ModelPooling(POOLING_FLAGS[chosen[0]], "Normalize" in modules, "sentence-transformers")


@dataclass
class PooledHidden:
    """An embedding request's last hidden states so far: their fp32 sum, the first position's and the latest one's;
    a scoring request's score tokens' logits after the latest position."""

    total: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    scores: list[float] | None = None

    @classmethod
    def of_rows(cls, rows: torch.Tensor, scores: list[float] | None = None) -> PooledHidden:
        """One chunk's rows [tokens, hidden] (any dtype, any device), kept in fp32 on the CPU."""
        rows = rows.float()
        return cls(rows.sum(0).cpu(), rows[0].cpu(), rows[-1].cpu(), scores)

    def then(self, chunk: PooledHidden) -> PooledHidden:
        """This prefill followed by its next chunk."""
        return PooledHidden(self.total + chunk.total, self.first, chunk.last, chunk.scores)

    def embedding(self, num_tokens: int, mode: str, normalize: bool) -> list[float]:
        vector = {"mean": lambda: self.total / num_tokens, "last": lambda: self.last, "cls": lambda: self.first}[mode]()
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.tolist()
