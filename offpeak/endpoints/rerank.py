"""``/v1/rerank``: the body (``RerankRequest``), its engine input (the query and each document,
embedded once each) and the ranked ``results``.

Shapes follow vLLM's rerank API as ``vllm run-batch`` takes it (vLLM 0.32,
``vllm/entrypoints/pooling/scoring/protocol.py``, ``RerankRequest`` / ``RerankResponse``):
``query`` a string, ``documents`` a string or a list of strings, ``top_n`` (0, the default: all
documents) the most results returned. The body is ``{id, model, usage: {prompt_tokens,
total_tokens}, results: [{index, document: {text}, relevance_score}]}``, results by relevance,
highest first (equal scores keep the documents' order), ``index`` the document's place in
``documents``. ``return_documents`` (Cohere's and Jina's rerank parameter, not vLLM's; default
``true``, which is what vLLM always does): ``false`` leaves ``document`` out of each result.

A relevance score is what ``/v1/score`` gives the same pair (``offpeak.endpoints.score``): on
an embedding model the cosine similarity of the query's and the document's embeddings. vLLM's
truncation and chat-template parameters are refused as there.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
)

from offpeak.endpoints import fields, scoring
from offpeak.endpoints.base import Endpoint, EngineInput, PoolingSpec, Tokenizer
from offpeak.endpoints.embeddings import NO_SAMPLING
from offpeak.endpoints.errors import fail
from offpeak.endpoints.records import Answer
from offpeak.endpoints.score import UNSUPPORTED

URL = "/v1/rerank"


def _query(value: Any) -> Any:
    if isinstance(value, dict):
        raise fail(
            "unsupported_value",
            "Invalid 'query': only text inputs are supported by this model, not multimodal "
            "content.",
            "query",
        )
    return value


def _documents(value: Any) -> list[str]:
    return scoring.texts(value, "documents")


class RerankRequest(BaseModel):
    """A ``/v1/rerank`` body. A line with several problems reports the first in field order."""

    model_config = fields.BODY_CONFIG

    model: str
    truncate_prompt_tokens: Any = None
    max_tokens_per_query: Any = None
    max_tokens_per_doc: Any = None
    instruction: Any = None
    chat_template_kwargs: Any = None
    query: Annotated[str, BeforeValidator(_query)]
    documents: Annotated[list[str], BeforeValidator(_documents)]
    top_n: int = Field(0, ge=0)
    return_documents: bool = True

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return fields.unsupported(value, info)


class Rerank(Endpoint[RerankRequest]):
    url = URL
    body_model = RerankRequest
    required_fields = ("query", "documents")
    response_id_prefix = "rerank-"

    def engine_input(self, body: RerankRequest, tokenizer: Tokenizer) -> EngineInput:
        """The query's token ids, then each document's. Raises ``LineError`` for a model that
        does not embed or a text over its context window."""
        scoring.check_model(tokenizer, body.model, URL)
        scoring.check_count(1 + len(body.documents))
        inputs = scoring.encode(tokenizer, [body.query], "query", True) + scoring.encode(
            tokenizer, body.documents, "documents", False
        )
        echo: dict[str, Any] = {"top_n": body.top_n}
        if body.return_documents:
            echo["documents"] = body.documents
        return EngineInput(
            list(inputs[0]), NO_SAMPLING, echo=echo, pooling=PoolingSpec(tuple(inputs))
        )

    def engine_needs(self, engine_input: EngineInput) -> tuple[tuple[int, int], ...]:
        """One sequence per text, generating nothing."""
        assert engine_input.pooling is not None
        return tuple((len(ids), 0) for ids in engine_input.pooling.inputs)

    def render(self, answer: Answer) -> dict[str, Any]:
        """vLLM's ``RerankResponse``: the documents by relevance, at most ``top_n``."""
        echo = answer.echo or {}
        vectors = answer.embeddings or []
        query, rest = vectors[0], vectors[1:]
        documents: list[str] | None = echo.get("documents")
        results = []
        for i, vector in enumerate(rest):
            result: dict[str, Any] = {"index": i}
            if documents is not None:
                result["document"] = {"text": documents[i]}
            result["relevance_score"] = scoring.cosine(query, vector)
            results.append(result)
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        top_n = int(echo.get("top_n") or 0)
        return {
            "id": answer.response_id,
            "model": answer.model,
            "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
            "results": results[:top_n] if top_n else results,
        }
