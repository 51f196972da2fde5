"""`kvforge bench gpu`: the GPU fast path's evidence in one run, with no network.

Random-weight models of 0.5B-1.5B Llama / Qwen2 shapes are built from configs on the device (nothing is
downloaded), next to the embedded model, and for each:

  1. the device and its measured copy bandwidth (bytes read + written per second, median of a few);
  2. the kernel tests on the device (`tests/core/test_kernel_*.py`, `tests/plugins/test_triton_gemm.py`,
     when the command runs from a repository checkout);
  3. parity with HF transformers in bf16: greedy tokens compared by vLLM's `check_logprobs_close` rule
     (equal tokens, or the first divergence within each other's top-5 logprobs), and the largest
     |logprob difference| of the first generated token;
  4. batch-1 decode tok/s against the bandwidth roofline (bytes read per token / measured bandwidth);
  5. output tok/s of 1 / 16 / 64 / 256 sequences submitted at once, against HF `generate` on the same
     prompts as one batch;
  6. decode tok/s with CUDA graphs on and off.

Each model runs in a child process of its own (a sticky CUDA error or a crash in one model leaves the
others' figures), and every step inside it is wrapped: a failing step prints its error and the others
still run; the exit status is 1 when anything failed. `--smoke` runs the same code on the CPU with tiny
models, so CI proves the code paths.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

NEEDS_CUDA = "kvforge bench gpu needs a CUDA device (use --smoke on CPU)"
TARGET_ROOFLINE = 0.70  # batch-1 decode: at least this share of the bandwidth roofline
TARGET_HF_RATIO = 10.0  # at the largest batch (256): at least this many times HF generate's output tok/s
TOP_K = 5  # the logprob rule's top-k
PROMPT_VOCAB = 49152  # prompt ids stay below this (the embedded tokenizer's vocabulary): they fit every model
FIRST_PROMPT_ID = 3  # and above the special ids 0-2
EOS_ID, BOS_ID = 2, 1  # the embedded tokenizer's, used by every model here
# the kernels against torch, compiled on the device, and the whole engine on them (CUDA vs CPU torch / HF)
KERNEL_TESTS = ("tests/core/test_kernel_*.py", "tests/plugins/test_triton_gemm.py", "tests/core/test_triton_engine.py")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "embedded" | "llama" | "qwen2"
    shape: dict = field(default_factory=dict)  # config kwargs (random-weight models)
    note: str = ""


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
MODELS = {
    "embedded": ModelSpec("embedded", "embedded", note="SmolLM2-135M, the embedded weights"),
    "qwen2-0.5b": ModelSpec("qwen2-0.5b", "qwen2", dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6), note="Qwen2.5-0.5B shape, random weights"),
    "llama-1b": ModelSpec("llama-1b", "llama", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5), note="Llama-3.2-1B shape, random weights"),
    "qwen2-1.5b": ModelSpec("qwen2-1.5b", "qwen2", dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6), note="Qwen2.5-1.5B shape, random weights"),
}
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=PROMPT_VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6)
SMOKE_MODELS = {
    "tiny-llama": ModelSpec("tiny-llama", "llama", dict(
        _TINY, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0, original_max_position_embeddings=64)), note="tiny, random"),
    "tiny-qwen2": ModelSpec("tiny-qwen2", "qwen2", dict(_TINY, tie_word_embeddings=True), note="tiny, random"),
}

# option -> (GPU default, --smoke default)
DEFAULTS = {
    "models": (",".join(MODELS), ",".join(SMOKE_MODELS)),
    "batches": ("1,16,64,256", "1,4"),
    "graph_batches": ("1,64", "1,4"),
    "prompt_len": (128, 16),
    "output_len": (128, 8),
    "decode_tokens": (128, 8),
    "repeats": (3, 1),
    "parity_tokens": (32, 8),
    "parity_prompt_lens": ("17,64,200", "5,17,40"),
    "kv_cache_gb": (0.0, 0.0625),  # 0: sized from --gpu-memory-utilization (the profiling forward runs)
    "max_num_batched_tokens": (4096, 2048),
    "bandwidth_gib": (2.0, 0.0625),
    "time_budget": (450.0, 900.0),
}


def add_parser(bench_sub) -> None:
    gpu = bench_sub.add_parser(
        "gpu", help="the GPU fast path in one run: HF parity in bf16, kernel tests, batch-1 decode vs the bandwidth "
                    "roofline, throughput vs HF generate, CUDA graphs on vs off (random-weight models, no download)")
    gpu.add_argument("--smoke", action="store_true",
                     help="run every code path on the CPU with tiny random models (CI); figures mean nothing")
    gpu.add_argument("--models", default=None,
                     help=f"comma-separated, from {', '.join(MODELS)} (--smoke: {', '.join(SMOKE_MODELS)}); "
                          "default: all")
    gpu.add_argument("--device", default="cuda", help="the CUDA device (default: cuda; --smoke: cpu)")
    gpu.add_argument("--dtype", default="bfloat16", help="kvforge and HF dtype (default: bfloat16)")
    gpu.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                     help="kvforge kernels (default auto: Triton on CUDA)")
    gpu.add_argument("--batches", default=None, metavar="N[,N...]",
                     help="concurrent sequences for the throughput phase (default: 1,16,64,256; --smoke: 1,4)")
    gpu.add_argument("--graph-batches", default=None, metavar="N[,N...]",
                     help="decode batch sizes for CUDA graphs on vs off (default: 1,64; --smoke: 1,4)")
    gpu.add_argument("--prompt-len", type=int, default=None, help="throughput prompt tokens (default: 128)")
    gpu.add_argument("--output-len", type=int, default=None, help="throughput output tokens (default: 128)")
    gpu.add_argument("--decode-tokens", type=int, default=None, help="batch-1 decode tokens per run (default: 128)")
    gpu.add_argument("--repeats", type=int, default=None, help="batch-1 decode runs, the median is kept (default: 3)")
    gpu.add_argument("--parity-tokens", type=int, default=None, help="greedy tokens compared with HF (default: 32)")
    gpu.add_argument("--parity-prompt-lens", default=None, metavar="N[,N...]",
                     help="parity prompt lengths (default: 17,64,200)")
    gpu.add_argument("--logprob-tol", type=float, default=0.5,
                     help="parity: largest |logprob difference| allowed on the first generated token's top-5 "
                          "(default: 0.5; bf16 logits of magnitude 16-32 are 0.125 apart)")
    gpu.add_argument("--hf-max-batch", type=int, default=256,
                     help="HF generate runs only batches up to this size (default: 256)")
    gpu.add_argument("--no-hf", action="store_true", help="skip HF transformers (no parity, no ratios)")
    gpu.add_argument("--kv-cache-gb", type=float, default=None,
                     help="kvforge KV cache in GiB (default on a GPU: sized from --gpu-memory-utilization)")
    gpu.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                     help="the engines' share of the GPU when --kv-cache-gb is not given (default: 0.5)")
    gpu.add_argument("--max-num-batched-tokens", type=int, default=None, help="kvforge tokens per step (default: 4096)")
    gpu.add_argument("--bandwidth-gib", type=float, default=None,
                     help="copy-bandwidth buffer size in GiB (default: 2; --smoke: 1/16)")
    gpu.add_argument("--skip-kernel-tests", action="store_true", help="do not run the kernel tests")
    gpu.add_argument("--kernel-tests", default=",".join(KERNEL_TESTS), metavar="GLOB[,GLOB...]",
                     help=f"test files for phase 2, relative to the checkout (default: {','.join(KERNEL_TESTS)})")
    gpu.add_argument("--kernel-test-timeout", type=float, default=180.0,
                     help="seconds the kernel tests may take (default: 180)")
    gpu.add_argument("--time-budget", type=float, default=None,
                     help="seconds for the whole run (default: 450; --smoke: 900): a model that cannot start within "
                          "it is skipped, one that overruns it is stopped (its finished steps are kept)")
    gpu.add_argument("--no-isolate", action="store_true",
                     help="run the models in this process instead of one child process each")
    gpu.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    gpu.set_defaults(func=cmd_bench_gpu)


# --- options ----------------------------------------------------------------------------------------


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{option} must be integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{option} must be integers >= 1, got {text!r}")
    return values


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --smoke and check every option; ValueError (exit 2) for a bad one."""
    from kvforge.core.config import DTYPES

    smoke = bool(args.smoke)
    for name, (gpu_default, smoke_default) in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, smoke_default if smoke else gpu_default)
    if smoke:
        args.device = "cpu"
    known = SMOKE_MODELS if smoke else MODELS
    names = [m.strip() for m in str(args.models).split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        raise ValueError(f"--models: unknown model {unknown[0] if unknown else args.models!r} "
                         f"(choose from {', '.join(known)})")
    args.models = names
    for name in ("batches", "graph_batches", "parity_prompt_lens"):
        if isinstance(getattr(args, name), str):
            setattr(args, name, _int_list(getattr(args, name), name.replace("_", "-")))
    for name in ("prompt_len", "output_len", "decode_tokens", "repeats", "parity_tokens", "hf_max_batch",
                 "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.kv_cache_gb >= 0 and 0 < args.gpu_memory_utilization <= 1):
        raise ValueError("--kv-cache-gb must be >= 0 and --gpu-memory-utilization in (0, 1]")
    for name in ("bandwidth_gib", "time_budget", "kernel_test_timeout", "logprob_tol"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if max(args.parity_prompt_lens) > 4096:
        raise ValueError("--parity-prompt-lens: at most 4096 tokens")
    return args


def _is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def _sync(device: str) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def _free_memory(device: str) -> None:
    gc.collect()
    if _is_cuda(device):
        torch.cuda.empty_cache()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]


# --- phase 1: device and copy bandwidth -----------------------------------------------------------------


def device_info(device: str) -> dict:
    import platform

    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count()}
    for package in ("transformers", "triton"):
        try:
            info[package] = __import__(package).__version__
        except Exception:  # not installed, or broken: the row says so
            info[package] = None
    if _is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        info |= {"name": props.name, "total_memory_gib": props.total_memory / (1 << 30),
                 "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                 "cuda": torch.version.cuda}
    else:
        info |= {"name": f"CPU ({platform.processor() or platform.machine()})", "threads": torch.get_num_threads()}
    return info


def copy_bandwidth(device: str, gib: float, repeats: int = 10) -> dict:
    """`dst.copy_(src)` of a `gib` GiB bf16 buffer: (bytes read + bytes written) / time, median of `repeats`."""
    numel = max(1, int(gib * (1 << 30)) // 2)
    src = torch.ones(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    try:
        dst.copy_(src)  # warm-up
        _sync(device)
        times = []
        for _ in range(repeats):
            if _is_cuda(device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                start = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - start)
    finally:
        del src, dst
        _free_memory(device)
    seconds = statistics.median(times)
    moved = 2 * numel * 2
    return {"buffer_bytes": numel * 2, "bytes_per_copy": moved, "median_s": seconds,
            "bytes_per_s": moved / seconds, "gb_per_s": moved / seconds / 1e9}


# --- phase 2: kernel tests ----------------------------------------------------------------------------


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent  # app/ lives in the repository root of a checkout


def kernel_test_files(root: Path, patterns: str) -> list[str] | None:
    """The checkout's test files matching `patterns` (comma-separated globs relative to `root`), relative to
    it; None when the tests are not installed (no tests/core next to the package)."""
    if not (root / "tests" / "core").is_dir():
        return None
    files: list[str] = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        files.extend(str(p.relative_to(root)) for p in sorted(root.glob(pattern)) if p.is_file())
    return list(dict.fromkeys(files))


def run_kernel_tests(timeout: float, patterns: str) -> dict:
    root = repo_root()
    files = kernel_test_files(root, patterns)
    if files is None:
        return {"status": "not installed", "summary": f"no tests/ next to the package ({root}): kernel tests "
                                                       "run only from a repository checkout", "ok": True}
    if not files:
        return {"status": "none found", "summary": f"no test file matches {patterns} in the checkout",
                "ok": True, "files": []}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"status": "timeout", "summary": f"timed out after {timeout:.0f} s", "ok": False, "files": files,
                "tail": out.splitlines()[-30:]}
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line
                                                                            or "error" in line or "skipped" in line)),
                   lines[-1] if lines else f"exit code {done.returncode}")
    ok = done.returncode == 0
    return {"status": "passed" if ok else f"failed (exit code {done.returncode})", "summary": summary.strip("= "),
            "ok": ok, "files": files, "tail": [] if ok else lines[-40:]}


