"""Every engine knob, its default, what it means and what it accepts, in one place.

Each field's metadata holds its help text and bounds (`knob`); __post_init__ checks the bounds, and the app
(app/settings.py, app/models/host.py, app/dialects/openai/protocol.py) reads the defaults from here instead of
repeating them.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from platformdirs import user_cache_dir

from kvforge.core.kv.quant import KV_FORMATS, kv_format

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")  # the long names: what the admin API and the UI offer
LINEAR_KERNELS = ("auto", "torch", "onednn")  # see core/kernel_choice.py
DECODE_ATTENTION = ("auto", "bmm", "bmm-native", "sdpa", "paged")  # see core/layers/decode_attention.py
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)  # auto: the model's dtype, unquantized (core/kv/quant.py)
GGUF_WEIGHTS = ("auto", "mapped", "copied")  # see core/gguf_source.py's copies_weights


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The long name of `dtype`; "auto" is bfloat16 where the device computes it natively (a CPU with
    AVX512_BF16 or AMX, a CUDA GPU with bf16) and float32 on other CPUs (bf16 emulated there is slower)."""
    if dtype != "auto":
        return next(name for name in DTYPE_NAMES[1:] if DTYPES[name] == DTYPES[dtype])
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    from kvforge.core.cpu import native_bf16

    return "bfloat16" if native_bf16() else "float32"

def loads_gguf_natively(quant: str, gguf_dense: bool) -> bool:
    """Whether a GGUF source loads from its own blocks (the gguf plugin): unless gguf_dense is set or another
    quant plugin is asked for (that one then quantizes the dense conversion)."""
    return not gguf_dense and quant in ("none", "gguf")


KERNELS = ("auto", "triton", "torch")
CPU_KV_CACHE_BYTES = 1 << 30  # the CPU pool's default budget


