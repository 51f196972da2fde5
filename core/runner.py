"""ModelRunner: owns the model and the KV pool; lays a scheduled batch out as plain lists (`StepInputs`),
runs one forward over the flat batch and returns the logits rows of the sequences that sample, in the
plan's order. Under tensor parallelism rank 0 lays out and every rank runs the same StepInputs (core/tp.py); under
pipeline parallelism each stage's runner holds its layers and their KV, and runs the same StepInputs on the previous
stage's hidden states (core/pp.py)."""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvforge.core import gguf_source
from kvforge.core.config import EngineConfig, kv_bytes_per_token
from kvforge.core.context import (
    DECODE_GROUP_SIZE,
    DecodeGroup,
    KernelBatch,
    PrefillSeq,
    StepContext,
    block_tables_tensor,
    gather_rows,
    set_context,
)
from kvforge.core.distributed import heads_of_rank, stage_layers, tp_rank, tp_size
from kvforge.core.host_memory import keep_freed_memory, release_freed_memory, zeroed_on_demand
from kvforge.core.images import ImageInput, key_limits
from kvforge.core.kernel_choice import ShapeChoice, choose_kernels
from kvforge.core.kernels.runtime import resolve_kernels
from kvforge.core.kv.quant import kv_format
from kvforge.core.layers.backend import kernel_backend
from kvforge.core.layers.moe import SparseMoeBlock, host_experts
from kvforge.core.loader import build_model, load_weights
from kvforge.core.models.causal_lm import StageCarry
from kvforge.core.models.llama import head_dim_of
from kvforge.core.plugins import QUANT_GROUP, checkpoint_quantization, discover
from kvforge.core.pooling import PooledHidden
from kvforge.core.quant_config import QuantConfig
from kvforge.core.step import ScheduledSeq

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step's flat batch as plain lists: what rank 0 sends to the other tensor-parallel ranks."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # KV slot of each new token (block * block_size + offset)
    # rows [first, last) of the flat batch, each context's block table (padded to one length), context lengths
    decode_groups: list[tuple[int, int, list[list[int]], list[int]]]
    # rows [first, last), context length, block table of the whole context
    prefills: list[tuple[int, int, int, list[int]]]
    logits_rows: list[int]  # rows whose logits the step returns
    # rows [first, last) of each embedding request, and the tokens whose logits a scoring request wants after them
    pool_rows: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    # rows [first, last) whose next prompt tokens' logprobs are asked for, those tokens, and how many top ones
    prompt_rows: list[tuple[int, int, list[int], int]] = field(default_factory=list)
    # the images whose rows this step's prefill chunks cover: (image, flat rows, the image's rows for them)
    images: list[tuple[ImageInput, list[int], list[int]]] = field(default_factory=list)
    # rows [first, last) of prefill chunks that see keys past their own position, and the last key position they see
    # (an image's tokens that attend to the whole image: core/images.py key_limits)
    key_limits: list[tuple[int, int, int]] = field(default_factory=list)

    def decode_rows(self) -> tuple[list[list[int]], list[int]]:
        """Each decode row's block table and context length, in row order (the groups laid end to end)."""
        return ([table for group in self.decode_groups for table in group[2]],
                [length for group in self.decode_groups for length in group[3]])


@dataclass
class StepOutput:
    """What one forward returns: the fp32 logits of `StepInputs.logits_rows`, and for each embedding request in the
    step (`StepInputs.pool_rows`, in batch order) its chunk's last hidden states, pooled (core/pooling.py)."""

    logits: torch.Tensor
    pooled: list[PooledHidden] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # of `StepInputs.prompt_rows`, in order


@dataclass
class PromptLogprobs:
    """The logprobs of a run of prompt tokens (each given the tokens before it) and each position's top ones."""

    token_ids: list[int]
    chosen: list[float]
    top: list[list[tuple[int, float]]]


