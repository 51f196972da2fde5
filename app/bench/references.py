"""HF transformers as the benches' reference: loading a model, greedy `generate` forced to a length (the
rates kvforge is compared with), greedy references with logprobs, and the parity rule that compares
kvforge's tokens with them (vLLM's `check_logprobs_close`)."""

from __future__ import annotations

import time

import torch

from kvforge.app.bench.probe import sync
from kvforge.app.bench.random_models import EOS_ID
from kvforge.app.bench.runs import run_batch

TOP_K = 5  # the logprob rule's top-k


def load_hf(path, dtype: str | torch.dtype, device: str = "cpu"):
    """The HF model at `path` in `dtype` (a kvforge dtype name or a torch dtype), on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    from kvforge.core.config import DTYPES, resolve_dtype

    dtype = DTYPES[resolve_dtype(dtype, device)] if isinstance(dtype, str) else dtype
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_generate(model, batch: list[list[int]], new_tokens: int, pad: int, device: str = "cpu",
                eos: int | None = None) -> int:
    """One greedy `generate` over a left-padded batch, forced to `new_tokens`; returns the tokens it generated."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
    stop = {} if eos is None else {"eos_token_id": eos}  # None would unset the model's own
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad, **stop)
    return (out.shape[1] - width) * len(batch)


def hf_generate_rate(model, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    """One greedy `generate` over the prompts as one batch (equal lengths: no padding), forced to `new_tokens`."""
    sync(device)
    start = time.perf_counter()
    generated = hf_generate(model, prompts, new_tokens, EOS_ID, device, eos=EOS_ID)
    sync(device)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "generated_tokens": generated, "output_tok_s": generated / wall}


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
    """kvforge's greedy tokens and top-k logprobs on `prompts` against the HF references `refs`."""
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
