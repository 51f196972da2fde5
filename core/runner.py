"""ModelRunner: owns the model and the KV pool; turns a scheduled batch into tensors, runs one
forward over the flat batch and samples the next token of every sequence that reached its end."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvforge.core.config import EngineConfig, kv_bytes_per_token
from kvforge.core.context import StepContext, set_context
from kvforge.core.distributed import tp_size
from kvforge.core.loader import build_model, load_weights
from kvforge.core.models.llama import head_dim_of
from kvforge.core.plugins import QUANT_GROUP, discover
from kvforge.core.sampler import sample
from kvforge.core.scheduler import ScheduledSeq

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, hf_config, progress: bool = True) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        quant_cls = discover(QUANT_GROUP).get(config.quant)
        self.quant_name = config.quant
        with torch.device(self.device):
            self.model = build_model(hf_config, config.torch_dtype, lambda: quant_cls(**config.quant_options))
        load_weights(self.model, model_path, progress=progress)
        self.model.eval()

        self.num_kv_heads = hf_config.num_key_value_heads // tp_size()
        self.head_dim = head_dim_of(hf_config)
        self.num_layers = hf_config.num_hidden_layers
        self.kv_bytes_per_block = self.block_size * kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, config.torch_dtype)
        self.num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // self.kv_bytes_per_block)
        slots = self.num_blocks * self.block_size
        shape = (self.num_layers, slots, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.k_cache[i], self.v_cache[i]
        self._block_offsets = torch.arange(self.block_size, device=self.device)

    def weight_bytes(self) -> int:
        total = 0
        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                total += method.weight_bytes(module)
            else:
                total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        return total

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        table = torch.tensor(block_table[: -(-end // self.block_size)], dtype=torch.long)
        slots = (table[:, None] * self.block_size + self._block_offsets[None, :]).flatten()
        return slots[start:end]

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, StepContext, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc, seq_lens, context_slots, sample_rows = [0], [], [], []
        slot_mapping = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots = self._slots(seq.block_table, 0, end)
            context_slots.append(slots)
            slot_mapping.append(slots[start:end])
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the chunk reaches the sequence's end: it yields a token
                sample_rows.append(query_start_loc[-1] - 1)
        context = StepContext(
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            slot_mapping=torch.cat(slot_mapping),
            query_start_loc=query_start_loc, seq_lens=seq_lens, context_slots=context_slots,
        )
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), context, sample_rows

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> list[int | None]:
        """One forward over the batch; returns the sampled token per sequence (None mid-prefill)."""
        input_ids, context, sample_rows = self.prepare(batch)
        set_context(context)
        try:
            hidden = self.model(input_ids, context.positions)
            logits = self.model.compute_logits(hidden[sample_rows]).float()
        finally:
            set_context(None)
        sampled_seqs = [item.seq for item in batch if item.seq.num_computed_tokens + item.num_new_tokens
                        == item.seq.num_tokens]
        tokens = iter(sample(logits, sampled_seqs))
        return [next(tokens) if item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens
                else None for item in batch]