@dataclass
class StagePlacement:
    """Where one pipeline stage's part of the model lives (the whole model: one stage): its decoder layers
    [first, last), whether it holds the embedding / LM head (the first stage) and the final norm (the last), its
    processes (its tensor-parallel ranks), device, and the bytes of weights and KV pool of all its ranks."""

    first_layer: int
    last_layer: int
    embedding: bool
    final_norm: bool
    processes: int
    device: str
    weights_bytes: int
    kv_cache_bytes: int
    experts_device: str | None = None  # a mixture-of-experts model's experts (cpu under cpu_experts); None: dense
    experts_bytes: int = 0  # of weights_bytes, the experts'
    vision_bytes: int = 0  # of weights_bytes, a vision model's tower and connector (on `device`)

    def as_dict(self) -> dict:
        return {"layers": [self.first_layer, self.last_layer], "embedding_and_lm_head": self.embedding,
                "final_norm": self.final_norm, "processes": self.processes, "device": self.device,
                "weights_bytes": self.weights_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "experts_device": self.experts_device, "experts_bytes": self.experts_bytes,
                "vision_bytes": self.vision_bytes}


PROMPT_LOGITS_ROWS = 64  # rows turned into logits at once: a 128k vocabulary's fp32 logits of 64 rows are 32 MiB


