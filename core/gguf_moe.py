"""Mixture-of-experts GGUF files (llama.cpp's layout), what transformers' GGUF reader leaves for kvforge to do.

llama.cpp stacks a MoE layer's experts, one tensor per projection: `blk.N.ffn_{gate,up,down}_exps.weight`, torch
shape [experts, rows, row length]; the router (`ffn_gate_inp`) and Qwen2-MoE's shared expert (`*_shexp`) are
ordinary tensors. kvforge's experts are ordinary MLPs (core/layers/moe.py), each loading its own
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, so a stacked tensor is split along its expert axis: read
in place (core/gguf_source.py), each expert's slice is a view of the file (one expert's rows lie together, whole
blocks); converted dense (core/loader.py), each expert's tensors are split from the stacked ones.

transformers 5 reads qwen2moe and qwen3moe files: config, tokenizer, tensor names, the stacked tensors (its
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]: `split_stacked`). It maps neither
`expert_feed_forward_length` nor `expert_shared_feed_forward_length`, so its config keeps the class defaults for the
experts' sizes (right only for the checkpoints those defaults come from); `complete_config` reads them from the file.
Mixtral's files (architecture llama with `llama.expert_count`) it reads as a dense Llama, dropping the experts, and
OLMoE's (architecture olmoe) not at all: `own_config` makes their config from the metadata as llama.cpp reads it;
their tokenizer is still transformers' (gguf_source.read_tokenizer), their tensor names its map for the file's
architecture (gguf_source.tensor_map: Q / K rows un-permuted for llama, as for a dense Llama file; OLMoE's are not
permuted), and `dense_tensors` dequantizes them as its reader does. Files with experts of any other architecture are
refused with one line (`check_readable`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from kvforge.core.model_files import GGUFHeader

STACKED = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_exps\.weight")
READ_BY_TRANSFORMERS = ("qwen2moe", "qwen3moe")
READ_HERE = {"llama": "Mixtral", "olmoe": "OLMoE"}  # architectures whose MoE files' config is made here
# metadata key (after "<arch>.") -> the config field transformers leaves at its default
EXPERT_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def check_readable(metadata: Mapping) -> None:
    """Refuse a file with experts of an architecture neither transformers' GGUF reader nor `own_config` reads."""
    arch = str(metadata.get("general.architecture"))
    if metadata.get(f"{arch}.expert_count") and arch not in READ_BY_TRANSFORMERS and arch not in READ_HERE:
        supported = [*READ_BY_TRANSFORMERS, *(f"{a} ({family})" for a, family in READ_HERE.items())]
        raise ValueError(f"GGUF files of mixture-of-experts architecture {arch!r} are not supported yet "
                         f"(supported: {', '.join(supported)}); load the model's safetensors checkpoint instead")


def reads_config(metadata: Mapping) -> bool:
    """Whether the file's config is made here (`own_config`) rather than by transformers' reader."""
    arch = str(metadata.get("general.architecture"))
    return arch in READ_HERE and bool(metadata.get(f"{arch}.expert_count"))


def own_config(header: GGUFHeader):
    """The MixtralConfig or OlmoeConfig of a file `reads_config` takes, from its metadata under llama.cpp's keys (what
    convert_hf_to_gguf.py writes: `feed_forward_length` is the experts' size; q/k/v clipping only where the file states
    it, which OLMoE's converter does not)."""
    from transformers import MixtralConfig, OlmoeConfig

    metadata = header.metadata
    arch = str(metadata["general.architecture"])

    def key(name: str, default=None):
        return metadata.get(f"{arch}.{name}", default)

    if key("rope.scaling.type", "none") != "none":
        raise ValueError(f"{READ_HERE[arch]} GGUF file with rope scaling {key('rope.scaling.type')!r}: not supported")
    embedding = next(t for t in header.tensors if t.name == "token_embd.weight")
    heads = key("attention.head_count")
    common = dict(
        vocab_size=embedding.shape[1],  # the table's rows: a vocabulary padded past its tokens counts
        hidden_size=key("embedding_length"), intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"), num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads), max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        num_experts_per_tok=key("expert_used_count"),
        tie_word_embeddings=all(t.name != "output.weight" for t in header.tensors),  # llama.cpp omits a tied head
        **{f"{token}_token_id": metadata.get(f"tokenizer.ggml.{field}_token_id")
           for token, field in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))})
    if arch == "llama":
        return MixtralConfig(**common, num_local_experts=key("expert_count"), head_dim=key("attention.key_length"))
    return OlmoeConfig(**common, num_experts=key("expert_count"), clip_qkv=key("attention.clamp_kqv"),
                       norm_topk_prob=False)


def complete_config(config, metadata: Mapping) -> None:
    """The experts' sizes transformers' reader does not map, from the file's metadata (only fields the config's class
    has: Qwen3-MoE has no shared expert)."""
    arch = str(metadata.get("general.architecture"))
    for key, field in EXPERT_SIZES.items():
        value = metadata.get(f"{arch}.{key}")
        if isinstance(value, int) and value > 0 and hasattr(config, field):
            setattr(config, field, value)


def expert_names(gguf_name: str, experts: int) -> list[str] | None:
    """The per-expert names kvforge loads a stacked tensor as, or None for a tensor that is not one."""
    match = STACKED.fullmatch(gguf_name)
    if match is None:
        return None
    return [f"model.layers.{match['layer']}.mlp.experts.{e}.{match['part']}_proj.weight" for e in range(experts)]


def split_stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked expert tensors (`...experts.gate_up_proj` [E, 2I, H], gate first; `...experts.down_proj`
    [E, H, I]) as each expert's own tensors (copies: safetensors stores no shared memory); the others unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if tensor.dim() != 3 or not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = tensor
            continue
        parts = dict(zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=1))) if leaf == "gate_up_proj" \
            else {"down_proj": tensor}
        for part, stacked in parts.items():
            for expert in range(stacked.shape[0]):
                out[f"{prefix}.{expert}.{part}.weight"] = stacked[expert].clone()
    return out


def dense_tensors(gguf: Path, names: Mapping[str, str], processor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a file whose config `own_config` makes (transformers' reader loads none of them) under the HF
    names `names` gives, each expert of a stacked tensor its own: dequantized by the `gguf` package and their rows
    reordered by `processor`, as that reader does for the files it loads (the --gguf-dense conversion)."""
    import gguf as gguf_package  # its GGUFReader looked up at the call: core/gguf_shared_reader.py may stand in

    for tensor in gguf_package.GGUFReader(str(gguf)).tensors:
        weights = gguf_package.dequantize(tensor.data, tensor.tensor_type)
        experts = expert_names(tensor.name, weights.shape[0]) if weights.ndim == 3 else None
        if experts is not None:
            for expert, name in enumerate(experts):
                yield name, torch.from_numpy(weights[expert].copy())
        elif tensor.name in names:
            weights = processor.process(weights=weights, name=tensor.name).weights
            yield names[tensor.name], torch.from_numpy(weights.copy())  # the file's pages are read-only
