"""`kvforge bench latency`: prefill and batch-1 decode speed of kvforge against HF transformers
`generate`, both measured in the same run on the same prompt (machines are shared and noisy, so
only same-run ratios mean anything).

`kvforge bench throughput`: many chat requests of varied lengths submitted at once to one engine
(continuous batching, prefix caching), against HF `generate` one request at a time and in static
left-padded batches, in the same run on the same prompts."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the budget, "
          "the schedule and the staffing plan for the coming year. ")


@dataclass
class Result:
    engine: str
    dtype: str
    prefill_tok_s: float
    decode_tok_s: float


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(FILLER * (n // 10 + 1))
    return ids[:n]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def rank_threads(threads: int | None, tp: int) -> int | None:
    """Each tensor-parallel rank's share of `threads` (None: the ranks split torch's default themselves)."""
    return None if threads is None else max(1, threads // tp)


def bench_kvforge(model: str | None, dtype: str, ids: list[int], decode_tokens: int, repeats: int,
                  threads: int | None, tp: int = 1) -> Result:
    from kvforge.core import LLMEngine
    from kvforge.core.config import EngineConfig

    # prefix caching off: every repeat must prefill the whole prompt again
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=256 << 20,
                                    num_threads=rank_threads(threads, tp), enable_prefix_caching=False,
                                    tp_size=tp),
                       progress=False)
    try:
        prefill, decode = _time_requests(engine, ids, decode_tokens, repeats)
    finally:
        engine.close()
    return Result("kvforge" if tp == 1 else f"kvforge tp {tp}", dtype, _median(prefill[1:]), _median(decode[1:]))


def _time_requests(engine, ids: list[int], decode_tokens: int, repeats: int) -> tuple[list[float], list[float]]:
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    prefill, decode = [], []
    for _ in range(repeats + 1):  # the first run warms up
        engine.add_request(ids, params)
        start = time.perf_counter()
        engine.step()  # the whole prompt fits one step: prefill + first token
        first = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        end = time.perf_counter()
        prefill.append(len(ids) / (first - start))
        decode.append((decode_tokens - 1) / (end - first))
    return prefill, decode


def bench_hf(path, dtype: str, ids: list[int], decode_tokens: int, repeats: int) -> Result:
    from transformers import AutoModelForCausalLM

    from kvforge.core.config import DTYPES

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    input_ids = torch.tensor([ids])

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        return time.perf_counter() - start

    prefill, decode = [], []
    for _ in range(repeats + 1):
        first = timed(1)
        full = timed(decode_tokens)
        prefill.append(len(ids) / first)
        decode.append((decode_tokens - 1) / max(full - first, 1e-9))
    return Result("HF transformers", dtype, _median(prefill[1:]), _median(decode[1:]))


def run_latency(args: argparse.Namespace) -> list[Result]:
    from kvforge.core.loader import resolve_model
    from kvforge.core.tokenizer import Tokenizer

    try:
        tp_counts = [int(n) for n in str(args.tp).split(",")]
    except ValueError:
        raise ValueError(f"--tp must be rank counts separated by commas, e.g. 1,2; got {args.tp!r}") from None
    if any(n < 1 for n in tp_counts):
        raise ValueError(f"--tp rank counts must be >= 1, got {args.tp!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    ids = prompt_ids(Tokenizer(path), args.prompt_tokens)
    print(f"model {path.name}; prompt {len(ids)} tokens; decode {args.decode_tokens} tokens at batch 1; "
          f"{torch.get_num_threads()} threads; median of {args.repeats} runs after a warm-up")
    results = []
    if not args.no_hf:
        results.append(bench_hf(path, "float32", ids, args.decode_tokens, args.repeats))
    for tp in tp_counts:
        for dtype in args.dtypes.split(","):
            results.append(bench_kvforge(str(path), dtype.strip(), ids, args.decode_tokens, args.repeats,
                                         args.threads, tp))
    baseline = results[0] if not args.no_hf else None
    print(f"{'engine':<16} {'dtype':<9} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'prefill vs HF fp32':>19} {'decode vs HF fp32':>18}")
    for r in results:
        ratios = ("", "") if baseline is None else (
            f"{r.prefill_tok_s / baseline.prefill_tok_s:.2f}x", f"{r.decode_tok_s / baseline.decode_tok_s:.2f}x")
        print(f"{r.engine:<16} {r.dtype:<9} {r.prefill_tok_s:>14.1f} {r.decode_tok_s:>13.1f} "
              f"{ratios[0]:>19} {ratios[1]:>18}")
    return results


# --- `kvforge bench throughput` ---------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of Australia?",
    "Explain in simple terms why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "How many legs does a spider have?",
    "Give me three tips for sleeping better.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into French.",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "Why do cats purr?",
    "What is 17 multiplied by 23? Show your working.",
    "Write a short, polite email asking my manager for a day off next Friday.",
    "List the planets of the solar system in order from the sun.",
    "What does HTTP stand for, and what is it used for?",
    "Describe the water cycle in a few sentences.",
    "Who wrote the play Romeo and Juliet?",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What are the main causes of inflation?",
    "Explain what a hash table is to a beginner programmer.",
    "Write a limerick about a programmer who loves coffee.",
    "What is photosynthesis?",
    "How do I reverse a string in JavaScript?",
    "What are some good exercises for lower back pain?",
    "Summarize the plot of Cinderella in three sentences.",
    "Why is it important to drink water during exercise?",
    "What is the boiling point of water at the top of a high mountain, and why is it different?",
    "Write a motivational sentence for someone starting a new job.",
    "Explain the rules of chess for the knight piece.",
    "What is the tallest mountain in Europe?",
    "Compare electric cars and petrol cars in terms of running costs.",
    "How does a refrigerator keep food cold?",
    "Write a SQL query that counts the orders per customer in a table called orders.",
    "What should I pack for a weekend hiking trip?",
]

PASSAGES = [
    "The town council met on Tuesday evening to discuss the new cycling lanes planned for the high street. "
    "Shop owners worried that removing parking spaces would keep customers away, while parents argued that "
    "safer routes would let more children cycle to school. The council agreed to run a six-month trial.",

    "Honeybees communicate the location of food through a behaviour called the waggle dance. A forager that "
    "has found a rich patch of flowers returns to the hive and runs in a figure-of-eight pattern on the "
    "vertical surface of the comb. The angle of the straight 'waggle' run relative to vertical tells the "
    "other bees the direction of the food relative to the sun, and the duration of the run encodes the "
    "distance. Bees that follow the dancer pick up the scent of the flowers from her body as well, which "
    "helps them recognise the right patch once they arrive. Researchers have decoded these dances to map "
    "where colonies forage across a whole landscape.",

    "Our quarterly results show revenue of 4.2 million euros, up 12 percent on the same quarter last year, "
    "driven mainly by the subscription business, which grew 31 percent. Hardware sales fell 8 percent as "
    "customers delayed upgrades ahead of the new product line. Operating costs rose 9 percent, largely "
    "because we hired fourteen engineers for the platform team and opened the Lisbon office. Cash on hand at "
    "the end of the quarter was 11.5 million euros. For the next quarter we expect subscription growth to "
    "slow slightly, hardware to recover once the new line ships in May, and costs to stay flat. The board "
    "has approved a budget for two more sales hires in the Nordic region, and we will review pricing for the "
    "entry-level plan before the summer.",

    "def merge_intervals(intervals):\n"
    "    intervals.sort(key=lambda pair: pair[0])\n"
    "    merged = []\n"
    "    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n",

    "The Industrial Revolution began in Britain in the late eighteenth century and spread to continental "
    "Europe and North America over the following decades. Several factors came together to make Britain the "
    "starting point: abundant deposits of coal and iron ore, a growing population that supplied both workers "
    "and customers, a stable political system that protected property and encouraged investment, and an "
    "overseas empire that provided raw materials such as cotton as well as markets for finished goods. The "
    "textile industry was the first to be transformed. Inventions such as the spinning jenny, the water frame "
    "and the power loom moved production out of homes and small workshops into large mills, first powered by "
    "water wheels and later by steam engines. James Watt's improvements to the steam engine made it far more "
    "efficient and allowed factories to be built away from rivers, close to coalfields and cities. Railways "
    "followed in the 1820s and 1830s, cutting the cost and time of moving goods and people and creating a "
    "national market. The social consequences were profound. Cities such as Manchester and Birmingham grew "
    "at a pace that housing and sanitation could not match, working hours in the mills were long, and child "
    "labour was common until a series of Factory Acts began to limit it. Over the longer term, however, "
    "productivity gains raised living standards, and the period laid the foundations of the modern economy.",

    "Dear support team, I bought the X200 wireless headphones from your online shop three weeks ago. Since "
    "last weekend the left ear cup cuts out every few minutes, even when the phone is right next to me and "
    "the battery is full. I have already tried resetting them and re-pairing them with two different phones. "
    "Could you tell me whether this is covered by the warranty and how to send them back?",
]

PASSAGE_TASKS = [
    "Summarize the following text in two sentences:\n\n{text}",
    "{text}\n\nWhat is the main point of the text above?",
    "Read this and list the three most important facts as bullet points:\n\n{text}",
    "{text}\n\nWrite a short, friendly reply or comment to the text above.",
    "Explain the following to a ten-year-old:\n\n{text}",
    "{text}\n\nSuggest a title for this text.",
]


def chat_messages(num_requests: int) -> list[list[dict]]:
    """Deterministic, varied chat requests: short questions and tasks on a pasted passage, shuffled
    with a fixed seed (the first few are then a fair sample of the lengths); cycles beyond the pool."""
    import random

    pool = list(QUESTIONS) + [task.format(text=p) for p in PASSAGES for task in PASSAGE_TASKS]
    random.Random(0).shuffle(pool)
    return [[{"role": "user", "content": pool[i % len(pool)]}] for i in range(num_requests)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _warm_ids(prompts: list[list[int]]) -> list[int]:
    return prompts[0][-8:]  # the tail of a prompt: no full block, so nothing lands in the prefix cache


def throughput_kvforge(model: str, dtype: str, prompts: list[list[int]], output_len: int, args) -> dict:
    from kvforge.core import LLMEngine
    from kvforge.core.config import EngineConfig

    tp = getattr(args, "tp", 1)
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
                                    max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    num_threads=rank_threads(args.threads, tp), tp_size=tp,
                                    enable_prefix_caching=not getattr(args, "no_prefix_caching", False)),
                       progress=False)
    try:
        return _throughput_run(engine, prompts, output_len)
    finally:
        engine.close()


def _throughput_run(engine, prompts: list[list[int]], output_len: int) -> dict:
    from kvforge.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(_warm_ids(prompts), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():  # warm-up, outside the measurement
        engine.step()
    before = engine.stats()

    finals = []
    start = time.perf_counter()
    for ids in prompts:
        engine.add_request(ids, params)
    while engine.has_unfinished():
        finals.extend(out for out in engine.step() if out.finished)
    wall = time.perf_counter() - start
    after = engine.stats()

    generated = sum(len(out.token_ids) for out in finals)
    prompt_tokens = sum(len(ids) for ids in prompts)
    ttft = [out.metrics["ttft"] for out in finals if out.metrics and out.metrics.get("ttft") is not None]
    tpot = [out.metrics["tpot"] for out in finals if out.metrics and out.metrics.get("tpot") is not None]
    new_prompt = after.prompt_tokens_total - before.prompt_tokens_total
    cached = after.cached_tokens_total - before.cached_tokens_total
    return {
        "requests_finished": len(finals),
        "generated_tokens": generated,
        "wall_s": wall,
        "output_tok_s": generated / wall,
        "total_tok_s": (prompt_tokens + generated) / wall,
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
        "prefix_cache_hit_rate": cached / new_prompt if new_prompt else 0.0,
        "cached_prompt_tokens": cached,
        "preemptions": after.preemptions_total - before.preemptions_total,
        "kv_cache_tokens": after.kv_blocks_total * engine.config.block_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
    }


def _hf_model(path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvforge.core.config import DTYPES

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model, pad


def _hf_generate(model, pad: int, batch: list[list[int]], output_len: int) -> int:
    """One greedy `generate` over a left-padded batch; returns the tokens it generated."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                             min_new_tokens=output_len, pad_token_id=pad)
    return (out.shape[1] - width) * len(batch)