def check_device(device: torch.device) -> torch.device:
    """The device, or a ValueError naming what is missing (before anything is loaded)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} is not available: this torch ({torch.__version__}) sees no "
                             f"CUDA GPU; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} is not available: torch sees {torch.cuda.device_count()} GPU(s)")
    return device


class ModelRunner:
    failure: str | None = None  # a ParallelRunner's ranks can fail; one process cannot, apart from itself
    on_failure = None
    max_in_flight = 1  # submit runs the step whole

    def __init__(self, config: EngineConfig, model_path: Path | None, hf_config, progress: bool = True,
                 model: torch.nn.Module | None = None, kernels: str = "torch") -> None:
        """Loads the model from `model_path`, or runs a given `model` (a drafter built on the target's
        own layers, with the `kernels` they were built with); `hf_config` shapes the KV pool. The pool
        itself comes with `allocate_kv`."""
        self.config = config
        self.block_size = config.block_size
        self.device = check_device(torch.device(config.device))
        self.kv_format = kv_format(config.kv_cache_dtype)  # None: K and V in the model's dtype
        if self.kv_format is not None and (reason := self.kv_format.unsupported(head_dim_of(hf_config))):
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} cannot store this model's KV: {reason}")
        if self.device.type == "cpu":
            keep_freed_memory()  # activations stay mapped between steps (core/host_memory.py)
        self.graphs = None  # DecodeGraphs once enable_decode_graphs has captured them
        self.cuda_graph_safe = False  # whether the quant method lets CUDA graphs capture decode steps
        self.kernel_choices: list[ShapeChoice] = []  # the kernel chosen per op class and shape (kernel_choice.py)
        self.gguf_weights: str | None = None  # a GGUF's blocks: "copied" onto huge pages or "mapped" (gguf_weights)
        if model is None:
            self.gguf_weights = self._gguf_weights(config, model_path)
            model, kernels, self.cuda_graph_safe = self._load(config, model_path, hf_config, progress,
                                                              self.gguf_weights == "copied")
            self.kernel_choices = choose_kernels(model, config.torch_dtype, config.linear_kernels,
                                                 config.decode_attention, kv_format=self.kv_format)
            if self.device.type == "cpu":
                release_freed_memory()  # what loading freed, not kept for the step loop
        self.model = model.eval()
        self.kernels = kernels  # the attention / norm kernels its layers were built with

        heads = heads_of_rank(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp_size(), tp_rank())
        self.first_kv_head, self.num_kv_heads = heads.kv_first, heads.kv_count
        self.head_dim = head_dim_of(hf_config)
        # a pool row: one token's K (or V) of one head -- head_dim values, or a quantized format's bytes
        self.kv_row = self.head_dim if self.kv_format is None else self.kv_format.row_bytes(self.head_dim)
        # one block of every layer with all the model's KV heads: the persisted tier's unit (rank-independent)
        self.kv_block_shape = (hf_config.num_hidden_layers, 2, hf_config.num_key_value_heads, self.block_size,
                               self.kv_row)
        self.stage = stage_layers(hf_config)  # this pipeline stage's layers: its pool holds their KV
        self.num_layers = self.stage.count
        self.kv_dtype = config.torch_dtype if self.kv_format is None else torch.uint8
        self.kv_bytes_per_block = self.block_size * kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, config.torch_dtype, config.kv_cache_dtype)
        self.num_blocks = 0
        self.kv_cache = torch.empty(0)

    def allocate_kv(self, num_blocks: int) -> None:
        """The paged KV pool: `num_blocks` blocks of `block_size` tokens for every layer."""
        self.graphs = None  # captured over the old pool
        self.kv_cache = torch.empty(0)  # free the old pool before the new one
        self.num_blocks = num_blocks
        # head-major paged layout (see layers/attention.py)
        shape = (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.kv_row)
        if self.device.type == "cpu":  # its pages committed as blocks are written: memory follows the context used
            self.kv_cache = zeroed_on_demand(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        # row offsets of each (K/V, head) plane in the 2-D views of a layer's cache (see context.py)
        planes = torch.arange(2 * self.num_kv_heads, dtype=torch.long).view(2, 1, self.num_kv_heads, 1)
        self._plane_blocks = planes * num_blocks  # [2 (K/V), 1, kv_heads, 1]
        self._plane_slots = planes * num_blocks * self.block_size

    @staticmethod
    def _load(config: EngineConfig, model_path: Path, hf_config, progress: bool,
              gguf_copied: bool = False) -> tuple[torch.nn.Module, str, bool]:
        """The loaded model, the kernels its layers use, and whether its quant method is CUDA-graph safe."""
        quant_cls = discover(QUANT_GROUP).get(config.quant)
        if torch.device(config.device).type not in quant_cls.devices:  # refused before anything is loaded
            raise ValueError(f"quant plugin {config.quant!r} runs on {' / '.join(quant_cls.devices)}, "
                             f"not on {torch.device(config.device).type}")
        options = quant_cls.validate_options(config.quant_options)
        kernels = resolve_kernels(config.kernels, torch.device(config.device))
        with torch.device(config.device), kernel_backend(kernels, quant_cls.exact_fp32(options)), \
                host_experts(config.cpu_experts):
            model = build_model(hf_config, config.torch_dtype, QuantConfig.for_checkpoint(
                quant_cls, options, checkpoint_quantization(hf_config, model_path)), config.context_length(hf_config))
        load_weights(model, model_path, progress=progress,
                     transform=lambda tensors: quant_cls.checkpoint_tensors(tensors, options),
                     gguf_copied=gguf_copied)
        syncs = any(getattr(module, "syncs_with_host", False) for module in model.modules())  # (core/layers/moe.py)
        return model, kernels, quant_cls.cuda_graph_safe and not syncs

    @staticmethod
    def _gguf_weights(config: EngineConfig, model_path: Path) -> str | None:
        """Where a GGUF model's blocks are read from (config.gguf_weights): "copied" onto huge pages (logged) or
        "mapped"; None for a model not served from a GGUF's blocks."""
        if not (config.native_gguf and gguf_source.is_index(model_path)):
            return None
        gguf = gguf_source.source_of(model_path)
        if not gguf_source.copies_weights(config.gguf_weights, gguf, torch.device(config.device).type,
                                          config.tp_size * config.pp_size):
            return "mapped"
        log.info("GGUF blocks of %s copied onto huge pages (%.2f GiB; --gguf-weights mapped serves them from the "
                 "file)", gguf.name, gguf.stat().st_size / 2**30)
        return "copied"

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    def placement(self) -> list[StagePlacement]:
        """This runner's stage (one process; a parallel runner adds its other ranks)."""
        stage = self.stage
        blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        experts_device = None if not blocks else "cpu" if blocks[0].on_host else str(self.device)
        vision = [getattr(self.model, name) for name in getattr(self.model, "vision_modules", ())]
        return [StagePlacement(stage.first, stage.last, stage.is_first, stage.is_last, 1, str(self.device),
                               self.weight_bytes(), self.kv_cache_bytes, experts_device,
                               sum(self.weight_bytes(block.experts) for block in blocks),
                               sum(self.weight_bytes(part) for part in vision))]

    def weight_bytes(self, part: torch.nn.Module | None = None) -> int:
        """The weights' bytes (of `part` of the model: None, all of it)."""
        total = 0
        for module in (part or self.model).modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                total += method.weight_bytes(module)
            else:
                total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        return total

    def _gather_rows(self, tables: list[list[int]]) -> torch.Tensor:
        return gather_rows(self._plane_blocks, tables).to(self.device)

    def layout(self, batch: list[ScheduledSeq], all_logits: bool = False) -> StepInputs:
        """Order the batch (decode tokens by context length, then prefill chunks) and lay it out flat. The
        logits rows are those of the items that sample, in batch order: 1 + drafts rows each (the logits
        after its last token and after each draft). `all_logits`: every row's, in flat order."""
        decodes = sorted((item for item in batch if item.num_new_tokens == 1),
                         key=lambda item: item.seq.num_computed_tokens)
        prefills = [item for item in batch if item.num_new_tokens > 1]
        size = self.block_size
        inputs = StepInputs([], [], [], [], [], [])
        for first in range(0, len(decodes), DECODE_GROUP_SIZE):
            items = decodes[first:first + DECODE_GROUP_SIZE]
            lengths = [item.seq.num_computed_tokens + 1 for item in items]
            blocks = -(-max(lengths) // size)
            tables = []
            for item, length in zip(items, lengths):
                own = item.seq.block_table[:blocks]
                tables.append(own + [0] * (blocks - len(own)))
                inputs.input_ids.append(item.seq.token_ids[length - 1])
                inputs.positions.append(length - 1)
                inputs.slots.append(own[(length - 1) // size] * size + (length - 1) % size)
            inputs.decode_groups.append((first, first + len(items), tables, lengths))
        for item in prefills:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            inputs.input_ids.extend(seq.token_ids_with_drafts[start:end])
            inputs.positions.extend(range(start, end))
            table = seq.block_table
            inputs.slots.extend(table[p // size] * size + p % size for p in range(start, end))
            row = len(inputs.positions) - item.num_new_tokens
            inputs.prefills.append((row, row + item.num_new_tokens, end, table[: -(-end // size)]))
            for image in seq.images:
                first, last = bisect_left(image.positions, start), bisect_left(image.positions, end)
                if first < last:  # the chunk covers some of this image's positions: their rows go in
                    inputs.images.append((image, [row + p - start for p in image.positions[first:last]],
                                          list(range(first, last))))
            inputs.key_limits.extend((row + first - start, row + last - start, limit)
                                     for first, last, limit in key_limits(seq.images, start, end))
        if all_logits:
            inputs.logits_rows = list(range(len(inputs.positions)))
            return inputs
        last_row, row = {}, 0  # each item's last row in the flat batch
        for item in decodes + prefills:
            row += item.num_new_tokens
            last_row[id(item)] = row
        for item in batch:
            end = last_row[id(item)]
            first, last = item.prompt_logprob_span
            if last > first:
                row, start = end - item.num_new_tokens, item.seq.num_computed_tokens
                targets = item.seq.prompt_token_ids[start + first + 1:start + last + 1]
                inputs.prompt_rows.append((row + first, row + last, targets, item.seq.params.prompt_logprobs))
            if item.samples:
                inputs.logits_rows.extend(range(end - item.num_logits_rows, end))
            elif item.seq.pools:  # a scoring request's tokens: only for the chunk that ends its prompt
                ends = item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens
                scored = item.seq.params.score_token_ids if ends else ()
                inputs.pool_rows.append((end - item.num_new_tokens, end, scored))
        return inputs

    def _context(self, inputs: StepInputs) -> StepContext:
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)
        if self.kernels == "triton":
            return StepContext(positions, self.kv_cache, kernel=self._kernel_batch(inputs), kv_format=self.kv_format)
        size = self.block_size
        groups = [DecodeGroup(first, last, self._gather_rows(tables), len(tables[0]) * size,
                              torch.tensor(lengths, dtype=torch.long))
                  for first, last, tables, lengths in inputs.decode_groups]
        # a chunk with nothing cached before it attends to its own fresh K/V: no gather
        prefills = [PrefillSeq(first, last, end, None if end == last - first else self._gather_rows([table]),
                               self._chunk_key_limits(inputs, first, last, end))
                    for first, last, end, table in inputs.prefills]
        # rows ordered (K/V, token, head), matching torch.stack((k, v)) of [tokens, kv_heads, head_dim]
        write_rows = (self._plane_slots + torch.tensor(inputs.slots, dtype=torch.long).view(1, -1, 1, 1)).view(-1)
        decode_tables, _ = inputs.decode_rows()
        tables = block_tables_tensor(decode_tables + [table for _, _, _, table in inputs.prefills])
        chunk_rows = torch.tensor([1] * len(decode_tables) + [last - first for first, last, _, _ in inputs.prefills])
        row_seqs = torch.repeat_interleave(torch.arange(len(chunk_rows), dtype=torch.int32), chunk_rows)
        return StepContext(positions, self.kv_cache, write_rows.to(self.device), prefills, groups,
                           tables.to(self.device), row_seqs.to(self.device), (positions + 1).int(),
                           kv_format=self.kv_format)

    def _chunk_key_limits(self, inputs: StepInputs, first: int, last: int, end: int) -> torch.Tensor | None:
        """The last key position each row of the chunk in rows [first, last) sees (None: its own, causal)."""
        spans = [(a, b, limit) for a, b, limit in inputs.key_limits if first <= a < last]
        if not spans:
            return None
        limits = torch.arange(end - (last - first), end)
        for a, b, limit in spans:
            limits[a - first:b - first] = limit
        return limits  # on the host: the masks are built there

    def _kernel_batch(self, inputs: StepInputs) -> KernelBatch:
        """The Triton kernels' tensors: one int32 buffer built on the host, moved in one copy, then sliced."""
        decode_tables, decode_lens = inputs.decode_rows()
        prefill_tables = [p[3] for p in inputs.prefills]
        starts = [0]
        for first, last, _, _ in inputs.prefills:
            starts.append(starts[-1] + last - first)
        decode_width = max(map(len, decode_tables), default=0)
        prefill_width = max(map(len, prefill_tables), default=0)
        limits = []  # each prefill row's last key position, where a chunk has rows that see past their own
        if inputs.key_limits:
            limits = inputs.positions[len(decode_lens):]
            for a, b, limit in inputs.key_limits:
                limits[a - len(decode_lens):b - len(decode_lens)] = [limit] * (b - a)
        flat = list(inputs.slots) + decode_lens + [n for _, _, n, _ in inputs.prefills] + starts + limits
        for tables, width in ((decode_tables, decode_width), (prefill_tables, prefill_width)):
            for table in tables:
                flat.extend(table)
                flat.extend([0] * (width - len(table)))
        buffer = torch.tensor(flat, dtype=torch.int32).to(self.device)
        sizes = [len(inputs.slots), len(decode_lens), len(prefill_tables), len(starts), len(limits),
                 len(decode_tables) * decode_width, len(prefill_tables) * prefill_width]
        slots, d_lens, p_lens, starts_t, limits_t, d_tables, p_tables = buffer.split(sizes)
        return KernelBatch(slots, len(decode_lens), d_tables.view(len(decode_tables), decode_width), d_lens,
                           p_tables.view(len(prefill_tables), prefill_width), starts_t, p_lens,
                           max((last - first for first, last, _, _ in inputs.prefills), default=0),
                           limits_t if limits else None)

    def enable_decode_graphs(self, max_model_len: int, max_batch: int, capture: bool = True) -> None:
        """Run decode-only steps of up to `max_batch` sequences through CUDA graphs (core/cuda_graphs.py),
        captured now over the current KV pool. `capture=False` (CPU tests): the same padded static buffers,
        run eagerly."""
        from kvforge.core.cuda_graphs import DecodeGraphs

        if self.kernels != "triton":
            raise ValueError("CUDA graphs need the Triton kernels (kernels='triton')")
        if not self.cuda_graph_safe:
            raise ValueError(f"the {self.config.quant!r} quant method may sync with the host: no CUDA graphs")
        self.graphs = None  # a failed capture leaves the eager path
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, max_model_len, max_batch, capture,
                                   self.kv_format)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, carried: StageCarry | None = None) -> StepOutput | StageCarry:
        """One forward over the flat batch: the fp32 logits of `inputs.logits_rows` and the embedding requests'
        pooled hidden states. A pipeline stage after the first starts from the previous one's `carried` hidden
        states; one before the last returns its own for the next."""
        if self.graphs is not None and not inputs.prefills and self.graphs.fits(len(inputs.input_ids)):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.slots, *inputs.decode_rows())
            return self.output(hidden, inputs)
        context = self._context(inputs)
        input_ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device)
        set_context(context)
        try:
            if inputs.images:  # the step's embeddings with image rows in place: the decoder starts from them
                carried = StageCarry(self.model.embed_with_images(input_ids, inputs.images))
            # a stage after the first starts from the one before (a drafter's model takes no carried states)
            hidden = self.model(input_ids, context.positions, *(() if carried is None else (None, carried)))
        finally:
            set_context(None)
        if isinstance(hidden, StageCarry) or not self.stage.is_first:  # a later pipeline stage: rank 0 makes the
            return hidden  # logits (it holds the LM head)
        return self.output(hidden, inputs)

    def output(self, hidden: torch.Tensor, inputs: StepInputs) -> StepOutput:
        """The step's output from its final hidden states (here, or the last pipeline stage's)."""
        rows = inputs.logits_rows
        logits = self.model.compute_logits(hidden[rows]).float() if rows else hidden.new_empty(0, 0)
        return StepOutput(logits, [PooledHidden.of_rows(hidden[first:last], self._scores(hidden[last - 1], tokens))
                                   for first, last, tokens in inputs.pool_rows],
                          [self._prompt_logprobs(hidden[first:last], targets, top)
                           for first, last, targets, top in inputs.prompt_rows])

    def _scores(self, row: torch.Tensor, tokens: tuple[int, ...]) -> list[float] | None:
        """A scoring request's logits of `tokens` after this row (None: an embedding request)."""
        if not tokens:
            return None
        return self.model.compute_logits(row.view(1, -1)).float()[0, list(tokens)].tolist()

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], top: int) -> PromptLogprobs:
        """The raw model logprobs (as the sampler's) of `targets`, each after its row, and the `top` best."""
        result = PromptLogprobs(targets, [], [])
        for first in range(0, len(targets), PROMPT_LOGITS_ROWS):
            block = torch.log_softmax(self.model.compute_logits(hidden[first:first + PROMPT_LOGITS_ROWS]).float(), -1)
            wanted = torch.tensor(targets[first:first + PROMPT_LOGITS_ROWS], device=block.device).view(-1, 1)
            result.chosen.extend(block.gather(1, wanted).view(-1).tolist())
            if top:
                values, ids = block.topk(top)
                result.top.extend([list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())])
            else:
                result.top.extend([] for _ in range(len(wanted)))
        return result

    def execute(self, batch: list[ScheduledSeq]) -> StepOutput:
        """Run one step: the logits rows of the items that sample, in batch order (see `layout`), and the
        embedding requests' pooled hidden states."""
        return self.forward(self.layout(batch))

    submit = execute  # one process: the step runs at once, its output is what collect returns

    @staticmethod
    def collect(launched: StepOutput) -> StepOutput:
        return launched

    def read_block(self, block: int) -> torch.Tensor:
        """A copy of pool block `block` in every layer of this stage: [layers, 2, this rank's KV heads, block_size,
        head_dim]."""
        return self.kv_cache[:, :, :, block].clone()

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Fill pool block `block` from `data` of `kv_block_shape` (every layer and KV head; this rank keeps its
        stage's layers and its own heads)."""
        heads = data.narrow(0, self.stage.first, self.stage.count).narrow(2, self.first_kv_head, self.num_kv_heads)
        self.kv_cache[:, :, :, block].copy_(heads)

    def close(self) -> None:
        """Nothing to stop: the model lives in this process (a ParallelRunner stops its ranks)."""

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source -> destination) in every layer: forked samples get their own
        copy of the prompt's partial last block."""
        for src, dst in pairs:
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]
