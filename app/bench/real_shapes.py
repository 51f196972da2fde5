"""Random-weight models of real shapes for `kvforge bench peers --shape`: a GGUF file (what llama.cpp and
kvforge-gguf run) and a safetensors "twin" of the same shape (what the dense engines run: HF, vLLM CPU, kvforge
fp32 / bf16). Nothing is downloaded and nothing is quantized: the values are random, only the speed and the memory
of an engine on a file of that shape and quantization are measured.

The GGUF (`shape_gguf`): architecture "llama" (or "olmoe", below), the metadata llama.cpp's converter writes for a
Llama checkpoint, the embedded model's tokenizer (its `tokenizer.*` fields and chat template: a 49152-token
vocabulary, SmolLM2's, for every shape) and the tensors' quantized blocks written as bytes straight from numpy: random
codes, and fp16 scales chosen so every weight stays within |w| <= WEIGHT_LIMIT (activations stay finite through 32
layers). Norms are F32 ones (a MoE router F32 random values within the same limit: tokens pick different experts).
Tensor by tensor: the largest tensor (8b's token_embd) is held in memory, never the file. Quantization mixes
(`tensor_types`):

- q4_0: every projection Q4_0; token_embd Q8_0 (as in the Q4_0 / Q4_1 files published for SmolLM2, the embedded
  one included); an untied output head Q6_K (llama.cpp's choice for the output of a Q4_0 file).
- q4_k_m: projections Q4_K, attn_v and ffn_down (ffn_down_exps) Q6_K in every layer (llama.cpp's Q4_K_M uses Q6_K
  for those in about half the layers: all of them here, simpler, and a slightly larger file), the output head Q6_K (a
  tied token_embd is the output head: Q6_K; untied, token_embd Q4_K).
- q8_0: every tensor but the norms (and the router) Q8_0.
- f16: every tensor but the norms (and the router) F16 (the float path: weights read in place, converted as they are
  read).

The twin: app/bench/shape_twin.py.

Shapes (SHAPES): the bodies of SmolLM2-1.7B, Llama-3.2-3B and Llama-3-8B (hidden size, layers, heads, KV heads,
FFN size, rope theta, tied or untied head) with the embedded vocabulary, 49152 tokens: SmolLM2-1.7B's own; the
Llamas' is 128256, so their embedding and output head here are 38% of the real ones (a decode step reads ~0.3 GB
less of an 8B Q4_0 file than the real one). Llama 3.2's llama3 rope scaling is left out (no effect on speed at
these context lengths). TEST_SHAPES adds "tiny" (hidden 256, 2 layers) for the tests and a quick smoke run.

One mixture-of-experts shape, OLMoE-1B-7B's ("olmoe-1b-7b": 64 experts of FFN 1024 a layer, 8 a token, no shared
expert; its vocabulary is 50304, 49152 here), written as llama.cpp's converter writes OLMoE (OlmoeModel): architecture
"olmoe", its keys (`olmoe.expert_count`, `olmoe.expert_used_count`, `olmoe.feed_forward_length` = one expert's size;
no vocab_size or rope dimension count, which only LlamaModel writes), q / k norms over the whole projection, the router
`ffn_gate_inp` [experts, hidden] kept F32 (as llama.cpp keeps it), and each projection's experts stacked in one 3-D
tensor `ffn_{gate,up,down}_exps` [experts, rows, row length], quantized per row like the dense projections (every
block type is a per-row layout, so a 3-D tensor is its experts' rows one after another). A row that is not whole
blocks of its type (tiny-moe's ffn_down rows of 128 in Q6_K) gets llama.cpp's fallback type (`fallback_types`), as
llama-quantize does. TEST_SHAPES adds "tiny-moe" (hidden 256, 2 layers, 8 experts of 128, 2 a token).

Files are cached under `cache_dir() / "bench_shapes"`, named by shape, quantization and FORMAT_VERSION, written to a
temporary name and renamed into place: a second run reuses them, a crash leaves no half file.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = "1"  # bump when what a file holds changes: the cache then writes new files
VOCAB = 49152  # the embedded tokenizer's vocabulary
WEIGHT_LIMIT = 0.02  # every weight of the GGUF within +- this
QUANTS = ("q4_0", "q4_k_m", "q8_0", "f16")


@dataclass(frozen=True)
class Shape:
    name: str
    body: str  # whose shape it is
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    tied: bool  # the output head is token_embd
    context: int  # the model's context length (llama.context_length, max_position_embeddings)
    rms_eps: float = 1e-5
    vocab: int = VOCAB
    arch: str = "llama"  # the GGUF's general.architecture: "llama" (dense) or "olmoe" (mixture of experts)
    experts: int = 0  # experts a layer (then `ffn` is one expert's size)
    experts_used: int = 0  # experts a token

    def __post_init__(self) -> None:
        # llama.cpp's olmoe loader wants an output head, k_norm of the hidden size and experts (llama-model.cpp)
        if self.arch == "olmoe" and (self.tied or self.kv_heads != self.heads or not 0 < self.experts_used
                                     <= self.experts):
            raise ValueError(f"shape {self.name}: an olmoe shape is untied, with KV heads = heads, and has experts")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> str:
        ffn = (f"{self.experts} experts of FFN {self.ffn}, {self.experts_used} a token" if self.experts
               else f"FFN {self.ffn}")
        return (f"{self.body} body: hidden {self.hidden}, {self.layers} layers, {self.heads} heads, {self.kv_heads} KV "
                f"heads, {ffn}, vocabulary {self.vocab}, {'tied' if self.tied else 'untied'} output head; "
                "random weights")


SHAPES = {
    "1.7b": Shape("1.7b", "SmolLM2-1.7B", 2048, 24, 32, 32, 8192, 130000.0, tied=True, context=8192),
    "3b": Shape("3b", "Llama-3.2-3B", 3072, 28, 24, 8, 8192, 500000.0, tied=True, context=131072),
    "8b": Shape("8b", "Llama-3-8B", 4096, 32, 32, 8, 14336, 500000.0, tied=False, context=8192),
    "olmoe-1b-7b": Shape("olmoe-1b-7b", "OLMoE-1B-7B", 2048, 16, 16, 16, 1024, 10000.0, tied=False, context=4096,
                         arch="olmoe", experts=64, experts_used=8),
}
TEST_SHAPES = {
    "tiny": Shape("tiny", "tiny test", 256, 2, 4, 2, 512, 10000.0, tied=False, context=2048),
    "tiny-moe": Shape("tiny-moe", "tiny MoE test", 256, 2, 4, 4, 128, 10000.0, tied=False, context=2048,
                      arch="olmoe", experts=8, experts_used=2),
}
ALL_SHAPES = SHAPES | TEST_SHAPES


def get_shape(name: str) -> Shape:
    if name not in ALL_SHAPES:
        raise ValueError(f"--shape {name!r}: unknown (choose from {', '.join(ALL_SHAPES)})")
    return ALL_SHAPES[name]


def check_quant(quant: str) -> str:
    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r}: unknown (choose from {', '.join(QUANTS)})")
    return quant


def shapes_dir() -> Path:
    from kvforge.core.config import cache_dir

    return cache_dir() / "bench_shapes"


# --- the tensors ------------------------------------------------------------------------------------------------

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its shape in numpy order ((experts,) rows, row length), in the order written."""
    h, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        out |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (q, h), f"blk.{i}.attn_k.weight": (kv, h),
                f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, q)}
        if shape.arch == "olmoe":
            e = shape.experts
            out |= {f"blk.{i}.attn_q_norm.weight": (q,), f"blk.{i}.attn_k_norm.weight": (kv,),
                    f"blk.{i}.ffn_norm.weight": (h,), f"blk.{i}.ffn_gate_inp.weight": (e, h),
                    f"blk.{i}.ffn_gate_exps.weight": (e, f, h), f"blk.{i}.ffn_up_exps.weight": (e, f, h),
                    f"blk.{i}.ffn_down_exps.weight": (e, h, f)}
        else:
            out |= {f"blk.{i}.ffn_norm.weight": (h,), f"blk.{i}.ffn_gate.weight": (f, h),
                    f"blk.{i}.ffn_up.weight": (f, h), f"blk.{i}.ffn_down.weight": (h, f)}
    out["output_norm.weight"] = (h,)
    if not shape.tied:
        out["output.weight"] = (shape.vocab, h)
    return out


