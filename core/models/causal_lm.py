"""What every model class shares: the checkpoint projections fused into one layer each, and the interface the
runner, the loader and the drafters use (forward to hidden states, logits, the attention layers, tied weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

# checkpoint projection name -> (fused parameter name, shard id): q/k/v into one matmul, gate/up into another
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class StageCarry:
    """What a pipeline stage hands the next one: the hidden states after its last layer (and the residual stream where
    the layers keep it apart, the fused add + norm's)."""

    hidden: torch.Tensor
    residual: torch.Tensor | None = None


class OtherStage(nn.Module):
    """The place of a decoder layer another pipeline stage holds (no parameters, never run here)."""

    def forward(self, *args):
        raise RuntimeError("this layer belongs to another pipeline stage")


class CausalLM(nn.Module):
    """A decoder stack `self.model` (its `layers` each with `self_attn.attn`) and `self.lm_head`."""

    packed_modules_mapping = FUSED_PROJECTIONS
    tie_word_embeddings: bool = False
    # checkpoint name parts read as ours before the fusion mapping (a family's own names for the same layers)
    checkpoint_renames: dict[str, str] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                carried: StageCarry | None = None) -> torch.Tensor | StageCarry:
        """`num_layers`: run only the first layers (a draft made of the model itself), then the final norm.
        Under pipeline parallelism a stage after the first starts from `carried`, and one before the last returns
        its StageCarry instead of the final hidden states."""
        return self.model(input_ids, positions, num_layers, carried)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list:
        """This stage's attention layers (every layer's without pipeline parallelism), in KV pool order."""
        stage = self.model.stage
        return [layer.self_attn.attn for layer in self.model.layers[stage.first:stage.last]]

    def on_other_stage(self, name: str) -> bool:
        """Whether a parameter of this name belongs to another pipeline stage (the loader skips its tensor)."""
        stage = self.model.stage
        layer = LAYER_NAME.match(name)
        if layer is not None:
            return int(layer[1]) not in stage
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return not stage.is_first
        return name.startswith("model.norm.") and not stage.is_last

    def after_loading(self) -> None:
        """Each layer's after_layers_loaded (a MoE block stacking its experts for the fused kernel); a tied head that
        keeps its codes or blocks (a GGUF's, core/gguf_source.py) also serves the embedding's rows: one copy of the
        table instead of a dense one beside the codes (Gemma's 262k x 640: 320 MiB in bf16)."""
        for module in self.modules():  # layers that reshape their weights once every layer has loaded (moe.py)
            if hasattr(module, "after_layers_loaded"):
                module.after_layers_loaded()
        if self.lm_head is None or self.model.embed_tokens is None:  # a pipeline stage with only one of the two
            return
        lookup = getattr(self.lm_head.quant_method, "row_lookup", None)
        rows = lookup(self.lm_head) if self.tie_word_embeddings and lookup is not None else None
        if rows is not None:
            self.model.embed_tokens.share_rows(rows)

    def tied_weights(self) -> dict[str, str]:
        """Parameters loaded from another checkpoint tensor when the checkpoint omits them."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}