# --- models -------------------------------------------------------------------------------------------


def tokenizer_files(source: Path) -> list[Path]:
    return [p for p in source.iterdir() if p.is_file() and p.name != "config.json"
            and p.name != "generation_config.json" and not p.name.endswith((".safetensors", ".json.index"))
            and not p.name.startswith("model.safetensors")]


def synthetic_tokenizer(target: Path, vocab: int = PROMPT_VOCAB) -> Path:
    """A word-level tokenizer ("t<id>" words; <unk> <s> </s> at 0 1 2) for when the embedded model is missing:
    the random models then still run (prompts are token ids, so the vocabulary's words do not matter)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = {w: i for i, w in enumerate(specials + [f"t{i}" for i in range(len(specials), vocab)])}
    raw = RawTokenizer(models.WordLevel(words, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    target.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(target)
    return target


def tokenizer_source(workdir: Path) -> Path:
    """The embedded model's directory (its tokenizer files), or a synthetic tokenizer when it is missing."""
    from kvforge.core.loader import ModelNotFoundError, resolve_model

    try:
        return resolve_model(None)
    except ModelNotFoundError as exc:
        print(f"embedded model unavailable ({exc}); random models use a synthetic tokenizer", flush=True)
        return synthetic_tokenizer(workdir / "synthetic-tokenizer")


