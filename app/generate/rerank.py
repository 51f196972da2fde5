"""Reranking with a decoder reranker (Qwen3-Reranker and the checkpoints trained on its format): each document is a
prompt that asks the model whether it meets the query, and its relevance is the model's probability of "yes" against
"no" after it -- the model card's own scoring, computed in one prefill per document (a scoring request,
core/pooling.py: the two logits after the last position). The documents share the prompt's head (the instruction and
the query), which the prefix cache holds after the first; they run as one group, a window at a time
(app/generate/embeddings.py's embed_windowed), under one admission ticket.

A model is taken for a reranker by its name (served name or models-directory entry containing "reranker", as these
checkpoints are published); any other is refused with a 400 naming `model`, and so is one whose tokenizer lacks
single "yes" and "no" tokens. Cross-encoders (BERT / XLM-R sequence classifiers such as bge-reranker) are not an
architecture kvforge runs: loading one fails with the loader's error."""

from __future__ import annotations

import math
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from kvforge.app.generate.admission import Admission
from kvforge.app.generate.embeddings import embed_windowed
from kvforge.app.generate.request import check_prompt_chars
from kvforge.app.generate.stream import RequestTimedOut
from kvforge.app.http.errors import APIError
from kvforge.core.async_engine import AsyncEngine
from kvforge.core.pooling import PoolingParams
from kvforge.core.scheduler import RequestRejected

# Qwen3-Reranker's prompt, as its model card writes it
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PROMPT_HEAD = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
               'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
PROMPT_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_prompt(instruction: str, query: str, document: str) -> str:
    return f"{PROMPT_HEAD}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{PROMPT_TAIL}"


@dataclass
class Ranked:
    """Each document's relevance in [0, 1], in the documents' order, and the prompt tokens read."""

    scores: list[float]
    prompt_tokens: int
    model: str


def is_reranker(name: str) -> bool:
    return "reranker" in name.lower()


def answer_tokens(engine: AsyncEngine, model: str) -> tuple[int, int]:
    """The ids of "no" and "yes", each one token; APIError 400 naming `model` for a model that is no reranker."""
    if not is_reranker(model):
        raise APIError(400, f"model: {model!r} is not a reranker (a Qwen3-Reranker-style checkpoint, whose name "
                       "says reranker)", "model")
    ids = [engine.tokenizer.encode(word, add_special_tokens=False) for word in ("no", "yes")]
    if any(len(i) != 1 for i in ids):
        raise APIError(400, f"model: {model!r} has no single yes / no tokens to score with", "model")
    return ids[0][0], ids[1][0]


def tokenize_documents(engine: AsyncEngine, instruction: str, query: str, documents: list[str]) -> list[list[int]]:
    """Each document's prompt ids; APIError 400 naming `documents[i]` for one that cannot fit the context."""
    prompts = []
    for i, document in enumerate(documents):
        where = f"documents[{i}]"
        text = reranker_prompt(instruction, query, document)
        check_prompt_chars(engine, len(text), where)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        try:
            engine.engine.validate_prompt(ids, PoolingParams())
        except RequestRejected as exc:
            raise APIError(400, f"{where}: {exc}", "documents", code="context_length_exceeded") from None
        prompts.append(ids)
    return prompts


async def rerank(admission: Admission, query: str, documents: list[str], instruction: str | None,
                 timeout_s: float | None, model: str | None = None) -> Ranked:
    """Every document's relevance to `query` (the probability of "yes"), by the reranker `model` (None: the server's
    own), loaded on demand; aborted (blocks freed) if the client leaves or `timeout_s` passes (APIError 504)."""
    ticket = await admission.enter(model)
    try:
        engine = ticket.engine
        no, yes = answer_tokens(engine, ticket.model)
        prompts = await run_in_threadpool(tokenize_documents, engine, instruction or DEFAULT_INSTRUCTION, query,
                                          documents)
        outputs = await embed_windowed(engine, prompts, timeout_s, PoolingParams(score_token_ids=(no, yes)))
    except RequestTimedOut as exc:
        raise exc.api_error() from None
    finally:
        ticket.release()
    scores = [1 / (1 + math.exp(no_logit - yes_logit)) for no_logit, yes_logit in (out.embedding for out in outputs)]
    return Ranked(scores, sum(len(p) for p in prompts), ticket.model)