def throughput_hf(path, dtype: str, prompts: list[list[int]], output_len: int, args) -> tuple[dict, dict]:
    model, pad = _hf_model(path, dtype)
    _hf_generate(model, pad, [_warm_ids(prompts)], 2)  # warm-up, outside the measurement

    seq_prompts = prompts[:args.hf_sequential_requests]
    generated, start = 0, time.perf_counter()
    for ids in seq_prompts:
        generated += _hf_generate(model, pad, [ids], output_len)
    elapsed = time.perf_counter() - start
    sequential = {"requests": len(seq_prompts), "prompt_tokens": sum(len(ids) for ids in seq_prompts),
                  "generated_tokens": generated, "time_s": elapsed, "output_tok_s": generated / elapsed}

    size = args.hf_batch_size
    batches = [prompts[i:i + size] for i in range(0, len(prompts), size)][:args.hf_batches]
    generated, padded, start = 0, 0, time.perf_counter()
    for batch in batches:
        generated += _hf_generate(model, pad, batch, output_len)
        padded += sum(max(len(ids) for ids in batch) - len(ids) for ids in batch)
    elapsed = time.perf_counter() - start
    static = {"batch_size": size, "batches": len(batches), "requests": sum(len(b) for b in batches),
              "prompt_tokens": sum(len(ids) for b in batches for ids in b), "padding_tokens": padded,
              "generated_tokens": generated, "time_s": elapsed, "output_tok_s": generated / elapsed}
    return sequential, static


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def _print_throughput(r: dict) -> None:
    p, k = r["prompt_tokens"], r["kvforge"]
    ranks = f"; kvforge on {r['tp']} tensor-parallel ranks" if r.get("tp", 1) > 1 else ""
    print(f"model {r['model']}; dtype {r['dtype']}; {r['threads']} threads{ranks}")
    print(f"requests          {r['num_requests']} chat prompts, all submitted at once; "
          f"{r['output_len']} output tokens each (greedy, ignore_eos)")
    print(f"prompt tokens     total {p['total']}, mean {p['mean']:.1f}, min {p['min']}, max {p['max']}")
    print(f"kvforge           max_num_seqs {k['max_num_seqs']}, max_num_batched_tokens "
          f"{k['max_num_batched_tokens']}, KV cache {k['kv_cache_tokens']} tokens")
    print(f"  wall time       {k['wall_s']:.2f} s ({k['requests_finished']} requests, "
          f"{k['generated_tokens']} tokens generated)")
    print(f"  output tok/s    {k['output_tok_s']:.1f}")
    print(f"  total tok/s     {k['total_tok_s']:.1f} (prompt + output)")
    print(f"  TTFT            p50 {_ms(k['ttft_s']['p50'])}, p99 {_ms(k['ttft_s']['p99'])}")
    print(f"  TPOT            p50 {_ms(k['tpot_s']['p50'])}, p99 {_ms(k['tpot_s']['p99'])}")
    print(f"  prefix cache    hit rate {k['prefix_cache_hit_rate']:.1%} ({k['cached_prompt_tokens']} of "
          f"{p['total']} prompt tokens)")
    print(f"  preemptions     {k['preemptions']}")
    seq, static, ratios = r["hf_sequential"], r["hf_static_batch"], r["ratios"]
    if seq is None:
        return
    print(f"HF sequential     {seq['output_tok_s']:.1f} output tok/s ({seq['requests']} requests one at a time, "
          f"{seq['prompt_tokens']} prompt tokens, {seq['generated_tokens']} generated, {seq['time_s']:.2f} s)")
    print(f"HF static batch   {static['output_tok_s']:.1f} output tok/s ({static['batches']} batches of "
          f"<= {static['batch_size']}, {static['requests']} requests, left padding {static['padding_tokens']} "
          f"tokens, {static['generated_tokens']} generated, {static['time_s']:.2f} s)")
    print(f"kvforge / HF sequential     {ratios['kvforge_vs_hf_sequential']:.2f}x")
    print(f"kvforge / HF static batch   {ratios['kvforge_vs_hf_static_batch']:.2f}x")


