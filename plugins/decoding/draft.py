"""`draft` proposer: a smaller model with the same tokenizer (or the target's own first N layers) runs k
cheap decode steps ahead of the target, which then verifies the k drafts in one forward.

The drafter keeps its KV in a paged pool of its own (a ModelRunner and a block pool shaped for the
draft model, sized by the engine from the same KV budget) under block tables of its own: one mirror
sequence per target sequence. A mirror holds the target's tokens and the drafts it made last time; at
the next proposal it keeps the KV of the longest prefix it shares with the target (the accepted drafts)
and rolls back the rest, so it never reads the KV of a rejected draft.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from kvforge.core.plugins import (
    DraftTarget,
    KVCacheManager,
    Proposal,
    Proposer,
    ScheduledSeq,
    Sequence,
    draw,
    sampling_probs,
)


class FirstLayers(nn.Module):
    """The target model cut after its first `num_layers` layers (then its final norm and LM head)."""

    def __init__(self, model: nn.Module, num_layers: int) -> None:
        super().__init__()
        self.model, self.num_layers = model, num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, num_layers=self.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


@dataclasses.dataclass
class _Mirror:
    seq: Sequence  # the drafter's copy: every token lives in prompt_token_ids
    synced: int  # how many of its tokens are known to equal the target's


class DraftModelProposer(Proposer):
    name = "draft"
    description = "a smaller model with the same tokenizer drafts (or the target's own first N layers)"
    settings = Proposer.settings | {
        "model": {"type": "string", "default": "",
                  "description": "the draft model: a model directory or .gguf file with the target's tokenizer "
                                 "(empty: draft with the target's first `layers` layers)"},
        "layers": {"type": "integer", "minimum": 0, "default": 0,
                   "description": "draft with the target's own first N layers, no extra weights (0: use `model`)"},
        "sample": {"type": "boolean", "default": False,
                   "description": "sample the drafts at the request's temperature and verify them by rejection "
                                  "sampling with the draft's probabilities (default: the draft's argmax)"},
    }

    def __init__(self, target: DraftTarget, **options) -> None:
        super().__init__(target, **options)
        model, layers = self.options["model"], self.options["layers"]
        if bool(model) == bool(layers):
            raise ValueError("plugin 'draft' needs exactly one of option 'model' (a draft model) and option "
                             "'layers' (draft with the target's first N layers)")
        if layers and target.config.tp_size > 1:
            raise ValueError("option 'layers' of plugin 'draft' drafts with the target's own layers, which are split "
                             "across the tensor-parallel ranks: use option 'model' (a draft model runs whole on "
                             "rank 0) or the ngram plugin")
        if layers:
            total = target.hf_config.num_hidden_layers
            if layers > total:
                raise ValueError(f"option 'layers' of plugin 'draft' must be <= the target's {total} layers, "
                                 f"got {layers}")
            hf_config = copy.copy(target.hf_config)
            hf_config.num_hidden_layers = layers
            self.runner = target.runner_for(FirstLayers(target.model, layers), hf_config)
        else:
            draft = target.load_draft_model(model)
            self._check_tokenizer(draft.tokenizer, draft.hf_config)
            self.runner = draft.runner
        self.kv: KVCacheManager | None = None
        self.mirrors: dict[tuple[str, int], _Mirror] = {}

    def _check_tokenizer(self, tokenizer, hf_config) -> None:
        target = self.target
        if tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab() or \
                hf_config.vocab_size != target.hf_config.vocab_size:
            raise ValueError("the draft model's tokenizer differs from the target's: a draft model must use the "
                             "same vocabulary")

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)
        self.kv = self.target.kv_pool(num_blocks, self.runner.block_size)

    def kv_blocks_used(self) -> int:
        return self.kv.pool.num_used if self.kv else 0

    def release(self, seq: Sequence) -> None:
        mirror = self.mirrors.pop(seq.key, None)
        if mirror is not None:
            self.kv.free(mirror.seq)

    def close(self) -> None:
        for mirror in self.mirrors.values():
            self.kv.free(mirror.seq)
        self.mirrors.clear()

    def _mirror(self, seq: Sequence) -> Sequence:
        """The drafter's copy of `seq`, synced: KV past the prefix it shares with the target is dropped."""
        tokens = seq.token_ids
        mirror = self.mirrors.get(seq.key)
        if mirror is None:
            mirror = self.mirrors[seq.key] = _Mirror(Sequence(seq.request_id, list(tokens), seq.params), 0)
        own = mirror.seq.prompt_token_ids
        common = mirror.synced
        limit = min(len(own), len(tokens))
        while common < limit and own[common] == tokens[common]:
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is always run: its logits give the first draft
        if mirror.seq.num_computed_tokens > common:
            self.kv.truncate(mirror.seq, common)
        mirror.seq.prompt_token_ids = list(tokens)
        mirror.synced = len(tokens)
        return mirror.seq

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        mirrors = [self._mirror(seq) for seq in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:
            batch, index = [], {}
            for i in active:
                mirror = mirrors[i]
                n = mirror.num_tokens - mirror.num_computed_tokens
                if self.kv.allocate(mirror, n):  # a full draft pool: this sequence stops drafting
                    batch.append(ScheduledSeq(mirror, n))
                    index[id(mirror)] = i
            if not batch:
                break
            logits = self.runner.execute(batch).logits  # every item runs to its end: one row each, in batch order
            for item in batch:
                item.seq.num_computed_tokens += item.num_new_tokens
            order = [index[id(item.seq)] for item in batch]
            for row, i in enumerate(order):
                token, q = self._next_token(seqs[i], logits[row])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
                mirrors[i].prompt_token_ids.append(token)
            active = [i for i in order if len(drafts[i]) < num_tokens[i]]
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _next_token(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if not self.options["sample"] or seq.params.greedy:
            return int(logits.argmax()), None
        q = sampling_probs(logits.cpu().unsqueeze(0), [seq.params])[0]  # the generators are CPU ones
        return draw(q, seq.generator), q
