"""A batch's cost estimate: its prompt tokens counted with the model's own
tokenizer and the price range they imply, from the prompts alone (every line stops at once) to
the prompts plus every line's whole completion budget (``max_tokens`` × ``n``, or what the
context window leaves when a line sets none).

The validation task (``workers.tasks.validate_batch``, in the control worker) counts it from the
stored lines right after the batch goes in progress (``estimate_batch``) and puts it on the
batch (the API shows it as the batch's ``estimate``: ``null`` until counted, seconds after the
batch starts); ``offpeak estimate FILE`` computes the same thing on the
user's machine without a server. The tokenizer is the model's own: Hugging Face's
``AutoTokenizer`` on the folder ``workers.model_store.ensure_model`` builds, used exactly as the
vLLM engine uses it (``ModelTokenizer``), so the estimate's prompt tokens are the tokens the
batch will be billed for. An ``instant`` model counts as its engine does (UTF-8 bytes).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson

from offpeak import billing, endpoints
from offpeak.endpoints.base import Tokenizer
from offpeak.endpoints.errors import LineError
from offpeak.settings import ModelConfig, Settings
from offpeak.statuses import BatchStatus
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import requests as requests_repo
from workers.engine.chat_template import TemplateTokenizer

log = logging.getLogger(__name__)


class ModelTokenizer:
    """``offpeak.endpoints.base.Tokenizer`` on a model's Hugging Face tokenizer, with the vLLM
    engine's rules (``workers.engine.vllm_engine.VllmEngine.encode_chat``): the chat template
    rendered as text, encoded without the tokenizer's own specials, and its BOS put in front
    only when it adds one to plain text and the template did not write it."""

    def __init__(
        self, tokenizer: Any, max_model_len: int, embedding_size: int | None = None
    ) -> None:
        self.max_model_len = max_model_len
        #: An embedding model's vector size (``offpeak.endpoints.embeddings`` reads it, as it
        #: reads the pooling engine's); ``None`` for a text model.
        self.embedding_size = embedding_size
        self._template = TemplateTokenizer(tokenizer, thread_safe=True)
        self.vocab_size: int | None = self._template.vocab_size

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self._template.encode_chat(messages, tools)

    def encode_text(self, text: str) -> list[int]:
        return self._template.encode_text(text)


@lru_cache(maxsize=8)
def _load(name: str, config_json: str, cache_dir: str) -> Tokenizer:
    config = ModelConfig.model_validate_json(config_json)
    if config.engine == "instant":
        from workers.engine.instant import InstantEngine

        return InstantEngine(name, config.max_model_len)
    from workers.model_store import ensure_model

    folder = ensure_model(name, config, Path(cache_dir))  # before the slow import: it may fail
    from transformers import AutoTokenizer

    size = None
    if config.runner == "pooling":
        size = int(orjson.loads((folder / "config.json").read_bytes())["hidden_size"])
    return ModelTokenizer(AutoTokenizer.from_pretrained(str(folder)), config.max_model_len, size)


#: One load at a time: a validation that needs a tokenizer ``warm`` is loading waits for it
#: rather than loading a second copy.
_loading = threading.Lock()


def tokenizer_for(settings: Settings, model: str) -> Tokenizer:
    """The served model's own tokenizer, loaded once per process and configuration (seconds
    the first time, nearly all of it importing ``transformers``). Raises ``KeyError`` for a
    model that is not configured and whatever loading its folder raises
    (``workers.model_store.ModelUnavailableError``)."""
    config = settings.models[model]
    with _loading:
        return _load(model, config.model_dump_json(), str(settings.model_cache_dir))


def warm(settings: Settings) -> None:
    """Load every configured model's tokenizer (the control worker starts this in a thread, so
    its first validation does not wait for ``transformers``); a model whose tokenizer cannot
    be loaded here is logged and skipped (its batches get no estimate)."""
    for model in settings.models:
        try:
            tokenizer_for(settings, model)
        except Exception as exc:  # advice only, as in BatchEstimator
            log.warning("no cost estimate for %s batches: %s", model, exc)


@dataclass
class Estimate:
    """Running sums over a batch's lines; ``as_json`` is the batch's ``estimate`` field."""

    model: str
    requests: int = 0
    #: Lines the endpoint would refuse (over the context window, a bad parameter): they fail
    #: alone with a 400 and are billed nothing, so they are left out of the sums.
    invalid_requests: int = 0
    prompt_tokens: int = 0
    max_completion_tokens: int = 0

    def add(self, line: str | bytes | dict[str, Any], tokenizer: Tokenizer, endpoint: str) -> None:
        """Count one request line (its JSON, or parsed) of a batch on ``endpoint``."""
        served = endpoints.ENDPOINTS.get(endpoint)
        parsed = orjson.loads(line) if isinstance(line, bytes | str) else line
        body = parsed.get("body") if isinstance(parsed, dict) else None
        if served is None or not isinstance(body, dict):
            self.invalid_requests += 1
            return
        try:
            engine_input = served.prepare(body, tokenizer)
        except (LineError, ValueError):
            self.invalid_requests += 1
            return
        self.requests += 1
        # A prompt is billed once per line, each of its ``n`` completions up to its budget;
        # an embeddings line's every input is.
        pooling = engine_input.pooling
        self.prompt_tokens += (
            sum(len(ids) for ids in pooling.inputs)
            if pooling is not None
            else len(engine_input.prompt_token_ids)
        )
        self.max_completion_tokens += sum(new for _p, new in served.engine_needs(engine_input))

    def as_json(self, settings: Settings) -> dict[str, Any]:
        """``{prompt_tokens, max_completion_tokens, price_low, price_high, requests,
        invalid_requests}``; prices in US dollars at the batch price (real-time list price ×
        (1 − batch discount), ``offpeak.billing``), before any prefix-cache discount."""
        discount = 1 - billing.batch_discount(settings, self.model)

        def price(output_tokens: int) -> float:
            listed = billing.realtime_price(
                settings, self.model, self.prompt_tokens, 0, output_tokens
            )
            return round(listed * discount, billing.MONEY_DIGITS)

        return {
            "prompt_tokens": self.prompt_tokens,
            "max_completion_tokens": self.max_completion_tokens,
            "price_low": price(0),
            "price_high": price(self.max_completion_tokens),
            "requests": self.requests,
            "invalid_requests": self.invalid_requests,
        }


def estimate_file(settings: Settings, path: Path) -> tuple[dict[str, Any], list[int]]:
    """The estimate of a JSONL batch file on disk (``offpeak estimate``): ``(estimate, numbers
    of the lines that are not request lines)``, 1-based. The model and endpoint are the first
    line's; lines of another model or url, or not JSON, are not request lines (validation would
    fail the batch). Raises ``ValueError`` when no line names a served model."""
    from workers.validation import iter_lines

    estimate: Estimate | None = None
    tokenizer: Tokenizer | None = None
    endpoint = ""
    unusable: list[int] = []

    def chunks() -> Any:
        with open(path, "rb") as handle:
            while piece := handle.read(1 << 20):
                yield piece

    for number, raw in iter_lines(chunks()):
        if raw is None or not raw.strip():
            continue
        try:
            line = orjson.loads(raw)
            model, url = line["body"]["model"], line["url"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            unusable.append(number)
            continue
        if estimate is None:
            if model not in settings.models:
                raise ValueError(
                    f"the first line's model {model!r} is not configured here; configured: "
                    f"{', '.join(settings.models)} (OFFPEAK_MODELS)"
                )
            estimate, endpoint = Estimate(model), url
            tokenizer = tokenizer_for(settings, model)
        if model != estimate.model or url != endpoint:
            unusable.append(number)
            continue
        assert tokenizer is not None
        estimate.add(line, tokenizer, endpoint)
    if estimate is None:
        raise ValueError("the file holds no request line")
    return {"model": estimate.model, "endpoint": endpoint, **estimate.as_json(settings)}, unusable


def estimate_batch(settings: Settings, batch_id: str) -> dict[str, Any] | None:
    """Count a batch's estimate from its stored request lines and store it as the batch's
    ``estimate`` (``batches.set_estimate``), once validation has put the batch in progress.
    Returns what was stored, or ``None`` when nothing was: the batch is unknown, still
    validating, failed validation (no lines), already has an estimate, or no estimate can be
    made here (``BatchEstimator``: the tokenizer will not load). Never raises for a line.

    It runs after the batch starts, not inside validation: counting is the model's tokenizer on
    every line (tens of seconds for 50,000 chat lines on SmolLM2's, docs/api.md "Estimate"), and a
    batch's lines need not wait for advice to start running. The lines are read in one transaction,
    and the estimate stored in a second, short one that holds the batch row only for its
    ``UPDATE``."""
    url = settings.resolved_database_url
    estimator = BatchEstimator()
    with session_scope(url) as session:
        batch = batches_repo.get_any(session, batch_id)
        if (
            batch is None
            or batch.estimate is not None
            or batch.model is None
            or batch.status in (BatchStatus.VALIDATING, BatchStatus.FAILED)
        ):
            return None
        model, endpoint = batch.model, batch.endpoint
        for line_json in requests_repo.iter_line_json(session, batch_id):
            estimator.add(settings, model, endpoint, line_json)
    figures = estimator.as_json(settings)
    if figures is None:
        return None
    with session_scope(url) as session:
        stored = batches_repo.set_estimate(session, batch_id, figures)
    return figures if stored else None


class BatchEstimator:
    """A batch's estimate built line by line (``estimate_batch``): the model's tokenizer is
    loaded at the first line; if it cannot be (no model folder on this host), the batch gets no
    estimate, with one warning, and its run goes on unharmed."""

    def __init__(self) -> None:
        self.estimate: Estimate | None = None
        self._tokenizer: Tokenizer | None = None
        self._off = False

    def add(
        self, settings: Settings, model: str, endpoint: str, line: str | bytes | dict[str, Any]
    ) -> None:
        """Count one request line (its JSON, or parsed)."""
        if self._off:
            return
        if self.estimate is None:
            try:
                self._tokenizer = tokenizer_for(settings, model)
            except Exception as exc:  # an estimate is advice: never fail validation for it
                log.warning("no cost estimate for %s batches: %s", model, exc)
                self._off = True
                return
            self.estimate = Estimate(model)
        assert self._tokenizer is not None
        try:
            self.estimate.add(line, self._tokenizer, endpoint)
        except Exception:  # an endpoint's own bug must not fail the file: count, log, go on
            log.exception("estimating a %s line of %s failed", endpoint, model)
            self.estimate.invalid_requests += 1

    def as_json(self, settings: Settings) -> dict[str, Any] | None:
        """The batch's ``estimate``, or ``None`` when none could be made."""
        return None if self.estimate is None or self._off else self.estimate.as_json(settings)