def knob(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, choices: Any = None,
         ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A field with its help text and bounds (None passes when None is the default: "not set")."""
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le})


def check_bounds(name: str, value: Any, metadata: Any) -> None:
    """A ValueError naming the field when `value` is outside what the field's metadata accepts."""
    choices, ge, gt, le = (metadata.get(key) for key in ("choices", "ge", "gt", "le"))
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if gt is not None and le is not None and not gt < value <= le:
        raise ValueError(f"{name} must be in ({gt}, {le}], got {value}")
    if ge is not None and value < ge:
        raise ValueError(f"{name} must be >= {ge}, got {value}")


@dataclass
class EngineConfig:
    model: str | None = knob(None, "None: the embedded default model")
    dtype: str = knob("auto", "auto | float32 | bfloat16 | float16 (and the short names fp32, bf16, fp16); auto: "
                      "bfloat16 where the CPU computes it natively (AVX512_BF16 / AMX) or on a GPU, else float32; "
                      "resolved when the config is made", choices=(*DTYPES, "auto"))
    gguf_dense: bool = knob(False, "load a GGUF source dequantized into dense weights (as transformers does) "
                            "instead of from its own quantized blocks (the `gguf` quant method); another quant "
                            "plugin asked for a GGUF source also starts from the dense weights")
    gguf_weights: str = knob("auto", "a GGUF file's blocks, which the kernels read in place: mapped (the file's "
                             "pages, 4 KiB each: shared with the page cache, reclaimable, resident as read) or copied "
                             "(read once into memory on 2 MiB huge pages: faster decode, the whole file resident); "
                             "auto: copied by a single CPU process when the file takes at most 3/4 of the available "
                             "memory, else mapped", choices=GGUF_WEIGHTS)
    cpu_experts: bool = knob(False, "mixture-of-experts models: every expert's weights in host memory, computed on "
                             "the CPU (llama.cpp's --cpu-moe); routers, shared experts, attention and the KV stay on "
                             "the device. No effect on a dense model")
    quant: str = knob("none", "a `kvforge.quant` plugin name")
    quant_options: dict[str, Any] = knob(default_factory=dict, help="the quant plugin's options")
    decoding: str = knob("none", "a `kvforge.decoding` plugin name (speculative decoding); \"none\": off")
    decoding_options: dict[str, Any] = knob(default_factory=dict, help="the decoding plugin's options")
    device: str = knob("cpu", "rank 0's device under tensor parallelism (rank r: cuda:<local rank>)")
    tp_size: int = knob(1, "tensor-parallel ranks, one process each; every rank holds 1/tp_size of the weights "
                        "and KV", ge=1)
    pp_size: int = knob(1, "pipeline stages, each tp_size processes holding consecutive layers and their KV; up to "
                        "one step per stage in flight, on different sequences", ge=1)
    block_size: int = knob(16, "tokens per KV block", ge=1)
    kv_cache_bytes: int | None = knob(None, "KV pool budget; ignored when num_kv_blocks is set. None: 1 GiB on CPU; "
                                      "on CUDA what gpu_memory_utilization leaves after the weights and a profiling "
                                      "forward's peak", ge=1)
    gpu_memory_utilization: float = knob(0.9, "share of the GPU's memory kvforge may use: weights, activations "
                                         "and KV", gt=0, le=1)
    kernels: str = knob("auto", "Triton kernels or the torch ones (auto: Triton on CUDA when triton is installed)",
                        choices=KERNELS)
    linear_kernels: str = knob("auto", "which matmul runs dense linears on CPU: torch's F.linear, oneDNN's prepacked "
                               "linear, or auto: the faster on this CPU, timed per shape at load and cached",
                               choices=LINEAR_KERNELS)
    decode_attention: str = knob("auto", "decode attention on the torch path: bmm (fp32 batched matmuls), "
                                 "bmm-native (batched matmuls in the model dtype), sdpa (torch's fused attention in "
                                 "the model dtype), paged (a C kernel reading the paged cache in place, fp32 math; "
                                 "CPU, needs a C compiler) or auto: the faster on this machine, "
                                 "timed at load and cached; in bf16 / fp16 auto keeps to the fp32-math ones, as "
                                 "prefill (see core/layers/decode_attention.py)", choices=DECODE_ATTENTION)
    cuda_graphs: bool = knob(True, "CUDA + Triton kernels: replay captured graphs for decode batches (False: eager)")
    kv_cache_dtype: str = knob("auto", "how the KV pool stores K and V: auto (the model's dtype), int8, fp8_e4m3, "
                               "fp8_e5m2 (8 bits and a scale per token and head: about half the bytes of bf16) or "
                               "q4 (V in 4 bits, K in 5, a scale per 32 values: about 0.31x); see core/kv/quant.py",
                               choices=KV_CACHE_DTYPES)
    num_kv_blocks: int | None = knob(None, "the KV pool's size in blocks (instead of kv_cache_bytes)", ge=1)
    max_model_len: int | None = knob(None, "default: the model's max_position_embeddings", ge=1)
    enable_prefix_caching: bool = knob(True, "reuse the KV of equal prompt prefixes across requests")
    # Persisted KV tier (needs prefix caching): full prefix blocks also go to disk, indexed in the store,
    # so a later request -- even after a restart -- loads them instead of recomputing.
    persist_kv: bool = knob(False, "keep full prefix blocks on disk too (the persisted KV tier)")
    data_dir: str | None = knob(None, "KV files (data_dir/kv) and the default SQLite store; None: the user data dir")
    db_url: str | None = knob(None, "SQLAlchemy URL of the store; None: sqlite:///<data_dir>/kvforge.db")
    kv_disk_budget_bytes: int = knob(2 << 30, "least recently used blocks are evicted past this", ge=0)
    max_num_seqs: int = knob(64, "sequences in one step", ge=1)
    max_num_batched_tokens: int = knob(2048, "tokens in one step (decode tokens + prefill chunks)", ge=1)
    seed: int = knob(0, "seeds requests that give no seed of their own")
    num_threads: int | None = knob(None, "torch intra-op threads on CPU; None: torch's default")
    sampling_defaults: dict[str, Any] = knob(
        default_factory=dict, help="the model's sampling defaults, over its own (core/generation_defaults.py): "
        "SamplingParams fields a request that leaves them out gets")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None or f.default is not None:
                check_bounds(f.name, value, f.metadata)
        if self.decoding == "none" and self.decoding_options:
            raise ValueError("decoding_options are given but decoding is 'none': choose a decoding plugin")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.dtype = resolve_dtype(self.dtype, self.device)  # one concrete dtype from here on (fingerprints, reports)

    @property
    def native_gguf(self) -> bool:
        return loads_gguf_natively(self.quant, self.gguf_dense)

    def context_length(self, hf_config) -> int:
        """The longest sequence (prompt + output) this engine serves: max_model_len, at most the model's own."""
        model_len = getattr(hf_config, "max_position_embeddings", None) or 1 << 30
        return min(self.max_model_len or model_len, model_len)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_data_dir(self) -> Path:
        from kvforge.core.store import default_data_dir

        return Path(self.data_dir).expanduser() if self.data_dir else default_data_dir()

    def resolved_db_url(self) -> str:
        from kvforge.core.store import default_db_url

        return self.db_url or default_db_url(self.resolved_data_dir())


ENGINE_FIELDS = {f.name: f for f in fields(EngineConfig)}


def engine_default(name: str) -> Any:
    """EngineConfig's default for one knob: what the app's settings, ModelSpec and the admin API start from."""
    return ENGINE_FIELDS[name].default


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """The seed formula: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes, per token; a quantized KV
    (`kv_cache_dtype`) stores each head's row in its format's bytes instead (core/kv/quant.py)."""
    fmt = kv_format(kv_cache_dtype)
    row = head_dim * torch.empty((), dtype=dtype).element_size() if fmt is None else fmt.row_bytes(head_dim)
    return 2 * num_layers * num_kv_heads * row


def cache_dir() -> Path:
    """Where kvforge keeps what it builds and measures once per machine (GGUF conversions, compiled kernels, kernel
    timings): KVFORGE_CACHE_DIR, else the user's cache directory."""
    return Path(os.environ.get("KVFORGE_CACHE_DIR") or user_cache_dir("kvforge"))