def hf_config(spec: ModelSpec):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[spec.family]
    config = cls(**spec.shape, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def build_random_model(spec: ModelSpec, target: Path, device: str, dtype: torch.dtype, tokenizer_dir: Path):
    """A random-weight HF model of `spec`'s shape, built on `device` (HF's std-0.02 init, plus random biases and
    norm weights so those paths are exercised too), saved as config.json + model.safetensors + the embedded
    tokenizer's files into `target`. Returns the HF model (left on the device)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = hf_config(spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()  # a no-op when from_config honoured the device context
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # HF starts biases at zero: Qwen2's qkv bias would test nothing
                param.normal_(0.0, 0.02)
            elif "norm" in name:  # and norm weights at one
                param.normal_(1.0, 0.1)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    target.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    del state
    model.config.save_pretrained(target)
    for path in tokenizer_files(tokenizer_dir):
        shutil.copy(path, target / path.name)
    return model


def load_hf(path: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PROMPT_ID, PROMPT_VOCAB, (count, length), generator=gen).tolist()


# --- HF transformers ---------------------------------------------------------------------------------


def hf_reference(model, prompts: list[list[int]], new_tokens: int, device: str) -> list[dict]:
    """Greedy `generate` per prompt (batch 1: no padding): the tokens (cut after EOS) and each step's logprobs."""
    refs = []
    for ids in prompts:
        input_ids = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=EOS_ID, eos_token_id=EOS_ID)
        tokens = out.sequences[0, len(ids):].tolist()
        cut = next((i + 1 for i, t in enumerate(tokens) if t == EOS_ID), len(tokens))
        logprobs = [torch.log_softmax(step[0].float(), dim=-1).cpu() for step in out.logits[:cut]]
        refs.append({"tokens": tokens[:cut], "logprobs": logprobs})
    return refs


def hf_generate_rate(model, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    """One greedy `generate` over the prompts as one batch (equal lengths: no padding), forced to `new_tokens`."""
    input_ids = torch.tensor(prompts, device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=EOS_ID,
                             eos_token_id=EOS_ID)
    _sync(device)
    wall = time.perf_counter() - start
    generated = (out.shape[1] - input_ids.shape[1]) * len(prompts)
    return {"wall_s": wall, "generated_tokens": generated, "output_tok_s": generated / wall}


# --- kvforge -----------------------------------------------------------------------------------------


def make_engine(path: Path, args, graphs: bool, max_model_len: int):
    from kvforge.core import LLMEngine
    from kvforge.core.config import EngineConfig

    config = EngineConfig(
        model=str(path), dtype=args.dtype, device=args.device, kernels=args.kernels, cuda_graphs=graphs,
        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)) or None, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=max(max(args.batches), max(args.graph_batches), len(args.parity_prompt_lens)),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=False)  # random prompts share nothing; repeats must prefill again
    return LLMEngine(config, progress=False)


def run_batch(engine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None,
              ignore_eos: bool = True) -> dict:
    """Submit the prompts at once and step until all finish. Output tok/s over the whole run; decode tok/s
    from when every sequence has its first token (prefill excluded)."""
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=logprobs)
    ids = []
    try:
        for prompt in prompts:
            ids.append(engine.add_request(prompt, params))
        counts: dict[str, int] = {}
        finals: dict[str, list[int]] = {}
        tops: dict[str, list] = {rid: [] for rid in ids}
        start = time.perf_counter()
        decode_start, first_tokens = None, 0
        while engine.has_unfinished():
            for out in engine.step():
                counts[out.request_id] = len(out.token_ids)
                tops[out.request_id].extend(out.delta_logprobs or [])
                if out.finished:
                    finals[out.request_id] = list(out.token_ids)
            if decode_start is None and len(counts) == len(prompts):
                decode_start, first_tokens = time.perf_counter(), sum(counts.values())
        end = time.perf_counter()
    except BaseException:
        for rid in ids:  # leave the engine empty for the next step
            try:
                engine.abort(rid)
            except Exception:
                pass
        raise
    if len(finals) != len(ids):
        raise RuntimeError(f"{len(ids) - len(finals)} of {len(ids)} requests did not finish")
    short = [len(finals[rid]) for rid in ids if len(finals[rid]) != max_tokens]
    if ignore_eos and short:
        raise RuntimeError(f"{len(short)} of {len(ids)} requests ended early (e.g. after {short[0]} of "
                           f"{max_tokens} tokens)")
    generated = sum(len(t) for t in finals.values())
    decoded = generated - first_tokens
    return {"wall_s": end - start, "generated_tokens": generated, "output_tok_s": generated / (end - start),
            "decode_tok_s": decoded / (end - decode_start) if decode_start is not None and decoded > 0 else None,
            "token_ids": [finals[rid] for rid in ids], "logprobs": [tops[rid] for rid in ids]}


