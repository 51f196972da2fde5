"""The safetensors "twin" of a real shape (app/bench/real_shapes.py), for the engines that need one (HF, vLLM CPU,
kvforge fp32 / bf16): config.json (LlamaForCausalLM, or OlmoeForCausalLM for an olmoe shape, of the same shape), the
embedded model's tokenizer files and random bf16 weights (normal, std 0.02, seeded), in safetensors shards of at most
SHARD_BYTES with an index, written shard by shard. An OLMoE twin's experts are named one by one
(`mlp.experts.E.gate_proj.weight`), as the published checkpoint's are: what vLLM and kvforge read, and what
transformers 5 stacks as it loads. Its values are NOT the GGUF's (no engine's output is compared across the two:
speed and memory only). Cached like the GGUF files, written to a temporary name and renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvforge.app.bench.real_shapes import FORMAT_VERSION, Shape, get_shape, shapes_dir

SHARD_BYTES = 1 << 30  # safetensors shards: at most this much each (the last tensor may not be split)


def twin_name(shape: Shape) -> str:
    return f"{shape.name}-bf16-twin-v{FORMAT_VERSION}"


def twin_config(shape: Shape) -> dict:
    """config.json of the twin: what transformers 4.x and 5.x and vLLM read for a Llama (an OLMoE: its published
    config's fields, no q/k/v clipping, as llama.cpp's olmoe does none)."""
    if shape.arch == "olmoe":
        return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": shape.hidden,
                "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
                "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
                "num_experts": shape.experts, "num_experts_per_tok": shape.experts_used, "norm_topk_prob": False,
                "clip_qkv": None, "hidden_act": "silu", "max_position_embeddings": shape.context,
                "rms_norm_eps": shape.rms_eps, "rope_theta": shape.rope_theta, "rope_scaling": None,
                "attention_bias": False, "attention_dropout": 0.0, "output_router_logits": False,
                "router_aux_loss_coef": 0.01, "tie_word_embeddings": shape.tied, "vocab_size": shape.vocab,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.02,
                "torch_dtype": "bfloat16", "use_cache": True}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
            "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "hidden_act": "silu",
            "max_position_embeddings": shape.context, "rms_norm_eps": shape.rms_eps, "rope_theta": shape.rope_theta,
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "tie_word_embeddings": shape.tied, "vocab_size": shape.vocab, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 2, "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True}


def twin_tensors(shape: Shape) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, in the order written."""
    h, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)}
        if shape.arch == "olmoe":
            out |= {p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,),
                    p + "mlp.gate.weight": (shape.experts, h)}
            for e in range(shape.experts):
                x = f"{p}mlp.experts.{e}."
                out |= {x + "gate_proj.weight": (f, h), x + "up_proj.weight": (f, h), x + "down_proj.weight": (h, f)}
        else:
            out |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)}
    out["model.norm.weight"] = (h,)
    if not shape.tied:
        out["lm_head.weight"] = (shape.vocab, h)
    return out


def shape_twin(shape: Shape | str, root: Path | None = None, tokenizer_dir: Path | None = None, log=None) -> Path:
    """The cached safetensors twin of `shape` (a directory), written once, then reused. `tokenizer_dir`: where the
    tokenizer files come from (default: the embedded model's directory)."""
    shape = get_shape(shape) if isinstance(shape, str) else shape
    root = Path(root) if root else shapes_dir()
    target = root / twin_name(shape)
    if (target / "config.json").is_file():
        return target
    if tokenizer_dir is None:
        from kvforge.core.loader import resolve_model

        tokenizer_dir = resolve_model(None)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if log:
        log(f"writing {target} (bf16 safetensors, random weights, {shape.describe()})")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    try:
        write_twin(shape, tmp, Path(tokenizer_dir))
        try:
            os.replace(tmp, target)
        except OSError:  # another run wrote it meanwhile: keep theirs
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if log:
        size = sum(p.stat().st_size for p in target.iterdir())
        log(f"wrote {size / (1 << 30):.2f} GiB in {time.perf_counter() - start:.0f} s")
    return target


def write_twin(shape: Shape, target: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """config.json, the tokenizer files, and the weights shard by shard (one shard in memory at a time)."""
    import torch
    from safetensors.torch import save_file

    from kvforge.app.bench.random_models import tokenizer_files

    tensors = twin_tensors(shape)
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in tensors.items():
        nbytes = int(np.prod(dims)) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        files = ["model.safetensors"]
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for names, file in zip(shards, files):
        state = {}
        for name in names:
            dims = tensors[name]
            if len(dims) == 1:
                state[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                state[name] = torch.empty(dims, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)
            weight_map[name] = file
        save_file(state, str(target / file), metadata={"format": "pt"})
        del state
    if len(files) > 1:
        total = sum(int(np.prod(d)) * 2 for d in tensors.values())
        (target / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (target / "config.json").write_text(json.dumps(twin_config(shape), indent=1))
    for path in tokenizer_files(tokenizer_dir):
        shutil.copy(path, target / path.name)
