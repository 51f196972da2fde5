"""Every Triton kernel of the project compiles for Hopper (sm_90), with the launches the code really makes.

The interpreter tests (TRITON_INTERPRET=1) check the kernels' numbers on CPU but never compile them. Here
each public kernel function is called on CPU tensors inside `record_launches(dry_run=True)`: nothing runs,
and the host code takes its compiled-GPU path (no interpreter workarounds such as paged_prefill's fp32
dots, triton_gemm's BF16_BY_HAND or fused's RNE / INTERPRET flags), so the recorded launches carry exactly
the constexprs, tile sizes and num_warps a GPU launch gets. `aot.compile_launch` then builds each one for
sm_90 with the signature triton's launcher would use (triton's compiler and ptxas only: no GPU needed).

The compiling runs in worker processes without TRITON_INTERPRET: a process that imported triton with
TRITON_INTERPRET=1 set (another test module, or a CI-wide setting) holds interpreted versions of triton's
own jitted helpers (tl.standard), which cannot be compiled. The workers split the cases (they use a core
each), compile launches that build the same kernel once, and report each case; the parametrized test
names the case that failed with triton's error. Run with `-s` to see shared memory, tensor-core use,
registers and spills of each build. Triton's on-disk cache makes a rerun of unchanged kernels fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.optional_parts import require

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, scope="module")
def _triton_here():
    require(HAS_TRITON, "triton is not installed (pip install triton==3.9.0; Linux x86_64 wheels only)")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _paged(dtype: torch.dtype, kv_heads: int, head_dim: int, seqs: int, tokens: int, block_size: int = 16,
           kv_format=None):
    """A head-major paged cache [2, KVH, NB, BS, D] (one layer, a view into a 2-layer pool as in the engine; a
    quantized format's uint8 rows instead of D values) and block tables giving each of `seqs` sequences room for
    `tokens` tokens."""
    per_seq = -(-tokens // block_size)
    row, dtype = (head_dim, dtype) if kv_format is None else (kv_format.row_bytes(head_dim), torch.uint8)
    pool = torch.zeros(2, 2, kv_heads, seqs * per_seq + 1, block_size, row, dtype=dtype)
    tables = torch.arange(1, seqs * per_seq + 1, dtype=torch.int32).view(seqs, per_seq)
    return pool[1], tables


def _decode(dtype: str, head_dim: int, group: int, splits: int, kv: str | None = None) -> None:
    from kvforge.core.kernels.paged_decode import paged_decode_attention
    from kvforge.core.kv.quant import KV_FORMATS

    kv_format = KV_FORMATS[kv] if kv else None
    kv_cache, tables = _paged(DTYPES[dtype], 8, head_dim, seqs=3, tokens=300, kv_format=kv_format)
    q = torch.zeros(3, 8 * group, head_dim, dtype=DTYPES[dtype])
    lens = torch.tensor([300, 17, 0], dtype=torch.int32)
    paged_decode_attention(q, kv_cache, tables, lens, head_dim**-0.5, num_splits=splits, kv_format=kv_format)


def _prefill(dtype: str, head_dim: int, group: int, chunk: int, window: int | None = None,
             kv: str | None = None) -> None:
    from kvforge.core.kernels.paged_prefill import paged_prefill_attention
    from kvforge.core.kv.quant import KV_FORMATS

    kv_format = KV_FORMATS[kv] if kv else None
    kv_cache, tables = _paged(DTYPES[dtype], 8, head_dim, seqs=2, tokens=chunk + 40, kv_format=kv_format)
    q = torch.zeros(2 * chunk, 8 * group, head_dim, dtype=DTYPES[dtype])
    starts = torch.tensor([0, chunk, 2 * chunk], dtype=torch.int32)
    lens = torch.tensor([chunk, chunk + 40], dtype=torch.int32)  # the second has a cached prefix
    paged_prefill_attention(q, kv_cache, tables, starts, lens, chunk, head_dim**-0.5, sliding_window=window,
                            kv_format=kv_format)


def _rms_norm(dtype: str, residual: bool) -> None:
    from kvforge.core.kernels.fused import rms_norm

    x = torch.zeros(5, 4096, dtype=DTYPES[dtype])
    rms_norm(x, torch.ones(4096, dtype=DTYPES[dtype]), 1e-6, torch.zeros_like(x) if residual else None)


def _silu_and_mul(dtype: str) -> None:
    from kvforge.core.kernels.fused import silu_and_mul

    silu_and_mul(torch.zeros(5, 2 * 11008, dtype=DTYPES[dtype]))


def _rotary(dtype: str) -> None:
    from kvforge.core.kernels.fused import rotary_inplace

    qkv = torch.zeros(5, (32 + 2 * 8) * 128, dtype=DTYPES[dtype])  # q | k columns of a fused projection
    x = qkv[:, : 40 * 128].view(5, 40, 128)
    cos = torch.ones(5, 1, 128, dtype=DTYPES[dtype])
    rotary_inplace(x, cos, torch.zeros_like(cos))


def _store_kv(dtype: str) -> None:
    from kvforge.core.kernels.fused import store_kv

    kv_cache, _ = _paged(DTYPES[dtype], 8, 128, seqs=1, tokens=64)
    qkv = torch.zeros(5, (32 + 2 * 8) * 128, dtype=DTYPES[dtype])
    k = qkv[:, 32 * 128: 40 * 128].view(5, 8, 128)
    v = qkv[:, 40 * 128:].view(5, 8, 128)
    store_kv(k, v, kv_cache, torch.tensor([3, 4, 5, -1, 17], dtype=torch.int64))


def _dequant_gemm(dtype: str, m: int) -> None:
    """GPTQ 4-bit, group 128, act-order g_idx: a 4096 x 4096 layer."""
    from kvforge.plugins.quant.triton_gemm import dequant_gemm

    k = n = 4096
    groups = k // 128
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    qzeros = torch.zeros(groups, n // 8, dtype=torch.int32)
    scales = torch.ones(groups, n, dtype=DTYPES[dtype])
    g_idx = torch.randperm(k).div(128, rounding_mode="floor").to(torch.int32)
    dequant_gemm(torch.zeros(m, k, dtype=DTYPES[dtype]), qweight, scales, qzeros, g_idx, 4)


def _fused_moe(dtype: str, tokens: int) -> None:
    """A Qwen3-30B-A3B-shaped MoE layer: 128 experts, 8 a token, hidden 2048, experts of 768."""
    import torch.nn.functional as F

    from kvforge.core.kernels.fused_moe import fused_moe

    experts, hidden, inter = 128, 2048, 768
    chosen = torch.stack([torch.randperm(experts)[:8] for _ in range(tokens)])
    fused_moe(torch.zeros(tokens, hidden, dtype=DTYPES[dtype]),
              torch.zeros(experts, 2 * inter, hidden, dtype=DTYPES[dtype]),
              torch.zeros(experts, hidden, inter, dtype=DTYPES[dtype]), chosen,
              torch.full((tokens, 8), 0.125, dtype=DTYPES[dtype]),
              lambda x: F.silu(x[:, :inter]) * x[:, inter:])


# (id, call, kernels it must launch, whether its dots must use tensor cores)
CASES: list[tuple[str, Callable[[], None], tuple[str, ...], bool]] = []
for _dt in ("bf16", "fp16"):
    for _d in (128, 64):
        for _g in (4, 1):
            CASES.append((f"decode-{_dt}-d{_d}-g{_g}-splits4", lambda dt=_dt, d=_d, g=_g: _decode(dt, d, g, 4),
                          ("_split_fn", "_combine_fn"), True))  # the split kernel's dots; combine has none
            for _chunk in (4, 128):  # small tiles (BLOCK_M 16 / 32, 4 warps) and large (BLOCK_M 64, 8 warps)
                CASES.append((f"prefill-{_dt}-d{_d}-g{_g}-chunk{_chunk}",
                              lambda dt=_dt, d=_d, g=_g, c=_chunk: _prefill(dt, d, g, c),
                              ("_paged_prefill_fn",), True))
    CASES += [
        (f"decode-{_dt}-d128-g4-splits1", lambda dt=_dt: _decode(dt, 128, 4, 1), ("_split_fn",), True),
        (f"rms_norm-{_dt}", lambda dt=_dt: _rms_norm(dt, False), ("_rms_norm",), False),
        (f"rms_norm-{_dt}-residual", lambda dt=_dt: _rms_norm(dt, True), ("_rms_norm",), False),
        (f"silu_and_mul-{_dt}", lambda dt=_dt: _silu_and_mul(dt), ("_silu_and_mul",), False),
        (f"rotary-{_dt}", lambda dt=_dt: _rotary(dt), ("_rotary",), False),
        (f"store_kv-{_dt}", lambda dt=_dt: _store_kv(dt), ("_store_kv",), False),
        (f"dequant_gemm-gptq4-{_dt}-m1", lambda dt=_dt: _dequant_gemm(dt, 1), ("_dequant_gemm_kernel",), True),
        (f"dequant_gemm-gptq4-{_dt}-m64", lambda dt=_dt: _dequant_gemm(dt, 64), ("_dequant_gemm_kernel",), True),
        (f"fused_moe-{_dt}-t1", lambda dt=_dt: _fused_moe(dt, 1), ("_moe_gemm_kernel",) * 2, True),
        (f"fused_moe-{_dt}-t64", lambda dt=_dt: _fused_moe(dt, 64), ("_moe_gemm_kernel",) * 2, True),
    ]
# a quantized KV pool: its rows dequantized in registers (core/kernels/kv_tiles.py, jitted with each kernel)
for _kv in ("int8", "q4"):
    CASES += [(f"decode-bf16-d128-g4-splits4-{_kv}", lambda kv=_kv: _decode("bf16", 128, 4, 4, kv),
               ("_split_fn", "_combine_fn"), True),
              (f"prefill-bf16-d128-g4-chunk128-{_kv}", lambda kv=_kv: _prefill("bf16", 128, 4, 128, kv=kv),
               ("_paged_prefill_fn",), True)]
# fp32 models: prefill dots in IEEE fp32 on GPUs too (FMA units), with a sliding window
CASES.append(("prefill-fp32-d128-g4-chunk128-window", lambda: _prefill("fp32", 128, 4, 128, window=64),
              ("_paged_prefill_fn",), False))


def _compile_cases(out_path: str, case_ids: list[str]) -> None:
    """Worker: record and compile the given cases, writing {case id: result} to out_path after each."""
    from kvforge.core.kernels.aot import compile_launch, signature_key
    from kvforge.core.kernels.runtime import record_launches

    calls = {case_id: call for case_id, call, _, _ in CASES}
    compiled, results = {}, {}
    for case_id in case_ids:
        result = {"kernels": [], "builds": [], "error": None}
        try:
            with record_launches(dry_run=True) as launches:
                calls[case_id]()
            result["kernels"] = [launch.name for launch in launches]
            for launch in launches:
                key = signature_key(launch)
                start = time.perf_counter()
                if key not in compiled:
                    compiled[key] = compile_launch(launch)  # raises triton's error when it does not compile
                built = compiled[key]
                result["builds"].append({
                    "name": built.name, "summary": built.summary(), "seconds": round(time.perf_counter() - start, 2),
                    "cubin_bytes": len(built.kernel.asm["cubin"]), "sm90": ".target sm_90" in built.kernel.asm["ptx"],
                    "tensor_cores": built.wgmma or built.mma, "spill_bytes": built.spill_bytes,
                })
        except Exception as exc:  # reported by the case's test, with triton's message
            result["error"] = "".join(traceback.format_exception(exc))[-6000:]
        results[case_id] = result
        Path(out_path).write_text(json.dumps(results))


_WORKER = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("kernels_compile_cases", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._compile_cases(sys.argv[3], sys.argv[4:])
"""


@pytest.fixture(scope="module")
def builds() -> dict:
    """{case id: result} from worker processes, one per core (at most 4), the cases dealt round-robin."""
    workers = max(1, min(4, os.cpu_count() or 1))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    ids = [case[0] for case in CASES]
    repo_root = str(Path(__file__).resolve().parents[2])  # where `tests` imports from
    results, failures = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(workers):
            out = os.path.join(tmp, f"worker{i}.json")
            cmd = [sys.executable, "-c", _WORKER, repo_root, str(Path(__file__).resolve()), out, *ids[i::workers]]
            procs.append((out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                text=True)))
        for out, proc in procs:
            log, _ = proc.communicate(timeout=900)
            if os.path.exists(out):
                results.update(json.loads(Path(out).read_text()))
            if proc.returncode:
                failures.append(log[-4000:])
    results["_worker_failures"] = failures
    return results


