"""Token embedding and the LM head (vocabulary split across tensor-parallel ranks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.core.distributed import tp_group, tp_rank, tp_size
from kvforge.core.layers.linear import ColumnParallelLinear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_size, self.tp_rank, self.tp_group = tp_size(), tp_rank(), tp_group()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        rows = max(0, min(self.shard_size, vocab_size - self.vocab_start))
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.takes_gguf_blocks = True  # a GGUF's quantized table is served from its blocks (weight_loader)
        self.shared_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def share_rows(self, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Read rows (this rank's vocabulary shard, by local index) from another holder of the same table -- a tied
        head's codes, dequantized to exactly the values of the dense copy -- and free the dense copy."""
        if self.weight is not None:
            self.dtype = self.weight.dtype
        self.shared_rows = lookup
        self.weight = None

    @property
    def table_bytes(self) -> int:
        """What the table holds of its own (0 when its rows come from the head)."""
        return 0 if self.weight is None else self.weight.numel() * self.weight.element_size()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        return self.shared_rows(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(loaded, "gguf_type", None) is not None:  # a GGUF's blocks: rows dequantized as they are looked up
            from kvforge.core.gguf_source import row_reader

            self.share_rows(row_reader(loaded, self.vocab_start, self.rows))
            return
        rows = loaded.narrow(0, self.vocab_start, param.shape[0])
        if rows.shape != param.shape:
            raise ValueError(f"embedding of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        local = ids - self.vocab_start
        mask = (local >= 0) & (local < self.rows)
        out = self._lookup(local.clamp(0, self.rows - 1)) * mask.unsqueeze(-1)
        torch.distributed.all_reduce(out, group=self.tp_group)
        return out


class ParallelLMHead(ColumnParallelLinear):
    """Logits over the vocabulary; its quant method is the QuantConfig's for `lm_head` (dense: quantized
    checkpoints keep the head unquantized)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, quant_config=None,
                 prefix: str = "lm_head") -> None:
        self.vocab_size = vocab_size
        padded = -(-vocab_size // tp_size()) * tp_size()
        super().__init__(hidden_size, [padded], bias=False, params_dtype=dtype, quant_config=quant_config,
                         prefix=prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        missing = self.output_sizes[0] - loaded.shape[0]
        if missing > 0:  # pad the vocabulary to a multiple of the tensor-parallel size
            loaded = F.pad(loaded, (0, 0, 0, missing))
        super().weight_loader(param, loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, logits, group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab_size]