def logprobs_close(ours: list[int], our_top: list, theirs: list[int], their_logprobs: list) -> dict:
    """vLLM's `check_logprobs_close`: at each position the tokens are equal, or each side's token is in the
    other's top-k and the comparison stops there (near ties: random weights and bf16 make many)."""
    for pos, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        ours_top = {t for t, _ in our_top[pos].top} if pos < len(our_top) else set()
        their_top = set(their_logprobs[pos].topk(TOP_K).indices.tolist())
        if a in their_top and b in ours_top:
            return {"ok": True, "diverged_at": pos, "reason": None}
        return {"ok": False, "diverged_at": pos,
                "reason": f"token {pos}: kvforge {a} / HF {b} are not in each other's top-{TOP_K}"}
    return {"ok": True, "diverged_at": None, "reason": None}


def first_token_diff(our_top: list, their_logprobs: list) -> float | None:
    """max |kvforge - HF logprob| over kvforge's top-k of the first generated token."""
    if not our_top or not their_logprobs or our_top[0] is None:
        return None
    return max(abs(lp - float(their_logprobs[0][t])) for t, lp in our_top[0].top)


def parity(engine, prompts: list[list[int]], refs: list[dict], new_tokens: int, tol: float) -> dict:
    run = run_batch(engine, prompts, new_tokens, logprobs=TOP_K, ignore_eos=False)
    rows, diffs = [], []
    for prompt, ours, tops, ref in zip(prompts, run["token_ids"], run["logprobs"], refs):
        check = logprobs_close(ours, tops, ref["tokens"], ref["logprobs"])
        diff = first_token_diff(tops, ref["logprobs"])
        if diff is not None:
            diffs.append(diff)
        exact = next((i for i, (a, b) in enumerate(zip(ours, ref["tokens"])) if a != b), min(len(ours),
                                                                                               len(ref["tokens"])))
        rows.append({"prompt_len": len(prompt), "tokens": len(ours), "equal_prefix": exact} | check)
    max_diff = max(diffs) if diffs else None
    ok = all(r["ok"] for r in rows) and max_diff is not None and max_diff <= tol
    return {"ok": ok, "verdict": "PASS" if ok else "FAIL", "prompts": rows, "first_token_max_abs_logprob_diff":
            max_diff, "tolerance": tol}


def embed_bytes(engine) -> int:
    """Bytes of the input embedding table: a decode step reads one row of it, not the whole table."""
    model = getattr(engine.runner, "model", None)
    table = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    return table.numel() * table.element_size() if isinstance(table, torch.Tensor) else 0


# --- one model (in its own process) --------------------------------------------------------------------


def empty_result(name: str, note: str = "", error: str | None = None) -> dict:
    """A model's result before any step (with `error` as its process error)."""
    return {"model": name, "note": note, "done": [], "errors": {} if error is None else {"process": error},
            "skipped": {}, "timings": {}, "parity": {}, "decode": None, "throughput": {},
            "graphs": {"on": {}, "off": {}, "same_tokens": {}}}


class Steps:
    """Runs each step of a model wrapped: an error is printed and recorded, and the next step still runs.
    The results are written to `out` after every step (a crash keeps the finished ones)."""

    def __init__(self, result: dict, out: Path | None) -> None:
        self.result, self.out = result, out

    def save(self) -> None:
        if self.out is not None:
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.result, default=str))
            os.replace(tmp, self.out)

    def run(self, name: str, label: str, fn, *needs: str):
        model = self.result["model"]
        missing = [n for n in needs if n not in self.result["done"]]
        if missing:
            self.result["skipped"][name] = f"needs {', '.join(missing)}"
            print(f"[{model}] {label}: skipped ({missing[0]} did not finish)", flush=True)
            self.save()
            return None
        print(f"[{model}] {label} ...", flush=True)
        start = time.perf_counter()
        value = None
        try:
            value = fn()
            self.result["done"].append(name)
        except Exception as exc:
            self.result["errors"][name] = _error(exc)
            print(f"[{model}] {label}: ERROR {_error(exc)}", flush=True)
            traceback.print_exc(file=sys.stdout)
        elapsed = time.perf_counter() - start
        self.result["timings"][name] = elapsed
        print(f"[{model}] {label}: {elapsed:.1f} s", flush=True)
        sys.stdout.flush()
        self.save()
        return value


