"""``/v1/embeddings``: the body (``EmbeddingRequest``), its engine input (each input's token ids,
pooled one vector each) and the ``list`` of ``embedding`` objects.

Shapes and limits follow OpenAI's API reference (Embeddings, "Create embeddings"): ``input`` is a
string, an array of strings, an array of token ids or an array of arrays of token ids, at most
2,048 inputs, none empty; ``encoding_format`` is ``float`` or ``base64`` (the little-endian
float32 bytes of each vector, base64-encoded, as OpenAI's SDK decodes them); ``dimensions`` is
honoured only by a model trained for shorter vectors (Matryoshka), and is a 400 line otherwise.

Where this server differs, and why:

- An input longer than the model's context window (all-MiniLM-L6-v2: 256 tokens, the length it
  was trained at and ``sentence-transformers`` truncates to) fails its line with
  ``context_length_exceeded``, naming the limit, as OpenAI's endpoint refuses an input over
  8,192 tokens. Truncating silently would embed a different text than the one sent.
- Token-id inputs are the served model's own vocabulary (OpenAI's are ``cl100k_base``), taken as
  they are: a BERT-style model expects its ``[CLS]`` … ``[SEP]`` ids around them, which a string
  input gets from the tokenizer.

Vectors are stored in the line's record as base64 float32 (``Answer.embeddings``), so a
``float`` line is rendered from exactly the values a ``base64`` line carries.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field
from pydantic_core import ErrorDetails

from offpeak.endpoints import fields
from offpeak.endpoints.base import (
    Endpoint,
    EngineInput,
    LineError,
    PoolingSpec,
    SamplingSpec,
    Tokenizer,
)
from offpeak.endpoints.errors import fail
from offpeak.endpoints.records import Answer

URL = "/v1/embeddings"
#: Most inputs in one request (OpenAI's limit for an embeddings request).
MAX_INPUTS = 2048
#: Nothing is generated: the engine pools the prompt's hidden states instead.
NO_SAMPLING = SamplingSpec(max_tokens=0)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_token(t) for t in value)


def _inputs(value: Any) -> list[str | list[int]]:
    """``input`` as a list of inputs, each a non-empty string or non-empty token ids."""
    if value == "":
        raise fail("invalid_value", "Invalid 'input': empty string.", "input")
    if isinstance(value, str) or _token_ids(value):
        value = [value]
    if not isinstance(value, list):
        raise fail(
            "invalid_type",
            "Invalid type for 'input': expected a string, an array of strings, an array of "
            "token ids or an array of arrays of token ids.",
            "input",
        )
    if not value:
        raise fail("invalid_value", "Invalid 'input': the array must not be empty.", "input")
    if len(value) > MAX_INPUTS:
        raise fail(
            "invalid_value",
            f"Invalid 'input': {len(value):,} inputs; at most {MAX_INPUTS:,} in one request.",
            "input",
        )
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise fail("invalid_value", f"Invalid 'input[{i}]': empty string.", f"input[{i}]")
        elif not _token_ids(item):
            raise fail(
                "invalid_value",
                f"Invalid 'input[{i}]': expected a non-empty string or a non-empty array of "
                "token ids (integers, 0 or more).",
                f"input[{i}]",
            )
    # Strings and token ids may not be mixed in OpenAI's schema; both are unambiguous here.
    return value


class EmbeddingRequest(BaseModel):
    """A ``/v1/embeddings`` body. A line with several problems reports the first in field
    order."""

    model_config = fields.BODY_CONFIG

    model: str
    input: Annotated[list[str | list[int]], BeforeValidator(_inputs)] = Field(
        None, validate_default=True
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class Embeddings(Endpoint[EmbeddingRequest]):
    url = URL
    body_model = EmbeddingRequest
    required_fields = ("input",)
    # The body has no id; the record's is unused.
    response_id_prefix = "emb-"

    def line_error(self, error: ErrorDetails) -> LineError:
        if error["loc"] == ("encoding_format",):
            return LineError(
                "Invalid 'encoding_format': use 'float' or 'base64'.",
                "encoding_format",
                "invalid_value",
            )
        return super().line_error(error)

    def engine_input(self, body: EmbeddingRequest, tokenizer: Tokenizer) -> EngineInput:
        """Each input's token ids. Raises ``LineError`` for a model that does not embed, a
        ``dimensions`` it cannot honour, or an input over its context window."""
        size = pooling_size(tokenizer)
        if size is None:
            raise LineError(
                f"The model {body.model!r} does not serve {URL}; use an embedding model.",
                "model",
                "invalid_value",
            )
        if body.dimensions is not None and not _dimensions_ok(tokenizer, body.dimensions, size):
            raise LineError(
                f"This model does not support specifying dimensions of {body.dimensions} (its "
                f"vectors have {size}).",
                "dimensions",
                "unsupported_value",
            )
        limit = tokenizer.max_model_len
        inputs: list[tuple[int, ...]] = []
        for i, item in enumerate(body.input):
            ids = tokenizer.encode_text(item) if isinstance(item, str) else item
            if len(ids) > limit:
                param = "input" if len(body.input) == 1 else f"input[{i}]"
                raise LineError(
                    f"This model's maximum context length is {limit} tokens, however you "
                    f"requested {len(ids)} tokens in {param}. Please reduce the length of the "
                    "input.",
                    param,
                    "context_length_exceeded",
                )
            inputs.append(tuple(ids))
        return EngineInput(
            list(inputs[0]),
            NO_SAMPLING,
            echo={"encoding_format": body.encoding_format},
            pooling=PoolingSpec(tuple(inputs), body.dimensions),
        )

    def engine_needs(self, engine_input: EngineInput) -> tuple[tuple[int, int], ...]:
        """One sequence per input, generating nothing."""
        assert engine_input.pooling is not None
        return tuple((len(ids), 0) for ids in engine_input.pooling.inputs)

    def render(self, answer: Answer) -> dict[str, Any]:
        """OpenAI's ``CreateEmbeddingResponse``: ``{object: "list", data: [{object:
        "embedding", index, embedding}], model, usage: {prompt_tokens, total_tokens}}``;
        ``embedding`` is a list of floats, or a base64 string for ``encoding_format=base64``."""
        as_base64 = (answer.echo or {}).get("encoding_format") == "base64"
        vectors = answer.embeddings or []
        return {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": vector if as_base64 else floats(vector),
                }
                for i, vector in enumerate(vectors)
            ],
            "model": answer.model,
            "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
        }


def pooling_size(tokenizer: Tokenizer) -> int | None:
    """The vector size of an engine that pools (``embedding_size``, which only pooling engines
    have: ``workers.engine.vllm_pooling``); ``None`` for a text-generation engine."""
    size = getattr(tokenizer, "embedding_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _dimensions_ok(tokenizer: Tokenizer, dimensions: int, size: int) -> bool:
    """Whether the engine can shorten its vectors to ``dimensions``: its
    ``matryoshka_dimensions`` is ``None`` for a model not trained for it (all-MiniLM-L6-v2),
    an empty tuple for any size up to its own, or the sizes it was trained for."""
    shorter = getattr(tokenizer, "matryoshka_dimensions", None)
    if shorter is None or dimensions > size:
        return False
    return not shorter or dimensions in shorter


def encode_vector(vector: bytes) -> str:
    """``vector`` (little-endian float32 bytes) as OpenAI's base64 ``embedding``."""
    return base64.b64encode(vector).decode("ascii")


def floats(vector: str) -> list[float]:
    """A base64 little-endian float32 vector as floats (each a float32 value, widened)."""
    values = array("f", base64.b64decode(vector))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
