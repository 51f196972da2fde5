"""POST /v1/rerank (also /rerank, llama.cpp server's path, and /v2/rerank, Cohere's v2 and vLLM's): a query and
documents -> each document's relevance, most relevant first, as Jina's, Cohere's and vLLM's APIs answer:

    {"model", "query", "documents": ["...", {"text": "..."}], "top_n", "return_documents", "instruction"}
    -> {"id", "model", "results": [{"index", "relevance_score", "document": {"text"}}], "usage": {...}}

The scoring is app/generate/rerank.py's (a decoder reranker's probability of "yes"). `instruction` is our extra (the
reranker's task description; the model card's web-search one by default). Cohere's `max_chunks_per_doc` and
`rank_fields` are refused: documents are not chunked and have no fields here. Ollama has no rerank route to mirror."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.fields import FORBID, MAX_RERANK_DOCUMENTS
from kvforge.app.generate.rerank import rerank


class TextDocument(BaseModel):
    model_config = FORBID
    text: str


class RerankRequest(BaseModel):
    model_config = FORBID
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | TextDocument] = Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    instruction: str | None = Field(default=None, min_length=1)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


def rerank_router(context: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/rerank")
    @router.post("/rerank")
    @router.post("/v2/rerank")
    async def rerank_documents(body: RerankRequest) -> dict[str, Any]:
        context.admission.check_model(body.model)
        texts = body.texts()
        ranked = await rerank(context.admission, body.query, texts, body.instruction, context.request_timeout_s,
                              body.model)
        order = sorted(range(len(texts)), key=lambda i: -ranked.scores[i])[:body.top_n]
        results = [{"index": i, "relevance_score": ranked.scores[i]} | (
            {"document": {"text": texts[i]}} if body.return_documents else {}) for i in order]
        usage = {"prompt_tokens": ranked.prompt_tokens, "total_tokens": ranked.prompt_tokens}
        return {"id": "rerank-" + uuid.uuid4().hex[:24], "object": "list", "model": ranked.model, "results": results,
                "usage": usage}

    return router
