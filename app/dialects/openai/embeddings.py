"""OpenAI's embeddings API: POST /v1/embeddings {"model", "input", "encoding_format", "dimensions"} ->
{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}. The served model
embeds (app/generate/embeddings.py: mean-pooled, L2-normalised last hidden states); "base64" is the float32 vector's
little-endian bytes, what the openai SDK asks for by default."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter
from pydantic import BaseModel, Field

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.fields import FORBID, MAX_EMBEDDING_INPUTS
from kvforge.app.dialects.openai.protocol import TokenId
from kvforge.app.generate.embeddings import embed


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: one text or a batch (texts, or token-id lists), embedded by the served model."""

    model_config = FORBID
    model: str | None = None
    input: str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | Annotated[
        list[TokenId], Field(min_length=1)] | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # accepted when it is the model's size: shortening is not supported
    user: str | None = None  # metadata

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a batch: one text, or one token-id list, is a batch of one."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return self.input



def embeddings_router(context: ServerContext) -> APIRouter:
    admission, request_timeout_s = context.admission, context.request_timeout_s
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict:
        admission.check_model(body.model)
        result = await embed(admission, body.inputs(), "input", request_timeout_s, dimensions=body.dimensions,
                             model=body.model)
        data = [{"object": "embedding", "index": i, "embedding": encoded(vector, body.encoding_format)}
                for i, vector in enumerate(result.embeddings)]
        tokens = result.prompt_tokens
        return {"object": "list", "data": data, "model": result.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return router


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