@pytest.mark.parametrize("case_id,kernels,tensor_cores", [(c[0], c[2], c[3]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_compiles_for_sm90(builds, case_id, kernels, tensor_cores):
    result = builds.get(case_id)
    assert result is not None, f"{case_id}: no result, the worker died:\n" + "\n".join(builds["_worker_failures"])
    assert result["error"] is None, f"{case_id} ({', '.join(result['kernels'])}) does not compile:\n{result['error']}"
    assert tuple(result["kernels"]) == kernels
    for built in result["builds"]:
        print(f"{case_id}: {built['summary']} [{built['seconds']} s]")
        assert built["cubin_bytes"] > 0 and built["sm90"], built["name"]
        if tensor_cores and built["name"] != "_combine_fn":  # bf16 / fp16 dots: a regression to fp32 loses them
            assert built["tensor_cores"], f"{built['name']}: no tensor-core instructions"
        # register spills go to local memory: a slow kernel (None: cuobjdump could not tell)
        assert built["spill_bytes"] in (0, None), f"{built['name']} spills {built['spill_bytes']} B: {built['summary']}"


def test_record_launches_runs_and_records(monkeypatch):
    """Without dry_run the launch still runs (interpreted without CUDA); with it nothing runs and the host
    code sees the compiled path; both restore the normal launch path afterwards."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvforge.core.kernels import runtime
    from kvforge.core.kernels.paged_prefill import paged_prefill_attention

    device = "cuda" if ON_CUDA else "cpu"
    kv_cache = torch.randn(2, 1, 2, 16, 16, device=device)
    tables = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 4], dtype=torch.int32, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    q = torch.randn(4, 2, 16, device=device)
    expected = paged_prefill_attention(q, kv_cache, tables, starts, lens, 4, 0.25)
    interpreted = runtime.interpreting()
    with runtime.record_launches() as launches:
        out = paged_prefill_attention(q, kv_cache, tables, starts, lens, 4, 0.25)
    assert [launch.name for launch in launches] == ["_paged_prefill_fn"]
    assert torch.equal(out, expected)
    assert launches[0].kwargs["DOT_FP32"] is True and launches[0].kwargs["num_warps"] == 4
    with runtime.record_launches(dry_run=True) as dry:
        assert not runtime.interpreting()
        paged_prefill_attention(q.half(), kv_cache.half(), tables, starts, lens, 4, 0.25)
    assert [launch.name for launch in dry] == ["_paged_prefill_fn"] and dry[0].kwargs["DOT_FP32"] is False
    assert runtime.interpreting() == interpreted and runtime._recording is None
