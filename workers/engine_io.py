"""The runner's engine I/O, through the endpoint registry (``offpeak.endpoints``): a request
line's body becomes an engine request for a loaded engine, and an engine result becomes the
record stored for the line (``offpeak.endpoints.records.Answer``), which finalize renders as the
output line.

Which checks a body gets and how its answer is worded belong to its endpoint's module; this
module only ties them to the engine's own types (``workers.engine.base``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offpeak import endpoints
from offpeak.endpoints import LineError, records
from offpeak.endpoints.embeddings import encode_vector
from offpeak.endpoints.records import Answer
from offpeak.ids import new_ids
from workers.engine.base import Completion, Engine, EngineRequest, EngineResult

__all__ = ["LineError", "Prepared", "answer", "prepare"]


@dataclass
class Prepared:
    """An engine request plus what is needed to size it and to record its answer."""

    request: EngineRequest
    #: The endpoint's url.
    endpoint: str
    #: The body's ``model``.
    model: str
    #: ``(prompt tokens, most new tokens)`` of each sequence the line puts in the engine
    #: (``Endpoint.engine_needs``), which slot sizing adds up.
    needs: tuple[tuple[int, int], ...]
    #: Request fields the output body repeats (``EngineInput.echo``), or ``None``.
    echo: dict[str, Any] | None = None


def prepare(
    request_id: str, endpoint: str, body: dict[str, Any], engine: Engine, priority: int = 0
) -> Prepared:
    """Turn a validated line's ``body`` for ``endpoint`` (a url) into an engine request with id
    ``request_id``. Raises ``LineError``: the line fails alone, with the 400 OpenAI's real-time
    endpoint would have returned (a prompt over the context window, a value out of range)."""
    served = endpoints.get(endpoint)
    engine_input = served.prepare(body, engine)
    request = EngineRequest(
        request_id,
        engine_input.prompt_token_ids,
        engine_input.sampling,
        priority,
        pooling=engine_input.pooling,
    )
    return Prepared(
        request, endpoint, body["model"], served.engine_needs(engine_input), engine_input.echo
    )


def answer(prepared: Prepared, result: EngineResult, created: int) -> Answer:
    """The record of an answered line, with fresh ids; ``created`` is unix seconds."""
    return Answer(**_answer_fields(prepared, result, created))


def answer_record(prepared: Prepared, result: EngineResult, created: int) -> str:
    """``records.dump(answer(prepared, result, created))`` built without the pydantic models
    (``records.dump_answer``): the stored record of an answered line, with fresh ids."""
    return records.dump_answer(_answer_fields(prepared, result, created))


def _answer_fields(prepared: Prepared, result: EngineResult, created: int) -> dict[str, Any]:
    """``Answer``'s fields for an answered line, with fresh ids: what ``answer`` validates into
    the model and ``answer_record`` writes straight to JSON."""
    line_id, request_id, response_id = new_ids(
        "batch_req_", "req_", endpoints.get(prepared.endpoint).response_id_prefix
    )
    # In the record's order (``records.dump_answer`` then writes the dict as it is).
    return {
        "record": "answer",
        "endpoint": prepared.endpoint,
        "model": prepared.model,
        "created": created,
        "line_id": line_id,
        "request_id": request_id,
        "response_id": response_id,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "completions": [_completion_fields(c) for c in result.completions],
        "echo": prepared.echo,
        "embeddings": (
            None if result.embeddings is None else [encode_vector(v) for v in result.embeddings]
        ),
    }


def _completion_fields(completion: Completion) -> dict[str, Any]:
    """``CompletionRecord``'s fields of ``completion``, as a dict."""
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [
            {
                "token": lp.token,
                "logprob": _float(lp.logprob),
                "top": [(t.token, _float(t.logprob)) for t in lp.top],
            }
            for lp in completion.logprobs
        ]
    return {
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "tokens": len(completion.token_ids),
        "stop_sequence": completion.stop_sequence,
        "logprobs": logprobs,
    }


def _float(value: float | None) -> float | None:
    # As the record's ``float | None`` field stores it: an int engine value becomes a float.
    return None if value is None else float(value)
