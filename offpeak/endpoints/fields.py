"""Pieces the text-generation endpoints' body models share: the limits of OpenAI's sampling
parameters, the checks pydantic cannot state (``stop``, parameters this server refuses), and the
``SamplingSpec`` built from a parsed body.

Limits follow OpenAI's API reference (Chat Completions / Completions, "Request body").
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Protocol

from pydantic import ConfigDict, ValidationInfo

from offpeak.endpoints.base import SamplingSpec, StructuredOutput, Tokenizer
from offpeak.endpoints.errors import LineError, fail

#: Body models: strict types (``"8"`` is not an integer, ``true`` not a number), and unknown
#: parameters allowed, as OpenAI's endpoints ignore parameters they do not know.
BODY_CONFIG = ConfigDict(strict=True, extra="allow")
MAX_N = 128
MAX_STOP = 4
INT64 = (-(2**63), 2**63 - 1)
#: ``logit_bias`` values (OpenAI's API reference: "values between -100 and 100").
LOGIT_BIAS_RANGE = (-100, 100)
#: Most ``logit_bias`` entries: what vLLM's GPU model runner takes per request
#: (``vllm.v1.worker.gpu.sample.logit_bias.MAX_NUM_LOGIT_BIAS_TOKENS``).
MAX_LOGIT_BIAS = 1024


def unsupported(value: Any, info: ValidationInfo) -> Any:
    """Refuse a parameter that is set (truthy): it changes what an answer means and this server
    cannot honour it, so refusing the line beats silently answering something else."""
    if value:
        name = info.field_name
        raise fail("unsupported_parameter", f"'{name}' is not supported by this server.", name)
    return value


def int64_seed(seed: Any) -> Any:
    """A ``seed`` too large for 64 bits arrives as a float (JSON parsers read integers past
    64 bits as floats); it is out of range, not of the wrong type."""
    if isinstance(seed, float) and seed.is_integer() and not INT64[0] <= seed <= INT64[1]:
        raise fail(
            "invalid_value",
            f"Invalid 'seed': {int(seed)} must be between {INT64[0]} and {INT64[1]}.",
            "seed",
        )
    return seed


def text_modalities(modalities: Any) -> Any:
    """``modalities``: only ``["text"]`` (or null) is served; asking for audio output is refused,
    not answered in text."""
    if modalities is None:
        return None
    if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
        raise fail(
            "invalid_type", "Invalid 'modalities': expected a list of strings.", "modalities"
        )
    if any(m != "text" for m in modalities):
        raise fail(
            "unsupported_value",
            "Invalid 'modalities': only 'text' output is supported by this server.",
            "modalities",
        )
    return modalities


def stop_sequences(stop: Any) -> tuple[str, ...]:
    """``stop`` (a string, a list of at most ``MAX_STOP`` strings, or null) as a tuple of the
    non-empty stop strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise fail("invalid_type", "Invalid 'stop': expected a string or a list of strings.")
    if len(stops) > MAX_STOP:
        raise fail("invalid_value", f"Invalid 'stop': at most {MAX_STOP} sequences.")
    return tuple(s for s in stops if s)


def logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a JSON object mapping token ids, as strings of digits, to a bias in
    -100..100, or null) as ``(token id, bias)`` pairs ascending by id. Wording of OpenAI's
    400s: "Invalid key in 'logit_bias': AI. You should only be submitting non-negative
    integers." Whether each id is in the model's vocabulary is ``check_logit_bias``'s."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise fail(
            "invalid_type",
            f"Invalid type for 'logit_bias': expected an object, but got "
            f"{_json_kind(value)} instead.",
            "logit_bias",
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise fail(
            "invalid_value",
            f"Invalid 'logit_bias': {len(value)} entries; at most {MAX_LOGIT_BIAS}.",
            "logit_bias",
        )
    low, high = LOGIT_BIAS_RANGE
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
            raise fail(
                "invalid_value",
                f"Invalid key in 'logit_bias': {key}. You should only be submitting "
                "non-negative integers.",
                "logit_bias",
            )
        number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not number or not low <= bias <= high:  # NaN fails the comparison too
            raise fail(
                "invalid_value",
                f"Invalid value for 'logit_bias' key {key}: {bias!r}. You should only be "
                f"submitting numbers between {low} and {high}.",
                "logit_bias",
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def check_logit_bias(pairs: tuple[tuple[int, float], ...], tokenizer: Tokenizer) -> None:
    """Raises ``LineError`` (``invalid_value``, param ``logit_bias``) for a token id outside
    the model's vocabulary; an engine that does not know its vocabulary here
    (``vocab_size`` ``None``: a remote server's) leaves the check to the server."""
    vocab = tokenizer.vocab_size if pairs else None
    if vocab is None:
        return
    outside = [token for token, _bias in pairs if token >= vocab]
    if outside:
        raise LineError(
            f"Invalid key in 'logit_bias': {outside[0]}. The model's token ids are 0 to "
            f"{vocab - 1}.",
            "logit_bias",
            "invalid_value",
        )


def _json_kind(value: Any) -> str:
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "an array" if isinstance(value, list) else "another type"


def positive_top_p(top_p: float | None) -> float | None:
    # ``ge=0`` words the range as OpenAI does; 0 itself would sample from nothing.
    if top_p == 0:
        raise fail("invalid_value", "Invalid 'top_p': must be greater than 0.", "top_p")
    return top_p


def check_best_of(best_of: int | None, n: int | None) -> None:
    """``best_of`` is accepted only where it changes nothing (equal to ``n``)."""
    if best_of not in (None, n or 1):
        raise fail("unsupported_value", "'best_of' other than n is not supported.", "best_of")


class SamplingFields(Protocol):
    """The sampling parameters both text endpoints' bodies carry."""

    n: int | None
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...]
    seed: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: tuple[tuple[int, float], ...]


def sampling(
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    structured_output: StructuredOutput | None = None,
) -> SamplingSpec:
    """The ``SamplingSpec`` of a parsed body, with OpenAI's defaults for what it leaves out.
    Lines asking the same share one (immutable) spec (``_spec``)."""
    return _spec(
        max_tokens,
        _or(body.temperature, 1.0),
        _or(body.top_p, 1.0),
        body.n or 1,
        body.stop,
        body.seed,
        logprobs,
        _or(body.presence_penalty, 0.0),
        _or(body.frequency_penalty, 0.0),
        structured_output,
        body.logit_bias,
    )


@lru_cache(maxsize=4096)
def _spec(
    max_tokens: int,
    temperature: float,
    top_p: float,
    n: int,
    stop: tuple[str, ...],
    seed: int | None,
    logprobs: int | None,
    presence_penalty: float,
    frequency_penalty: float,
    structured_output: StructuredOutput | None,
    logit_bias: tuple[tuple[int, float], ...],
) -> SamplingSpec:
    """One ``SamplingSpec`` per distinct set of values: a batch's lines mostly ask the same, and
    building the frozen dataclass was a large share of preparing a chat line for the engine
    (``offpeak bench control``)."""
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        n=n,
        stop=stop,
        seed=seed,
        logprobs=logprobs,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        structured_output=structured_output,
        logit_bias=logit_bias,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else float(value)
