"""``/v1/score``: the body (``ScoreRequest``), its engine input (each text's token ids, embedded
once each) and the ``list`` of ``score`` objects.

Shapes follow vLLM's score API as ``vllm run-batch`` takes it (vLLM 0.32,
``vllm/entrypoints/pooling/scoring/protocol.py``): two inputs, each a string or a list of
strings, named ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2`` or
``text_1``/``text_2`` (the first complete pair in that order is used); their lengths are 1:1,
1:N (the one query scored against each document) or N:N (pairwise), and the output has one
score per pair, in order. The body is vLLM's ``ScoreResponse``: ``{id, object: "list", created,
model, data: [{index, object: "score", score}], usage}``.

On an embedding model (all-MiniLM-L6-v2) a score is the cosine similarity of the two texts'
embeddings, as vLLM's bi-encoder scoring computes it (``offpeak.endpoints.scoring``). Where this
server differs: a text over the context window fails its line (``context_length_exceeded``)
rather than being truncated, and vLLM's truncation and chat-template parameters
(``truncate_prompt_tokens``, ``max_tokens_per_query``, ``max_tokens_per_doc``, ``instruction``,
``chat_template_kwargs``) are 400 lines when set: they change what is scored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, PrivateAttr, ValidationInfo, field_validator, model_validator

from offpeak.endpoints import fields, scoring
from offpeak.endpoints.base import Endpoint, EngineInput, PoolingSpec, Tokenizer
from offpeak.endpoints.embeddings import NO_SAMPLING
from offpeak.endpoints.errors import fail
from offpeak.endpoints.records import Answer

URL = "/v1/score"
#: The names of the two inputs, in the order vLLM's ``ScoreRequest`` union tries them.
PAIRS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
#: vLLM's truncation and chat-template parameters, refused when set (see the module).
UNSUPPORTED = (
    "truncate_prompt_tokens",
    "max_tokens_per_query",
    "max_tokens_per_doc",
    "instruction",
    "chat_template_kwargs",
)


class ScoreRequest(BaseModel):
    """A ``/v1/score`` body: ``model``, and one pair of inputs (``PAIRS``)."""

    model_config = fields.BODY_CONFIG

    model: str
    truncate_prompt_tokens: Any = None
    max_tokens_per_query: Any = None
    max_tokens_per_doc: Any = None
    instruction: Any = None
    chat_template_kwargs: Any = None
    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    text_1: Any = None
    text_2: Any = None
    #: The pair used: (first name, its texts, second name, its texts), set once validated.
    _pair: tuple[str, list[str], str, list[str]] = PrivateAttr()

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return fields.unsupported(value, info)

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = {name for pair in PAIRS for name in pair if getattr(self, name) is not None}
        pair = next((p for p in PAIRS if set(p) <= given), None)
        if pair is None:
            half = next((p for p in PAIRS if set(p) & given), PAIRS[-1])
            missing = next((name for name in half if name not in given), half[0])
            raise fail(
                "missing_required_parameter",
                f"'{missing}' is required: a score request takes two inputs, "
                f"{' / '.join('/'.join(p) for p in PAIRS)}.",
                missing,
            )
        first, second = pair
        texts_1 = scoring.texts(getattr(self, first), first)
        texts_2 = scoring.texts(getattr(self, second), second)
        if len(texts_1) > 1 and len(texts_1) != len(texts_2):
            # vLLM's wording (``_validate_score_input_lens``).
            raise fail(
                "invalid_value",
                f"Input lengths must be either 1:1, 1:N or N:N ('{first}' has "
                f"{len(texts_1)}, '{second}' {len(texts_2)}).",
                first,
            )
        self._pair = (first, texts_1, second, texts_2)
        return self

    @property
    def pair(self) -> tuple[str, list[str], str, list[str]]:
        """(first input's name, its texts, second input's name, its texts)."""
        return self._pair


class Score(Endpoint[ScoreRequest]):
    url = URL
    body_model = ScoreRequest
    # The inputs have four names: a line without a pair fails alone.
    required_fields = ()
    response_id_prefix = "score-"

    def engine_input(self, body: ScoreRequest, tokenizer: Tokenizer) -> EngineInput:
        """The token ids of the first input's texts, then the second's. Raises ``LineError``
        for a model that does not embed or a text over its context window."""
        scoring.check_model(tokenizer, body.model, URL)
        first, texts_1, second, texts_2 = body.pair
        scoring.check_count(len(texts_1) + len(texts_2))
        inputs = [
            *scoring.encode(tokenizer, texts_1, first, isinstance(getattr(body, first), str)),
            *scoring.encode(tokenizer, texts_2, second, isinstance(getattr(body, second), str)),
        ]
        return EngineInput(
            list(inputs[0]),
            NO_SAMPLING,
            echo={"queries": len(texts_1)},
            pooling=PoolingSpec(tuple(inputs)),
        )

    def engine_needs(self, engine_input: EngineInput) -> tuple[tuple[int, int], ...]:
        """One sequence per text, generating nothing."""
        assert engine_input.pooling is not None
        return tuple((len(ids), 0) for ids in engine_input.pooling.inputs)

    def render(self, answer: Answer) -> dict[str, Any]:
        """vLLM's ``ScoreResponse``: one ``{index, object: "score", score}`` per pair, in
        order; ``usage`` counts every text embedded once."""
        return {
            "id": answer.response_id,
            "object": "list",
            "created": answer.created,
            "model": answer.model,
            "data": [
                {"index": i, "object": "score", "score": score}
                for i, score in enumerate(pair_scores(answer))
            ],
            "usage": {
                "prompt_tokens": answer.prompt_tokens,
                "total_tokens": answer.prompt_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }


def pair_scores(answer: Answer) -> list[float]:
    """The score of each pair of a scoring line's record: its first ``echo["queries"]`` vectors
    are the first input's, the rest the second's; one query is scored against each of the
    rest, N queries each against its own."""
    vectors = answer.embeddings or []
    queries = int((answer.echo or {}).get("queries", 1))
    firsts, seconds = vectors[:queries], vectors[queries:]
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    return [scoring.cosine(a, b) for a, b in zip(firsts, seconds, strict=True)]
