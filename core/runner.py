"""ModelRunner: owns the model and the KV pool; turns a scheduled batch into tensors, runs one
forward over the flat batch and returns the logits of every sequence whose chunk reached its end."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvforge.core.config import EngineConfig, kv_bytes_per_token
from kvforge.core.context import DecodeGroup, PrefillSeq, StepContext, set_context
from kvforge.core.distributed import tp_size
from kvforge.core.loader import build_model, load_weights
from kvforge.core.models.llama import head_dim_of
from kvforge.core.plugins import QUANT_GROUP, discover
from kvforge.core.scheduler import ScheduledSeq

log = logging.getLogger(__name__)

DECODE_GROUP_SIZE = 16  # decode tokens attended together; similar lengths keep the padding small


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, hf_config, progress: bool = True) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        quant_cls = discover(QUANT_GROUP).get(config.quant)
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

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    def weight_bytes(self) -> int:
        total = 0
        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                total += method.weight_bytes(module)
            else:
                total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        return total

    def _slot_table(self, block_tables: list[list[int]], length: int) -> torch.Tensor:
        """[seqs, length] KV slots of positions 0..length-1 (rows past a table's end point at slot 0)."""
        num_blocks = -(-length // self.block_size)
        table = torch.zeros(len(block_tables), num_blocks, dtype=torch.long)
        for row, blocks in enumerate(block_tables):
            used = blocks[:num_blocks]
            table[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        slots = table.unsqueeze(2) * self.block_size + self._block_offsets
        return slots.view(len(block_tables), -1)[:, :length]

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, StepContext, list[ScheduledSeq]]:
        """Order the batch (decode tokens by context length, then prefill chunks) and build the step's
        tensors. Returns the input ids, the context and the batch in its new order."""
        decodes = sorted((item for item in batch if item.num_new_tokens == 1),
                         key=lambda item: item.seq.num_computed_tokens)
        prefills = [item for item in batch if item.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, slot_mapping = [], [], []
        groups: list[DecodeGroup] = []
        for first in range(0, len(decodes), DECODE_GROUP_SIZE):
            items = decodes[first:first + DECODE_GROUP_SIZE]
            lengths = [item.seq.num_computed_tokens + 1 for item in items]
            slots = self._slot_table([item.seq.block_table for item in items], max(lengths))
            lengths_t = torch.tensor(lengths, dtype=torch.long)
            groups.append(DecodeGroup(first, first + len(items), slots, lengths_t, max(lengths),
                                      uniform=min(lengths) == max(lengths)))
            slot_mapping.append(slots.gather(1, (lengths_t - 1).unsqueeze(1)).squeeze(1))
            for item, length in zip(items, lengths):
                input_ids.append(item.seq.token_ids[length - 1])
                positions.append(length - 1)
        prefill_seqs: list[PrefillSeq] = []
        for item in prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            context_slots = self._slot_table([seq.block_table], end)[0]
            slot_mapping.append(context_slots[start:end])
            row = len(positions) - item.num_new_tokens
            prefill_seqs.append(PrefillSeq(row, row + item.num_new_tokens, end, context_slots))
        context = StepContext(
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            slot_mapping=torch.cat(slot_mapping).to(self.device),
            prefills=prefill_seqs, decode_groups=groups, num_tokens=len(positions),
        )
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), context, ordered

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """One forward over the batch. Returns the items whose chunk reached the end of their sequence
        (they get a next token) and their fp32 logits, row for row."""
        input_ids, context, ordered = self.prepare(batch)
        rows, sampled = [], []
        row = 0
        for item in ordered:
            row += item.num_new_tokens
            if item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens:
                rows.append(row - 1)
                sampled.append(item)
        set_context(context)
        try:
            hidden = self.model(input_ids, context.positions)
            logits = self.model.compute_logits(hidden[rows]).float() if rows else hidden.new_empty(0, 0)
        finally:
            set_context(None)
        return sampled, logits

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source -> destination) in every layer: forked samples get their own
        copy of the prompt's partial last block."""
        for src, dst in pairs:
            size = self.block_size
            for cache in (self.k_cache, self.v_cache):
                cache[:, dst * size:(dst + 1) * size] = cache[:, src * size:(src + 1) * size]