def checked_model(args: argparse.Namespace, positive: tuple[str, ...]) -> Path:
    """Fail on bad bench arguments before anything loads: each option in `positive` must be >= 1, the
    dtype must exist. Returns the resolved model path."""
    from kvforge.core.config import EngineConfig
    from kvforge.core.loader import resolve_model

    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    EngineConfig(dtype=args.dtype)
    return resolve_model(args.model)


def run_throughput(args: argparse.Namespace) -> dict:
    import json

    from kvforge.core.tokenizer import Tokenizer

    if args.hf_batches is not None and args.hf_batches < 1:
        raise ValueError(f"--hf-batches must be >= 1, got {args.hf_batches}")
    path = checked_model(args, ("num_requests", "output_len", "hf_sequential_requests", "hf_batch_size"))
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer(path)
    prompts = [tokenizer.apply_chat_template(m) for m in chat_messages(args.num_requests)]
    lengths = [len(ids) for ids in prompts]
    result = {
        "model": path.name, "dtype": args.dtype, "threads": torch.get_num_threads(), "tp": args.tp,
        "num_requests": len(prompts), "output_len": args.output_len,
        "prompt_tokens": {"total": sum(lengths), "mean": sum(lengths) / len(lengths),
                          "min": min(lengths), "max": max(lengths)},
        "kvforge": throughput_kvforge(str(path), args.dtype, prompts, args.output_len, args),
        "hf_sequential": None, "hf_static_batch": None, "ratios": None,
    }
    if not args.no_hf:
        sequential, static = throughput_hf(path, args.dtype, prompts, args.output_len, args)
        ours = result["kvforge"]["output_tok_s"]
        result |= {"hf_sequential": sequential, "hf_static_batch": static,
                   "ratios": {"kvforge_vs_hf_sequential": ours / sequential["output_tok_s"],
                              "kvforge_vs_hf_static_batch": ours / static["output_tok_s"]}}
    if args.json:
        print(json.dumps(result))
    else:
        _print_throughput(result)
    return result