def run_model(name: str, args, bandwidth: float | None, out: Path | None = None, workdir: str | None = None) -> dict:
    """Every step for one model; the result dict (also written to `out` as it grows). The random model's files
    go to a temporary directory under `workdir` (default: the system's)."""
    from kvforge.core.config import DTYPES
    from kvforge.core.loader import resolve_model

    spec = (SMOKE_MODELS if args.smoke else MODELS)[name]
    device, dtype = args.device, DTYPES[args.dtype]
    result = empty_result(name, spec.note)
    steps = Steps(result, out)
    parity_prompts = [random_prompts(1, n, seed=100 + n)[0] for n in args.parity_prompt_lens]
    pool = random_prompts(max(max(args.batches), max(args.graph_batches)), args.prompt_len, seed=1)
    max_model_len = max(max(args.parity_prompt_lens) + args.parity_tokens, args.prompt_len + args.output_len,
                        args.prompt_len + args.decode_tokens) + 32
    state: dict = {}
    tmp = tempfile.TemporaryDirectory(prefix=f"kvforge-bench-gpu-{name}-", dir=workdir)
    try:
        def build():
            if spec.family == "embedded":
                state["path"] = resolve_model(None)
                state["hf"] = None if args.no_hf else load_hf(state["path"], device, dtype)
            else:
                state["path"] = Path(tmp.name) / name
                tokenizer_dir = tokenizer_source(Path(tmp.name))
                state["hf"] = build_random_model(spec, state["path"], device, dtype, tokenizer_dir)
                if args.no_hf:
                    state.pop("hf")
            config = json.loads((state["path"] / "config.json").read_text())
            result["config"] = {k: config.get(k) for k in (
                "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings")}
            hf = state.get("hf")
            if hf is not None:
                result["hf_params"] = sum(p.numel() for p in hf.parameters())
            print(f"[{name}] {spec.note}: {result['config']}", flush=True)

        steps.run("build", "build model" + ("" if args.no_hf else " + HF model on the device"), build)

        if not args.no_hf and "build" in result["done"]:
            def hf_parity():
                state["refs"] = hf_reference(state["hf"], parity_prompts, args.parity_tokens, device)

            def hf_throughput():
                hf = state["hf"]
                hf_generate_rate(hf, pool[:1], 2, device)  # warm-up
                for n in args.batches:
                    if n > args.hf_max_batch:
                        print(f"[{name}] HF generate batch {n}: skipped (--hf-max-batch {args.hf_max_batch})")
                        continue
                    hf_generate_rate(hf, pool[:n], 2, device)  # warm-up at this shape
                    rate = hf_generate_rate(hf, pool[:n], args.output_len, device)
                    result["throughput"].setdefault(str(n), {})["hf"] = rate
                    print(f"[{name}] HF generate batch {n}: {rate['output_tok_s']:.1f} output tok/s "
                          f"({rate['wall_s']:.2f} s)", flush=True)
                    steps.save()

            steps.run("hf_parity_reference", "3. HF reference (greedy, logprobs)", hf_parity, "build")
            steps.run("hf_throughput", f"5. HF generate at batches {args.batches}", hf_throughput, "build")
        state.pop("hf", None)  # the HF model goes before the engines come
        _free_memory(device)

        for graphs in (True, False):
            tag = "on" if graphs else "off"
            engine_step = f"engine_graphs_{tag}"

            def start(graphs=graphs, tag=tag):
                t0 = time.perf_counter()
                engine = make_engine(state["path"], args, graphs, max_model_len)
                state["engine"] = engine
                result[f"engine_start_s_graphs_{tag}"] = time.perf_counter() - t0
                result["weight_bytes"] = engine.runner.weight_bytes()
                result["kv_cache_bytes"] = engine.runner.kv_cache_bytes
                runner = engine.runner
                kernels = runner.kernels
                sizes = runner.graphs.sizes if runner.graphs is not None else None
                result[f"engine_graphs_{tag}"] = {"kernels": kernels, "graph_batch_sizes": sizes}
                cfg = engine.config
                print(f"[{name}] engine (cuda_graphs={graphs}): device {cfg.device}, dtype {cfg.dtype}, kernels "
                      f"{cfg.kernels} -> {kernels}, CUDA graphs for batches {sizes or 'none'}, weights "
                      f"{result['weight_bytes'] / 1e9:.3f} GB, KV cache {runner.kv_cache_bytes / (1 << 30):.2f} GiB, "
                      f"start-up {result[f'engine_start_s_graphs_{tag}']:.1f} s", flush=True)
                if _is_cuda(args.device) and args.kernels != "torch" and kernels != "triton":
                    result["errors"][f"engine_graphs_{tag}_kernels"] = (
                        f"kernels={args.kernels!r} on CUDA resolved to {kernels!r}, not the Triton kernels")
                if _is_cuda(args.device) and graphs and not sizes:
                    result["errors"]["engine_graphs_on_capture"] = (
                        "cuda_graphs=True but no graph was captured (see the warning above): decode ran eagerly")
                start_warm = time.perf_counter()
                run_batch(engine, [pool[0]], 4)  # warm-up: compiles, first launches
                print(f"[{name}] first request (warm-up) {time.perf_counter() - start_warm:.1f} s", flush=True)

            steps.run(engine_step, f"kvforge engine start (cuda_graphs={graphs})", start, "build")
            try:
                if graphs:
                    _engine_on_steps(steps, state, args, name, parity_prompts, pool, bandwidth)
                else:
                    _engine_off_steps(steps, state, args, name, parity_prompts, pool)
            finally:
                engine = state.pop("engine", None)
                if engine is not None:
                    try:
                        engine.close()
                    except Exception as exc:
                        print(f"[{name}] engine close: {_error(exc)}", flush=True)
                    del engine
                _free_memory(device)
    finally:
        state.clear()
        _free_memory(device)
        tmp.cleanup()
        steps.save()
    return result


def _graph_decode(steps: Steps, state: dict, args, name: str, pool: list[list[int]], tag: str) -> None:
    result = steps.result
    for n in args.graph_batches:
        run = run_batch(state["engine"], pool[:n], args.output_len)
        result["graphs"][tag][str(n)] = run["decode_tok_s"]
        state.setdefault("graph_tokens", {}).setdefault(tag, {})[n] = run["token_ids"]
        rate = "n/a" if run["decode_tok_s"] is None else f"{run['decode_tok_s']:.1f}"
        print(f"[{name}] cuda_graphs {tag}, batch {n}: {rate} decode tok/s", flush=True)
        steps.save()


