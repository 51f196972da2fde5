"""What the multi-process tests (tests/core/test_tp.py, tests/core/test_pp.py) run on every layout: the same chat
prompts, greedy, on an engine of that layout compared with one process's tokens."""

from __future__ import annotations

from pathlib import Path

from kvforge.core import LLM, SamplingParams

NEW_TOKENS = 12  # enough decode steps (and speculative verifications) to compare the layouts over
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Give me three tips for learning to code.",
         "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden."]


def chat_prompts_of(path: Path) -> list[list[int]]:
    """CHATS as the model's chat template renders them."""
    from kvforge.core.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


def greedy_rounds(path, prompts, rounds: int = 1, embeddings: list | None = None,
                  **config) -> tuple[list[list[list[int]]], object]:
    """Greedy tokens of `prompts` for each round, and the engine's final stats; the engine is closed. fp32 unless
    `config` says otherwise: several processes' tokens must equal one's exactly, whatever kernels each runs.
    `embeddings`: a list the prompts' embeddings are added to."""
    llm = LLM(str(path), progress=False, kv_cache_bytes=64 << 20, **{"dtype": "float32", **config})
    try:
        results = [[o.token_ids for o in llm.generate(prompts, GREEDY)] for _ in range(rounds)]
        if embeddings is not None:
            embeddings.extend(llm.embed(prompts))
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0
        return results, stats
    finally:
        llm.engine.close()
