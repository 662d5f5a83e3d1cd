"""A request line's enqueued tokens, the unit of the enqueued-token quota: its prompt tokens
plus the output it asks for, counted while validation reads the file.

The prompt is counted as the line's UTF-8 bytes / 4, rounded up (OpenAI's rule of thumb of
about four characters per token for English text), not with the model's tokenizer: counting
50,000 chat lines with it takes tens of seconds (``workers.estimate``), and the quota must be
decided before the batch starts. The JSON around the prompt is counted too, so the figure is
on the high side of what the model's tokenizer finds. The requested output is ``n`` ×
(``max_completion_tokens``, ``max_tokens`` or ``max_output_tokens``, whichever the body sets
first) or, unset, the endpoint's default: what the context window leaves after the prompt
(chat, responses, messages), 16 (``/v1/completions``, OpenAI's default) or none (embeddings,
score, rerank).
"""

from __future__ import annotations

from typing import Any

from offpeak.endpoints import completions, embeddings, rerank, score

#: Bytes of a line counted as one prompt token.
BYTES_PER_TOKEN = 4
#: Body fields naming the most output tokens of one completion, the first one set wins.
OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
#: Output per completion of a line that sets none, where it is not the context's remainder.
DEFAULT_OUTPUT = {
    completions.Completions.url: completions.DEFAULT_MAX_TOKENS,
    embeddings.URL: 0,
    score.URL: 0,
    rerank.URL: 0,
}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def line_tokens(endpoint: str, body: dict[str, Any], line_bytes: int, max_model_len: int) -> int:
    """Enqueued tokens of one request line on ``endpoint`` whose JSON is ``line_bytes`` long."""
    prompt = -(-line_bytes // BYTES_PER_TOKEN)
    completions_asked = _positive_int(body.get("n")) or 1
    asked = next(
        (v for v in (_positive_int(body.get(f)) for f in OUTPUT_FIELDS) if v is not None), None
    )
    if asked is None:
        asked = DEFAULT_OUTPUT.get(endpoint, max(0, max_model_len - prompt))
    return prompt + completions_asked * asked