def fallback_types() -> dict:
    """llama-quantize's fallback for a row that is not whole blocks of 256 (llama-quant.cpp), for the K-quants here."""
    from gguf import GGMLQuantizationType as T

    return {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}


def tensor_types(shape: Shape, quant: str):
    """GGUF tensor name -> GGMLQuantizationType, per the mixes in the module's docstring."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    check_quant(quant)
    types = {}
    for name, dims in tensor_shapes(shape).items():
        kind = name.split(".")[-2]
        if len(dims) == 1 or kind == "ffn_gate_inp":  # norms; the router, as llama.cpp keeps it
            types[name] = T.F32
        elif quant == "q8_0":
            types[name] = T.Q8_0
        elif quant == "f16":
            types[name] = T.F16
        elif quant == "q4_0":
            types[name] = {"token_embd": T.Q8_0, "output": T.Q6_K}.get(kind, T.Q4_0)
        else:  # q4_k_m
            head = kind == "output" or (kind == "token_embd" and shape.tied)
            types[name] = T.Q6_K if head or kind in ("attn_v", "ffn_down", "ffn_down_exps") else T.Q4_K
        if dims[-1] % GGML_QUANT_SIZES[types[name]][0]:
            types[name] = fallback_types()[types[name]]
    return types


def file_type(quant: str):
    from gguf import LlamaFileType

    return {"q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
            "q8_0": LlamaFileType.MOSTLY_Q8_0, "f16": LlamaFileType.MOSTLY_F16}[check_quant(quant)]


def tensor_nbytes(dims: tuple[int, ...], qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(dims))
    if dims[-1] % block:
        raise ValueError(f"a row of {dims[-1]} weights is not whole {qtype.name} blocks of {block}")
    return n // block * size


def random_blocks(qtype, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` blocks of `qtype` as they lie in a file, (n_blocks, bytes per block) uint8: random codes, fp16
    scales drawn in [0.5, 1] x the largest that keeps every weight within WEIGHT_LIMIT (a normal fp16: the K-quants'
    sub-scales are kept small for that), so dequantized weights are random in +-WEIGHT_LIMIT."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    size = GGML_QUANT_SIZES[qtype][1]
    words = -(-n_blocks * size // 8)
    blocks = rng.bit_generator.random_raw(words).view(np.uint8)[:n_blocks * size].reshape(n_blocks, size)

    def scale(largest: float) -> np.ndarray:  # fp16 scales as two bytes each
        return (rng.uniform(0.5, 1.0, n_blocks) * largest).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)

    if qtype == T.F16:  # the weights themselves
        return rng.uniform(-WEIGHT_LIMIT, WEIGHT_LIMIT, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.Q4_0:  # d (fp16), 16 bytes of 4-bit codes q: w = d * (q - 8)
        blocks[:, 0:2] = scale(WEIGHT_LIMIT / 8)
    elif qtype == T.Q5_0:  # d (fp16), 4 bytes of high bits, 16 bytes of low 4 bits: w = d * (q - 16)
        blocks[:, 0:2] = scale(WEIGHT_LIMIT / 16)
    elif qtype == T.Q8_0:  # d (fp16), 32 int8 codes: w = d * q
        blocks[:, 0:2] = scale(WEIGHT_LIMIT / 128)
    elif qtype == T.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit sub-scales and mins, 128 bytes of 4-bit codes
        # every byte of the first 8 masked to its low nibble and the last 4 random: all 16 sub-scales / mins in
        # 0..15 (see ggml's get_scale_min_k4); w = d * sc * q - dmin * m: dmin = 7.5 d centres it
        blocks[:, 4:12] &= 0x0F
        d = (rng.uniform(0.5, 1.0, n_blocks) * WEIGHT_LIMIT / (15 * 15)).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
        blocks[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    elif qtype == T.Q6_K:  # 128 bytes low bits, 64 bytes high bits, 16 int8 sub-scales, d (fp16): w = d * sc * (q - 32)
        blocks[:, 192:208] = rng.integers(-8, 9, (n_blocks, 16), dtype=np.int8).view(np.uint8)
        blocks[:, 208:210] = scale(WEIGHT_LIMIT / (8 * 32))
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks


# --- the embedded tokenizer's fields ----------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}


def tokenizer_fields(path: Path) -> list[tuple[str, object, int, int | None]]:
    """The `tokenizer.*` metadata of a GGUF file as (key, value, value type, array item type): the key-value
    section read directly (GGUFReader takes ~5 s on the embedded file: it builds a numpy view per token). Meant for
    the embedded model's file, which the package ships: no limits on what the file claims."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)  # the metadata ends within the first megabytes
    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    (version,) = struct.unpack_from("<I", data, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} (2 or later expected)")
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    pos, fields = 24, []

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8:at + 8 + n].decode("utf-8"), at + 8 + n

    def value(kind: int, at: int) -> tuple[object, int]:
        if kind == 8:
            return string(at)
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        sub = None
        if kind == 9:
            sub, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if sub == 8:
                items = []
                for _ in range(count):
                    item, pos = string(pos)
                    items.append(item)
                val: object = items
            else:
                arr = np.frombuffer(data, _NUMPY[sub], count, pos)
                pos += arr.nbytes
                val = [bool(v) for v in arr] if sub == 7 else arr.tolist()
        else:
            val, pos = value(kind, pos)
        if key.startswith("tokenizer."):
            fields.append((key, val, kind, sub))
    return fields


