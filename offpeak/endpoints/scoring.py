"""What ``/v1/score`` and ``/v1/rerank`` share: their text inputs, tokenized one embedding each,
and the score of a pair as vLLM's bi-encoder scoring computes it, the cosine similarity of the
two texts' embeddings (``vllm.entrypoints.pooling.scoring.io_processor.BiEncoderIOProcessor``).

A scoring line is a pooling line: the embedding engine embeds each distinct text once (a query
scored against N documents is embedded once, as vLLM does) and the line's record keeps the
vectors, from which the output body's scores are computed when it is rendered.
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from typing import Any

from offpeak.endpoints.base import LineError, Tokenizer
from offpeak.endpoints.embeddings import pooling_size
from offpeak.endpoints.errors import fail

#: Most texts one line embeds (queries and documents together): the embeddings endpoint's
#: limit of inputs per line, which bounds a line's vectors in the same way.
MAX_TEXTS = 2048


def texts(value: Any, param: str) -> list[str]:
    """A score input (vLLM's ``ScoreInput``: a string, or a list of them) as a list of strings.
    vLLM's multimodal inputs (``{"content": [parts]}``) are refused: the embedding model reads
    text only."""
    items = [value] if isinstance(value, str | dict) else value
    if not isinstance(items, list):
        raise fail(
            "invalid_type",
            f"Invalid type for '{param}': expected a string or an array of strings.",
            param,
        )
    if not items:
        raise fail("invalid_value", f"Invalid '{param}': the array must not be empty.", param)
    for i, item in enumerate(items):
        where = param if isinstance(value, str | dict) else f"{param}[{i}]"
        if isinstance(item, dict):
            raise fail(
                "unsupported_value",
                f"Invalid '{where}': only text inputs are supported by this model, not "
                "multimodal content.",
                where,
            )
        if not isinstance(item, str):
            raise fail("invalid_type", f"Invalid type for '{where}': expected a string.", where)
    return items


def check_model(tokenizer: Tokenizer, model: str, url: str) -> None:
    """Raises ``LineError`` (``model``) unless the engine embeds (``pooling_size``)."""
    if pooling_size(tokenizer) is None:
        raise LineError(
            f"The model {model!r} does not serve {url}; use an embedding model.",
            "model",
            "invalid_value",
        )


def encode(
    tokenizer: Tokenizer, items: list[str], param: str, single: bool
) -> list[tuple[int, ...]]:
    """Each text's token ids (with the tokenizer's specials, as an embeddings line's). Raises
    ``LineError`` (``context_length_exceeded``, naming ``param`` or ``param[i]``; ``single``: the
    field was one string) for a text over the context window: truncating would score another
    text than the one sent."""
    limit = tokenizer.max_model_len
    out = []
    for i, text in enumerate(items):
        ids = tokenizer.encode_text(text)
        if len(ids) > limit:
            where = param if single else f"{param}[{i}]"
            raise LineError(
                f"This model's maximum context length is {limit} tokens, however you requested "
                f"{len(ids)} tokens in {where}. Please reduce the length of the input.",
                where,
                "context_length_exceeded",
            )
        out.append(tuple(ids))
    return out


def check_count(count: int) -> None:
    """Raises ``LineError`` for a line of more than ``MAX_TEXTS`` texts."""
    if count > MAX_TEXTS:
        raise LineError(
            f"{count:,} texts to embed in one request; at most {MAX_TEXTS:,}. Split the "
            "documents over several lines.",
            None,
            "invalid_value",
        )


def cosine(first: str, second: str) -> float:
    """The cosine similarity of two stored vectors (base64 little-endian float32, as a
    record's ``embeddings``), computed in float64; 0.0 when either is all zeros."""
    a, b = _values(first), _values(second)
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _values(vector: str) -> array[float]:
    values = array("f", base64.b64decode(vector))
    if sys.byteorder == "big":
        values.byteswap()
    return values