def _engine_on_steps(steps: Steps, state: dict, args, name: str, parity_prompts, pool, bandwidth) -> None:
    result = steps.result

    def check_parity():
        report = parity(state["engine"], parity_prompts, state["refs"], args.parity_tokens, args.logprob_tol)
        result["parity"]["graphs_on"] = report
        diff = report["first_token_max_abs_logprob_diff"]
        print(f"[{name}] parity vs HF ({args.dtype}): {report['verdict']}; first-token max |dlogprob| "
              f"{'n/a' if diff is None else f'{diff:.4f}'} (tol {args.logprob_tol}); "
              + "; ".join(f"len {r['prompt_len']}: {r['equal_prefix']}/{r['tokens']} equal"
                          + (f", {r['reason']}" if r["reason"] else "") for r in report["prompts"]), flush=True)

    def decode():
        engine = state["engine"]
        rates = [run_batch(engine, [pool[0]], args.decode_tokens)["decode_tok_s"] for _ in range(args.repeats)]
        rates = [r for r in rates if r is not None]
        if not rates:
            raise ValueError("--decode-tokens must be >= 2 to time decode steps")
        tok_s = statistics.median(rates)
        weights = engine.runner.weight_bytes()
        weight_read = weights - embed_bytes(engine)
        kv_per_token = engine.runner.kv_bytes_per_block / engine.runner.block_size
        kv_read = kv_per_token * (args.prompt_len + args.decode_tokens / 2)  # the mean context's KV
        per_token = weight_read + kv_read
        roofline = bandwidth / per_token if bandwidth else None
        result["decode"] = {"tok_s": tok_s, "runs": rates, "weight_bytes": weights,
                            "weight_bytes_read_per_token": weight_read, "kv_bytes_read_per_token": kv_read,
                            "bytes_per_token": per_token, "bandwidth_bytes_per_s": bandwidth,
                            "roofline_tok_s": roofline, "fraction_of_roofline": tok_s / roofline if roofline else None,
                            "target": TARGET_ROOFLINE}
        share = f"{tok_s / roofline:.1%}" if roofline else "n/a"
        print(f"[{name}] batch-1 decode {tok_s:.1f} tok/s; roofline {roofline or 0:.1f} tok/s "
              f"({per_token / 1e9:.3f} GB per token); {share} of roofline (target {TARGET_ROOFLINE:.0%})", flush=True)

    def throughput():
        engine = state["engine"]
        for n in args.batches:
            run_batch(engine, pool[:n], 3)  # warm-up at this batch size
            run = run_batch(engine, pool[:n], args.output_len)
            row = result["throughput"].setdefault(str(n), {})
            row["kvforge"] = {k: run[k] for k in ("wall_s", "generated_tokens", "output_tok_s", "decode_tok_s")}
            hf = row.get("hf")
            row["ratio"] = run["output_tok_s"] / hf["output_tok_s"] if hf else None
            versus = f"; HF {hf['output_tok_s']:.1f} tok/s; {row['ratio']:.2f}x" if hf else "; HF n/a"
            print(f"[{name}] kvforge batch {n}: {run['output_tok_s']:.1f} output tok/s ({run['wall_s']:.2f} s)"
                  f"{versus}", flush=True)
            steps.save()

    steps.run("parity", "3. parity vs HF (cuda_graphs on)", check_parity, "engine_graphs_on", "hf_parity_reference")
    steps.run("decode", "4. batch-1 decode vs roofline", decode, "engine_graphs_on")
    steps.run("throughput", f"5. kvforge throughput at batches {args.batches}", throughput, "engine_graphs_on")
    steps.run("graphs_on", f"6. decode, cuda_graphs on, batches {args.graph_batches}",
              lambda: _graph_decode(steps, state, args, name, pool, "on"), "engine_graphs_on")


def _engine_off_steps(steps: Steps, state: dict, args, name: str, parity_prompts, pool) -> None:
    result = steps.result

    def graphs_off():
        _graph_decode(steps, state, args, name, pool, "off")
        tokens = state.get("graph_tokens", {})
        for n in args.graph_batches:
            on, off = tokens.get("on", {}).get(n), tokens.get("off", {}).get(n)
            if on is not None and off is not None:
                same = sum(a == b for a, b in zip(on, off))
                result["graphs"]["same_tokens"][str(n)] = f"{same}/{n}"

    def check_parity():
        report = parity(state["engine"], parity_prompts, state["refs"], args.parity_tokens, args.logprob_tol)
        result["parity"]["graphs_off"] = report
        print(f"[{name}] parity vs HF (cuda_graphs off): {report['verdict']}", flush=True)

    steps.run("graphs_off", f"6. decode, cuda_graphs off, batches {args.graph_batches}", graphs_off,
              "engine_graphs_off")
    steps.run("parity_graphs_off", "3. parity vs HF (cuda_graphs off)", check_parity, "engine_graphs_off",
              "hf_parity_reference")


def worker_main(argv: list[str]) -> int:
    """`python -m kvforge.app.bench_gpu JOB.json`: one model's steps, in a process of its own."""
    import warnings

    job = json.loads(Path(argv[0]).read_text())
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:
        pass
    args = argparse.Namespace(**job["args"])
    result = run_model(job["model"], args, job["bandwidth"], Path(job["out"]), job.get("workdir"))
    return 1 if result["errors"] else 0


# --- the command -------------------------------------------------------------------------------------


def _relay(stream, prefix: str = "  ") -> None:
    for line in stream:
        print(prefix + line.rstrip("\n"), flush=True)