# --- the GGUF ---------------------------------------------------------------------------------------------------

def gguf_name(shape: Shape, quant: str) -> str:
    return f"{shape.name}-{quant}-v{FORMAT_VERSION}.gguf"


def shape_gguf(shape: Shape | str, quant: str = "q4_0", root: Path | None = None, log=None) -> Path:
    """The cached GGUF of `shape` in `quant`: written once (see the module's docstring), then reused."""
    shape = get_shape(shape) if isinstance(shape, str) else shape
    check_quant(quant)
    root = Path(root) if root else shapes_dir()
    path = root / gguf_name(shape, quant)
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if log:
        log(f"writing {path} (random weights, {shape.describe()})")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=root)
    os.close(fd)
    try:
        write_gguf(shape, quant, Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if log:
        log(f"wrote {path.stat().st_size / (1 << 30):.2f} GiB in {time.perf_counter() - start:.0f} s")
    return path


def write_gguf(shape: Shape, quant: str, path: Path, seed: int = 0) -> None:
    """The file itself, tensor by tensor (GGUFWriter: tensor infos first, then each tensor's bytes)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFValueType, GGUFWriter

    from kvforge.core.loader import embedded_gguf_path

    shapes, types = tensor_shapes(shape), tensor_types(shape, quant)
    writer = GGUFWriter(path, shape.arch)
    # what convert_hf_to_gguf.py writes for a Llama / OLMoE checkpoint (and llama-quantize: file type, quantization
    # version)
    writer.add_type("model")
    writer.add_name(f"kvforge random {shape.body} shape")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
    writer.add_file_type(file_type(quant))
    if shape.arch == "llama":  # LlamaModel's own keys
        writer.add_vocab_size(shape.vocab)
        writer.add_rope_dimension_count(shape.head_dim)
    for key, val, kind, sub in tokenizer_fields(embedded_gguf_path()):
        writer.add_key_value(key, val, GGUFValueType(kind), GGUFValueType(sub) if sub is not None else None)
    writer.add_quantization_version(2)
    for name, dims in shapes.items():
        qtype = types[name]
        if qtype == T.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            nbytes, rows = tensor_nbytes(dims, qtype), int(np.prod(dims[:-1]))
            writer.add_tensor_info(name, (*dims[:-1], nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rngs = np.random.SeedSequence([seed, len(shapes)]).spawn(len(shapes))
    for (name, dims), seq in zip(shapes.items(), rngs):
        qtype = types[name]
        if len(dims) > 1 and qtype == T.F32:  # the router: random, so tokens pick different experts
            writer.write_tensor_data(np.random.default_rng(seq).uniform(-WEIGHT_LIMIT, WEIGHT_LIMIT, dims)
                                     .astype(np.float32))
        elif qtype == T.F32:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:
            from gguf import GGML_QUANT_SIZES

            n_blocks = int(np.prod(dims)) // GGML_QUANT_SIZES[qtype][0]
            blocks = random_blocks(qtype, n_blocks, np.random.default_rng(seq))
            writer.write_tensor_data(blocks.reshape(*dims[:-1], -1))
            del blocks
    writer.close()


# --- the safetensors twin ---------------------------------------------------------------------------------------