def run_model_isolated(name: str, args, bandwidth: float | None, timeout: float) -> dict:
    """`run_model` in a child process (its output relayed line by line); a crash or a timeout keeps the steps
    the child finished and records what happened."""
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-gpu-job-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        options = {k: v for k, v in vars(args).items() if k != "func"}
        job.write_text(json.dumps({"args": options, "model": name, "bandwidth": bandwidth, "out": str(out),
                                   "workdir": tmp}))  # a killed child's model files go with this directory
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_TELEMETRY="1")
        proc = subprocess.Popen([sys.executable, "-m", "kvforge.app.bench_gpu", str(job)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, errors="replace")
        relay = threading.Thread(target=_relay, args=(proc.stdout,), daemon=True)
        relay.start()
        timed_out = False
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            code = proc.wait()
        relay.join(timeout=10)
        result = None
        if out.exists():
            try:
                result = json.loads(out.read_text())
            except json.JSONDecodeError:
                result = None
        if result is None:
            result = empty_result(name)
        if timed_out:
            result["errors"]["process"] = f"stopped after {timeout:.0f} s (--time-budget)"
        elif code != 0 and not result["errors"]:
            result["errors"]["process"] = f"the model's process exited with code {code}"
        result["exit_code"] = code
        return result


def _fmt(value, spec: str = ".1f", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def _phase_time(results: list[dict], names: tuple[str, ...]) -> float:
    return sum(r["timings"].get(n, 0.0) for r in results for n in names)


def print_summary(report: dict) -> None:
    results = report["models"]
    parity_steps, throughput_steps = ("hf_parity_reference", "parity", "parity_graphs_off"), ("hf_throughput",
                                                                                              "throughput")
    print(f"\n== 3/6 parity with HF transformers ({report['options']['dtype']}; top-{TOP_K} logprob rule, first-token "
          f"|dlogprob| <= {report['options']['logprob_tol']}) [{_phase_time(results, parity_steps):.1f} s] ==")
    for r in results:
        on, off = r["parity"].get("graphs_on"), r["parity"].get("graphs_off")
        if on is None:
            print(f"{r['model']:<12} {_why_missing(r, ('hf_parity_reference', 'parity'))}")
            continue
        diff = on["first_token_max_abs_logprob_diff"]
        cells = "; ".join(f"len {p['prompt_len']}: {p['equal_prefix']}/{p['tokens']} equal"
                          + ("" if p["ok"] else " FAIL") for p in on["prompts"])
        print(f"{r['model']:<12} {on['verdict']} (graphs on), {off['verdict'] if off else 'n/a'} (graphs off); "
              f"first-token max |dlogprob| {_fmt(diff, '.4f')}; {cells}")

    print(f"\n== 4/6 batch-1 decode vs the bandwidth roofline [{_phase_time(results, ('decode',)):.1f} s] ==")
    print(f"{'model':<12} {'weights GB':>10} {'GB/token':>9} {'tok/s':>9} {'roofline':>9} {'share':>7}  target")
    for r in results:
        d = r.get("decode")
        if not d:
            print(f"{r['model']:<12} {_why_missing(r, ('decode',))}")
            continue
        share = d["fraction_of_roofline"]
        verdict = "n/a" if share is None else ("PASS" if share >= TARGET_ROOFLINE else "MISS")
        print(f"{r['model']:<12} {d['weight_bytes'] / 1e9:>10.3f} {d['bytes_per_token'] / 1e9:>9.3f} "
              f"{d['tok_s']:>9.1f} {_fmt(d['roofline_tok_s']):>9} {_fmt(share and share * 100, '.1f'):>6}%  "
              f">= {TARGET_ROOFLINE:.0%}: {verdict}")

    print(f"\n== 5/6 throughput: N sequences at once, {report['options']['prompt_len']} prompt + "
          f"{report['options']['output_len']} output tokens, vs HF generate "
          f"[{_phase_time(results, throughput_steps):.1f} s] ==")
    print(f"{'model':<12} {'N':>5} {'kvforge tok/s':>14} {'HF tok/s':>10} {'ratio':>8}")
    for r in results:
        if not r["throughput"]:
            print(f"{r['model']:<12} {_why_missing(r, ('hf_throughput', 'throughput'))}")
        for n, row in sorted(r["throughput"].items(), key=lambda kv: int(kv[0])):
            kv, hf = row.get("kvforge"), row.get("hf")
            ratio = row.get("ratio")
            print(f"{r['model']:<12} {n:>5} {_fmt(kv and kv['output_tok_s']):>14} "
                  f"{_fmt(hf and hf['output_tok_s']):>10} {_fmt(ratio, '.2f') + 'x' if ratio else 'n/a':>8}")

    graph_time = _phase_time(results, ("graphs_on", "graphs_off"))
    print(f"\n== 6/6 CUDA graphs on vs off: decode tok/s [{graph_time:.1f} s] ==")
    print(f"{'model':<12} {'N':>5} {'graphs on':>10} {'graphs off':>11} {'on/off':>8}  same greedy tokens")
    for r in results:
        on, off, same = r["graphs"]["on"], r["graphs"]["off"], r["graphs"]["same_tokens"]
        if not on and not off:
            print(f"{r['model']:<12} {_why_missing(r, ('graphs_on', 'graphs_off'))}")
        for n in sorted(set(on) | set(off), key=int):
            a, b = on.get(n), off.get(n)
            speedup = f"{a / b:.2f}x" if a and b else "n/a"
            print(f"{r['model']:<12} {n:>5} {_fmt(a):>10} {_fmt(b):>11} {speedup:>8}  {same.get(n, 'n/a')}")

    print("\n== timings per model (s) ==")
    for r in results:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items())
        print(f"{r['model']:<12} total {sum(r['timings'].values()):.1f}: {steps}")

    print("\n== targets ==")
    for line in report["targets"]:
        print(line)
    if report["failures"]:
        print("\n== failures ==")
        for line in report["failures"]:
            print(line)


def _why_missing(result: dict, names: tuple[str, ...]) -> str:
    for n in names:
        if n in result["errors"]:
            return f"ERROR in {n}: {result['errors'][n]}"
        if n in result["skipped"]:
            return f"skipped ({n}: {result['skipped'][n]})"
    if "process" in result["errors"]:
        return f"ERROR: {result['errors']['process']}"
    return "n/a"


def verdicts(report: dict) -> tuple[list[str], list[str]]:
    """The one-line verdict per target and model, and every failure."""
    smoke = " (smoke run on CPU: the figures mean nothing)" if report["options"]["smoke"] else ""
    largest = max(report["options"]["batches"])
    targets, failures = [], []
    for r in report["models"]:
        d = r.get("decode")
        share = d and d.get("fraction_of_roofline")
        targets.append(f"{r['model']:<12} batch-1 decode >= {TARGET_ROOFLINE:.0%} of roofline: "
                       + ("n/a" if share is None else f"{'PASS' if share >= TARGET_ROOFLINE else 'MISS'} "
                                                      f"({share:.1%}){smoke}"))
        ratio = r["throughput"].get(str(largest), {}).get("ratio")
        targets.append(f"{r['model']:<12} {largest}-sequence throughput >= {TARGET_HF_RATIO:.0f}x HF generate: "
                       + ("n/a" if ratio is None else f"{'PASS' if ratio >= TARGET_HF_RATIO else 'MISS'} "
                                                      f"({ratio:.2f}x){smoke}"))
        for step, error in r["errors"].items():
            failures.append(f"{r['model']}: {step}: {error}")
        for key, rep in r["parity"].items():
            if not rep["ok"]:
                failures.append(f"{r['model']}: parity ({key.replace('_', ' ')}) FAIL: "
                                + "; ".join(p["reason"] for p in rep["prompts"] if p["reason"])
                                + f" first-token max |dlogprob| {_fmt(rep['first_token_max_abs_logprob_diff'], '.4f')}")
    for phase, error in report["errors"].items():
        failures.append(f"{phase}: {error}")
    return targets, failures


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    args = resolve_options(args)
    if not args.smoke and not torch.cuda.is_available():
        raise ValueError(NEEDS_CUDA)
    if not args.smoke and not _is_cuda(args.device):
        raise ValueError(f"--device must be a CUDA device (cuda or cuda:N), got {args.device!r}; "
                         "use --smoke for the CPU")
    deadline = t_start + args.time_budget
    options = {k: v for k, v in vars(args).items() if k != "func"}
    report: dict = {"options": options, "device": None, "bandwidth": None, "kernel_tests": None, "models": [],
                    "errors": {}, "timings": {}}
    print(f"kvforge bench gpu{' --smoke' if args.smoke else ''}: models {', '.join(args.models)}; {args.dtype}; "
          f"kernels {args.kernels}; time budget {args.time_budget:.0f} s", flush=True)

    print("\n== 1/6 device and copy bandwidth ==", flush=True)
    start = time.perf_counter()
    try:
        report["device"] = device_info(args.device)
        print("  " + ", ".join(f"{k} {v}" for k, v in report["device"].items()), flush=True)
        report["bandwidth"] = copy_bandwidth(args.device, args.bandwidth_gib)
        bw = report["bandwidth"]
        print(f"  copy bandwidth {bw['gb_per_s']:.1f} GB/s (read + write of a {bw['buffer_bytes'] / (1 << 30):.3f} "
              f"GiB bf16 buffer, median {bw['median_s'] * 1000:.3f} ms)", flush=True)
    except Exception as exc:
        report["errors"]["bandwidth"] = _error(exc)
        print(f"  ERROR {_error(exc)}", flush=True)
        traceback.print_exc(file=sys.stdout)
    try:  # once here (a first run converts the embedded GGUF): the models' processes then find it cached
        from kvforge.core.loader import resolve_model

        t0 = time.perf_counter()
        report["embedded_model"] = str(resolve_model(None))
        print(f"  embedded model {report['embedded_model']} ({time.perf_counter() - t0:.1f} s)", flush=True)
    except Exception as exc:  # the random models fall back to a synthetic tokenizer
        report["embedded_model"] = None
        print(f"  embedded model unavailable: {_error(exc)}", flush=True)
    report["timings"]["1_bandwidth"] = time.perf_counter() - start
    print(f"  [{report['timings']['1_bandwidth']:.1f} s]", flush=True)

    print("\n== 2/6 kernel tests on the device ==", flush=True)
    start = time.perf_counter()
    if args.skip_kernel_tests or args.smoke:
        report["kernel_tests"] = {"status": "skipped", "summary": "--smoke" if args.smoke else "--skip-kernel-tests",
                                  "ok": True}
    else:
        try:
            report["kernel_tests"] = run_kernel_tests(args.kernel_test_timeout, args.kernel_tests)
        except Exception as exc:
            report["kernel_tests"] = {"status": "error", "summary": _error(exc), "ok": False}
    kt = report["kernel_tests"]
    if kt.get("files"):
        print(f"  {len(kt['files'])} files: {' '.join(kt['files'])}", flush=True)
    print(f"  {kt['status']}: {kt['summary']}", flush=True)
    for line in kt.get("tail") or []:
        print("  | " + line, flush=True)
    if not kt["ok"]:
        report["errors"]["kernel_tests"] = f"{kt['status']}: {kt['summary']}"
    report["timings"]["2_kernel_tests"] = time.perf_counter() - start
    print(f"  [{report['timings']['2_kernel_tests']:.1f} s]", flush=True)

    bandwidth = report["bandwidth"]["bytes_per_s"] if report["bandwidth"] else None
    for name in args.models:
        left = deadline - time.perf_counter()
        print(f"\n== model {name}: phases 3-6 [{left:.0f} s of the time budget left] ==", flush=True)
        start = time.perf_counter()
        if left < 20:
            result = empty_result(name, error="not started: the time budget is spent")
            print(f"  skipped: {result['errors']['process']}", flush=True)
        else:
            try:
                result = run_model(name, args, bandwidth) if args.no_isolate else run_model_isolated(
                    name, args, bandwidth, left)
            except Exception as exc:
                traceback.print_exc(file=sys.stdout)
                result = empty_result(name, error=_error(exc))
        report["models"].append(result)
        report["timings"][f"model_{name}"] = time.perf_counter() - start
        print(f"  [{name}: {report['timings'][f'model_{name}']:.1f} s]", flush=True)

    try:
        report["targets"], report["failures"] = verdicts(report)
    except Exception as exc:  # a bug here must not lose the figures: the JSON still gets written
        report["targets"], report["failures"] = [], [f"verdicts: {_error(exc)}"]
        traceback.print_exc(file=sys.stdout)
    report["total_s"] = time.perf_counter() - t_start
    report["ok"] = not report["failures"]
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        except Exception as exc:
            print(f"writing {args.json}: {_error(exc)}", flush=True)
            report["ok"] = False
    try:
        print_summary(report)
    except Exception as exc:
        print(f"summary: {_error(exc)}", flush=True)
        traceback.print_exc(file=sys.stdout)
        report["ok"] = False
    outcome = "all phases ran" if report["ok"] else f"{len(report['failures'])} failure(s)"
    print(f"\ntotal {report['total_s']:.1f} s (budget {args.time_budget:.0f} s); {outcome}", flush=True)
    if args.json:
        print(f"results written to {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
