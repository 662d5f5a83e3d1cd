"""The remote engine: batch lines through an existing OpenAI-compatible vLLM server.

Instead of loading a model of its own, an engine worker whose model has ``engine: "remote"``
sends each request line to the server at ``ModelConfig.url`` (the real-time fleet's): the
prompt as token ids (the runner already rendered the chat template) to ``/v1/completions``, with
the line's sampling, vLLM's ``priority`` (``ModelConfig.priority``, positive, so the server runs
real-time requests, priority 0, first when both wait; the server needs ``--scheduling-policy
priority``) and ``return_token_ids``, so results carry the same token ids, logprobs and usage as
the in-process engine's (``--enable-prompt-tokens-details`` for cached tokens).

Concurrency: one asyncio event loop in a daemon thread drives every HTTP request of the engine
with one ``httpx.AsyncClient``. A thread per request would need as many threads as lines in
flight (hundreds), and a blocked thread cannot be stopped; a task can: ``abort`` cancels it,
httpx closes its connection, and vLLM aborts a request whose client disconnected (checked on
the real server in ``tests/test_engine_remote.py``). ``add`` only queues a line (locally, never
in the server's queue, so ``vllm:num_requests_waiting`` stays real-time work); the loop keeps at
most ``max_in_flight`` lines at the server, and ``step`` collects what finished, waiting at most
``STEP_WAIT_SECONDS`` when nothing did.

Verdicts and faults: a 4xx answer for a line is that line's verdict (a result with ``error``:
the line fails alone with the server's message); a server that cannot be reached, resets the
connection, times out or answers 5xx is an ``EngineFault`` (``blameless`` when the server went
away, so no line is charged an attempt), raised from ``step``; ``connect`` waits with
exponential backoff until the server's ``/health`` answers again.

Cost: ``ServerMeter`` reads the server's token counters (``/metrics``) every
``metrics_interval_seconds``; the runner's write-back charges each period's wall seconds × our
share of the server's weighted tokens (``workers.runner.writeback``, ``docs/engine.md``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from offpeak.settings import ModelConfig
from workers.engine.base import (
    Completion,
    EngineCapabilities,
    EngineFault,
    EngineRequest,
    EngineResult,
    RequestRefused,
    SamplingSpec,
    TokenLogprob,
    TopLogprob,
)
from workers.engine.chat_template import TemplateTokenizer, flatten_message
from workers.scheduler.signals import parse_metrics

log = logging.getLogger(__name__)

#: Longest ``step`` waits for a result when none is ready: short next to a write-back period
#: (``flush_seconds``) and a load poll, long enough that the runner's loop does not spin.
STEP_WAIT_SECONDS = 0.05
#: ``/health`` back-off while the server is away: first wait and cap, in seconds.
FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
#: Consecutive failed ``/metrics`` reads, while lines are in flight, after which the server
#: counts as gone (a host that vanished answers nothing, not even a reset).
METRICS_FAILURES_FOR_FAULT = 3
#: vLLM's Prometheus token counters (``vllm.v1.metrics.loggers``): prompt tokens (cached
#: included), cached prompt tokens, generated tokens.
PROMPT_TOKENS = "vllm:prompt_tokens_total"
CACHED_TOKENS = "vllm:prompt_tokens_cached_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
_COUNTERS = (PROMPT_TOKENS, CACHED_TOKENS, GENERATION_TOKENS)
#: Answers that are a verdict on the request itself (vLLM: 400 for a prompt over the context
#: window, bad sampling values). 401/403/404 (wrong key, wrong model name) and 429 are about
#: the server or its configuration: faults, not line failures.
_VERDICTS = frozenset({400, 413, 422})
_FINISH_REASONS = {"stop": "stop", "length": "length"}


class ServerUnavailable(RuntimeError):
    """``connect`` gave up: the worker is stopping while the server is still away."""


# --- The server's token counters ---------------------------------------------------------------


@dataclass(frozen=True)
class ServerTokens:
    """Token counters of a vLLM server (or their difference over a period): prompt tokens (cached
    included), cached prompt tokens, generated tokens."""

    prompt: float = 0.0
    cached: float = 0.0
    generation: float = 0.0

    def since(self, earlier: ServerTokens) -> ServerTokens:
        """Tokens counted after ``earlier``; a counter that went down (the server restarted and
        counts from 0 again) counts all of its current value, as Prometheus' ``increase`` does."""

        def delta(now: float, before: float) -> float:
            return now - before if now >= before else now

        return ServerTokens(
            delta(self.prompt, earlier.prompt),
            delta(self.cached, earlier.cached),
            delta(self.generation, earlier.generation),
        )

    def plus(self, other: ServerTokens) -> ServerTokens:
        return ServerTokens(
            self.prompt + other.prompt,
            self.cached + other.cached,
            self.generation + other.generation,
        )


@dataclass(frozen=True)
class ServerUsage:
    """What a ``ServerMeter`` counted since it started: ``busy_seconds`` of wall time during which
    at least one of our requests was at the server, and the tokens the server processed (for
    everyone) in that time. Monotonic: the difference of two readings covers the time between."""

    busy_seconds: float = 0.0
    tokens: ServerTokens = ServerTokens()

    def since(self, earlier: ServerUsage) -> ServerUsage:
        return ServerUsage(
            self.busy_seconds - earlier.busy_seconds,
            ServerTokens(
                self.tokens.prompt - earlier.tokens.prompt,
                self.tokens.cached - earlier.tokens.cached,
                self.tokens.generation - earlier.tokens.generation,
            ),
        )


def parse_server_tokens(text: str) -> ServerTokens:
    """The token counters in a vLLM ``/metrics`` page, summed over its label sets (several
    engines or model names behind one server all share its time). Raises ``ValueError`` when the
    page has no ``vllm:prompt_tokens_total`` or ``vllm:generation_tokens_total``."""
    # Only the three counters are parsed: the page is ~100 kB, read every second.
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_COUNTERS)) + "\n"
    values = parse_metrics(wanted, _COUNTERS)
    if PROMPT_TOKENS not in values or GENERATION_TOKENS not in values:
        raise ValueError(f"no {PROMPT_TOKENS} / {GENERATION_TOKENS} in the server's metrics")
    return ServerTokens(
        values[PROMPT_TOKENS], values.get(CACHED_TOKENS, 0.0), values[GENERATION_TOKENS]
    )


class ServerMeter:
    """Reads a vLLM server's token counters (``metrics_url``) every ``interval`` seconds and adds
    up, over the intervals in which ``busy()`` was true at some point, their wall seconds and the
    tokens the server processed: ``usage()``. The remote engine runs ``sample`` on its event
    loop; the write-back (our share of the server's time) and the batch lane's controller read
    ``usage()`` from other threads.
    """

    def __init__(self, metrics_url: str, interval: float, busy: Callable[[], bool]) -> None:
        self.metrics_url = metrics_url
        self.interval = interval
        self._busy = busy
        self._lock = threading.Lock()
        self._usage = ServerUsage()
        self._last: tuple[float, ServerTokens] | None = None
        #: Whether we had work at the server at some point since the last reading.
        self._was_busy = False
        #: The interval just after our work ended is already marked to count (once).
        self._tail_counted = False
        #: Reads that failed in a row (``METRICS_FAILURES_FOR_FAULT``).
        self.failures = 0

    def usage(self) -> ServerUsage:
        """Busy seconds and server tokens counted so far (thread-safe)."""
        with self._lock:
            return self._usage

    def mark_busy(self) -> None:
        """A request of ours went to the server (the interval it falls in counts)."""
        self._was_busy = True

    def record(self, at: float, tokens: ServerTokens | None) -> None:
        """Account one reading taken at monotonic ``at`` (``None``: the read failed). The interval
        since the last good reading counts when we had work at the server in it, and so does
        the one after: the server bumps its counters after it has answered, so the last step's
        tokens of a line that just finished can land after the reading that saw it finish
        (seen: 5 of 954 generation tokens missed)."""
        busy = self._was_busy or self._busy()
        if tokens is None:
            self.failures += 1
            self._was_busy = busy  # the gap counts with the next good reading
            return
        self._was_busy = self._busy() or (busy and not self._tail_counted)
        self._tail_counted = busy and not self._busy()
        self.failures = 0
        with self._lock:
            if self._last is not None and busy:
                seconds = at - self._last[0]
                self._usage = ServerUsage(
                    self._usage.busy_seconds + seconds,
                    self._usage.tokens.plus(tokens.since(self._last[1])),
                )
            self._last = (at, tokens)

    async def sample(self, client: httpx.AsyncClient) -> None:
        """Read the counters once (``record``)."""
        try:
            response = await client.get(self.metrics_url, timeout=max(2.0, self.interval * 5))
            response.raise_for_status()
            tokens: ServerTokens | None = parse_server_tokens(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("cannot read %s: %s", self.metrics_url, exc)
            tokens = None
        self.record(time.monotonic(), tokens)


# --- Tokenization -----------------------------------------------------------------------------


def local_tokenizer(path: Path) -> TemplateTokenizer:
    """The model's own tokenizer (a Hugging Face folder), rendering exactly as ``VllmEngine``."""
    from transformers import AutoTokenizer

    return TemplateTokenizer(AutoTokenizer.from_pretrained(str(path)))


class ServerTokenizer:
    """The server's ``/tokenize`` (one round trip per line), for a model without a local folder.

    Raises ``ValueError`` for messages the server's template refuses (its 400) and
    ``EngineFault`` (blameless) when the server cannot be reached: the chunk goes back unrun.
    """

    def __init__(self, client: httpx.Client, model: str) -> None:
        self._client = client
        self._model = model

    def _tokenize(self, body: dict[str, Any]) -> list[int]:
        try:
            response = self._client.post("/tokenize", json={"model": self._model, **body})
        except httpx.HTTPError as exc:
            raise EngineFault(f"/tokenize failed: {exc!r}", blameless=True) from exc
        if response.status_code in _VERDICTS:
            raise ValueError(_error_message(response))
        if response.status_code != 200:
            raise EngineFault(f"/tokenize answered {response.status_code}: {response.text[:200]}")
        return [int(t) for t in response.json()["tokens"]]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        flat = [flatten_message(m) for m in messages]
        return self._tokenize({"messages": flat, "add_generation_prompt": True})

    def encode_text(self, text: str) -> list[int]:
        return self._tokenize({"prompt": text, "add_special_tokens": True})

    def count(self, text: str) -> int:
        return len(self._tokenize({"prompt": text, "add_special_tokens": False}))


# --- The engine -------------------------------------------------------------------------------


@dataclass
class _Sent:
    """A line at the server: its send number (a later outcome of an aborted, re-added id is
    told apart by it) and the HTTP request's future."""

    seq: int
    request: EngineRequest
    future: concurrent.futures.Future[None]


@dataclass
class _Outcome:
    request_id: str
    seq: int
    result: EngineResult | None = None
    fault: EngineFault | None = None


class RemoteEngine:
    """Implements ``workers.engine.base.Engine`` on a vLLM server's HTTP API.

    ``connect`` builds one (waiting for the server); the runner drives it from one thread.
    Beyond the protocol: ``max_in_flight`` / ``set_max_in_flight`` (the batch lane's
    concurrency), ``in_flight_ids`` (oldest first), ``server_meter`` (the server's token counters
    and our busy seconds), ``base_url`` and ``metrics_url``.
    """

    def __init__(
        self,
        model_name: str,
        config: ModelConfig,
        tokenizer: TemplateTokenizer | ServerTokenizer | None,
        max_model_len: int,
        *,
        client: httpx.Client | None = None,
    ) -> None:
        if not config.url:
            raise ValueError(f"model {model_name}: engine 'remote' needs a url")
        self.model_name = model_name
        self.base_url = config.url.rstrip("/")
        self.metrics_url = f"{self.base_url}/metrics"
        self.served_model_name = config.served_model_name or model_name
        self.max_model_len = max_model_len
        self.priority = config.priority
        # Unset, the server's limit is taken as a GPU server's default (its device is unknown).
        self.max_in_flight = config.max_in_flight or config.max_num_seqs_on(on_cpu=False)
        # ``step`` collects finished HTTP requests, not one decode step; the room is what may be
        # in flight.
        self.capabilities = EngineCapabilities(step_is_poll=True, max_num_seqs=self.max_in_flight)
        self._sync = client or httpx.Client(
            base_url=self.base_url, timeout=config.connect_timeout_seconds + 10
        )
        self._tokenizer = tokenizer or ServerTokenizer(self._sync, self.served_model_name)
        self._timeout = httpx.Timeout(
            config.request_timeout_seconds, connect=config.connect_timeout_seconds
        )
        self._waiting: deque[EngineRequest] = deque()
        self._sent: dict[str, _Sent] = {}
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._seq = itertools.count()
        self._warned_no_cached = False
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self.server_meter = ServerMeter(
            self.metrics_url, config.metrics_interval_seconds, lambda: bool(self._sent)
        )
        self._thread = threading.Thread(
            target=self._run_loop, daemon=True, name=f"remote-engine-{model_name}"
        )
        ready = threading.Event()
        self._thread.start()
        self._call(self._open(ready))
        ready.wait(10)

    @classmethod
    def connect(
        cls,
        name: str,
        config: ModelConfig,
        tokenizer_path: Path | None,
        *,
        stop: Callable[[], bool] = lambda: False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> RemoteEngine:
        """An engine on the server at ``config.url``, once its ``/health`` answers 200: waits
        with exponential back-off (``FIRST_BACKOFF_SECONDS`` doubling up to
        ``MAX_BACKOFF_SECONDS``) for as long as it takes; a server that is down is waited for,
        never a reason to fail. ``max_model_len`` comes from the server's ``/v1/models`` (else
        ``config``). The tokenizer is the folder's at ``tokenizer_path``, else the server's.

        Raises ``ServerUnavailable`` when ``stop()`` turns true while waiting, ``ValueError``
        when the server does not serve ``config.served_model_name`` (or ``name``).
        """
        if not config.url:
            raise ValueError(f"model {name}: engine 'remote' needs a url")
        base = config.url.rstrip("/")
        served = config.served_model_name or name
        client = httpx.Client(base_url=base, timeout=config.connect_timeout_seconds + 10)
        wait, since = FIRST_BACKOFF_SECONDS, time.monotonic()
        while True:
            try:
                models = _served_models(client)
                break
            except (httpx.HTTPError, ValueError) as exc:
                if stop():
                    client.close()
                    raise ServerUnavailable(f"{base} still away; stopping") from exc
                log.warning(
                    "%s: server %s not answering (%s) for %.0f s; next look in %.1f s",
                    name,
                    base,
                    exc,
                    time.monotonic() - since,
                    wait,
                )
                sleep(wait)
                wait = min(wait * 2, MAX_BACKOFF_SECONDS)
        if served not in models:
            client.close()
            raise ValueError(
                f"model {name}: the server at {base} serves {sorted(models)}, not {served!r} "
                "(set served_model_name)"
            )
        max_model_len = int(models[served] or config.max_model_len)
        tokenizer = local_tokenizer(tokenizer_path) if tokenizer_path is not None else None
        engine = cls(name, config, tokenizer, max_model_len, client=client)
        log.info(
            "%s: remote engine on %s (model %s, max_model_len %d, priority %d, %d in flight, "
            "%s tokenizer)",
            name,
            base,
            served,
            max_model_len,
            config.priority,
            engine.max_in_flight,
            "local" if tokenizer else "server",
        )
        return engine

    # Tokenization ---------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """As ``VllmEngine.encode_chat``; with the server's tokenizer, raises ``EngineFault``
        (blameless) when the server cannot be reached."""
        return self._tokenizer.encode_chat(messages)

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode_text(text)

    # Requests --------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue ``request``; it goes to the server as soon as fewer than ``max_in_flight`` of
        ours are there. Raises ``ValueError`` for a request id already in the engine."""
        rid = request.request_id
        if rid in self._sent or any(r.request_id == rid for r in self._waiting):
            raise ValueError(f"request {rid!r} is already in the engine")
        self._waiting.append(request)
        self._dispatch()

    def step(self) -> list[EngineResult]:
        """The requests that finished since the last call (waiting up to ``STEP_WAIT_SECONDS``
        for one when none has). Raises ``EngineFault`` when the server failed a request
        (unreachable, reset, timed out, 5xx) or stopped answering its ``/metrics``."""
        self._dispatch()
        if not self._sent:
            return []
        results: list[EngineResult] = []
        wait: float | None = STEP_WAIT_SECONDS
        while True:
            try:
                outcome = self._outcomes.get(timeout=wait) if wait else self._outcomes.get_nowait()
            except queue.Empty:
                break
            wait = None
            sent = self._sent.get(outcome.request_id)
            if sent is None or sent.seq != outcome.seq:
                continue  # aborted meanwhile
            if outcome.fault is not None:
                outcome.fault.suspects = list(self._sent)
                raise outcome.fault
            del self._sent[outcome.request_id]
            assert outcome.result is not None
            results.append(outcome.result)
        if self._sent and self.server_meter.failures >= METRICS_FAILURES_FOR_FAULT:
            raise EngineFault(
                f"{self.metrics_url} failed {self.server_meter.failures} reads in a row",
                list(self._sent),
                blameless=True,
            )
        self._dispatch()
        return results

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests, queued here or at the server (their HTTP requests are cancelled, and
        vLLM aborts a request whose client went away). Unknown ids are ignored."""
        drop = set(request_ids)
        self._waiting = deque(r for r in self._waiting if r.request_id not in drop)
        for rid in drop:
            sent = self._sent.pop(rid, None)
            if sent is not None:
                sent.future.cancel()

    def num_unfinished(self) -> int:
        return len(self._waiting) + len(self._sent)

    def in_flight_ids(self) -> list[str]:
        """Our request ids at the server, oldest first (the lane controller aborts the newest)."""
        return list(self._sent)

    def set_max_in_flight(self, limit: int) -> None:
        """At most ``limit`` (≥ 0) of our requests at the server from now on; lowering it lets
        running ones finish (abort them to free the server at once)."""
        self.max_in_flight = max(0, int(limit))
        self._dispatch()

    def close(self) -> None:
        """Cancel every request and stop the event loop. Safe to call twice."""
        if self._loop.is_closed():
            return
        for sent in self._sent.values():
            sent.future.cancel()
        self._sent.clear()
        self._waiting.clear()
        if self._thread.is_alive():
            try:
                self._call(self._shut()).result(timeout=10)
            except Exception as exc:  # a loop that cannot close cleanly is stopped anyway
                log.warning("closing the remote engine's client raised %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()
        self._sync.close()

    # The event loop --------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coroutine: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def _open(self, ready: threading.Event) -> None:
        # No connection limit of httpx's own: max_in_flight is the bound, and a request waiting
        # for a pooled connection would count against its timeout.
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self._timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._sampler = asyncio.ensure_future(self._sample_forever())
        ready.set()

    async def _shut(self) -> None:
        self._sampler.cancel()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        if self._client is not None:
            await self._client.aclose()

    async def _sample_forever(self) -> None:
        assert self._client is not None
        while True:
            await self.server_meter.sample(self._client)
            await asyncio.sleep(self.server_meter.interval)

    def _dispatch(self) -> None:
        while self._waiting and len(self._sent) < self.max_in_flight:
            request = self._waiting.popleft()
            seq = next(self._seq)
            future = self._call(self._send(request, seq))
            self._sent[request.request_id] = _Sent(seq, request, future)
            self.server_meter.mark_busy()

    async def _send(self, request: EngineRequest, seq: int) -> None:
        """One line's HTTP request; its outcome goes to ``step`` whatever happens, except a
        cancel (``abort``), which propagates."""
        try:
            outcome = await self._exchange(request, seq)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # our bug, or httpx's: the line must not wait forever
            fault = EngineFault(f"request {request.request_id} failed here: {exc!r}")
            outcome = _Outcome(request.request_id, seq, fault=fault)
        self._outcomes.put(outcome)

    async def _exchange(self, request: EngineRequest, seq: int) -> _Outcome:
        assert self._client is not None
        rid = request.request_id
        try:
            response = await self._client.post("/v1/completions", json=self._body(request))
        except httpx.TransportError as exc:  # timeouts included
            # Refused, reset, or no answer in time: the server is away or overloaded, which is no
            # line's fault.
            fault = EngineFault(f"{self.base_url} failed request {rid}: {exc!r}", blameless=True)
            return _Outcome(rid, seq, fault=fault)
        if response.status_code in _VERDICTS:
            refused = refusal(request, _error_message(response))
            return _Outcome(rid, seq, result=EngineResult(rid, 0, 0, [], refused=refused))
        if response.status_code != 200:
            fault = EngineFault(
                f"{self.base_url} answered {response.status_code} to request {rid}: "
                f"{response.text[:300]}"
            )
            return _Outcome(rid, seq, fault=fault)
        try:
            return _Outcome(
                rid, seq, result=self._to_result(rid, request.sampling, response.json())
            )
        except Exception as exc:  # an answer we cannot read: the server's, not the line's
            return _Outcome(rid, seq, fault=EngineFault(f"unreadable answer to {rid}: {exc!r}"))

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        return completion_body(self.served_model_name, request, self.priority + request.priority)

    # Answers ---------------------------------------------------------------------------------

    def _to_result(self, rid: str, spec: SamplingSpec, body: dict[str, Any]) -> EngineResult:
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details")
        if details is None and not self._warned_no_cached:
            self._warned_no_cached = True
            log.warning(
                "%s: the server reports no cached tokens; start it with "
                "--enable-prompt-tokens-details",
                self.base_url,
            )
        choices = sorted(body["choices"], key=lambda c: c.get("index", 0))
        return EngineResult(
            request_id=rid,
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int((details or {}).get("cached_tokens") or 0),
            completions=[self._to_completion(c, spec) for c in choices],
        )

    def _to_completion(self, choice: dict[str, Any], spec: SamplingSpec) -> Completion:
        reason = choice.get("finish_reason") or "stop"
        if reason not in _FINISH_REASONS:
            log.warning("completion ended with finish reason %r", reason)
        text = str(choice.get("text") or "")
        token_ids = choice.get("token_ids")
        if token_ids is None:  # a server without return_token_ids: the count is what matters
            token_ids = [0] * self._tokenizer.count(text)
        logprobs = None
        if spec.logprobs is not None and choice.get("logprobs"):
            logprobs = to_logprobs(choice["logprobs"], spec.logprobs)
        stop = choice.get("stop_reason")  # the stop string matched, a stop token id, or None
        return Completion(
            text=text,
            token_ids=[int(t) for t in token_ids],
            finish_reason=_FINISH_REASONS.get(reason, "stop"),
            logprobs=logprobs,
            stop_sequence=stop if isinstance(stop, str) else None,
        )


def completion_body(model: str, request: EngineRequest, priority: int) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``request``: its token ids, every ``SamplingSpec`` field,
    vLLM's ``priority`` and ``return_token_ids``.

    ``min_p`` and ``repetition_penalty`` are sent at vLLM's ``SamplingParams`` defaults: a
    server fills what a request leaves out from the model's ``generation_config.json``, which
    the in-process engine (explicit ``SamplingParams``) does not use, so the same line samples
    the same tokens on both. ``structured_output`` becomes vLLM's ``structured_outputs``.
    """
    spec = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "n": spec.n,
        "stop": list(spec.stop),
        "seed": spec.seed,
        "logprobs": spec.logprobs,
        "presence_penalty": spec.presence_penalty,
        "frequency_penalty": spec.frequency_penalty,
        "top_k": spec.top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "priority": priority,
        "return_token_ids": True,
        "stream": False,
    }
    structured = spec.structured_output
    if structured is not None:
        body["structured_outputs"] = (
            {"json_object": True}
            if structured.json_schema is None
            else {"json": structured.json_schema}
        )
    return body


def refusal(request: EngineRequest, message: str) -> RequestRefused:
    """The verdict of a server's 4xx answer; a schema its grammar backend refused names the
    line's schema parameter, as ``VllmEngine`` does."""
    structured = request.sampling.structured_output
    lowered = message.lower()
    if structured is not None and ("schema" in lowered or "grammar" in lowered):
        return RequestRefused(
            f"The schema cannot be used for structured output: {message}",
            param=structured.param,
            code="invalid_json_schema",
        )
    return RequestRefused(message)


def to_logprobs(logprobs: dict[str, Any], k: int) -> list[TokenLogprob]:
    """Completions-API logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``) as
    ``TokenLogprob``s, with the ``k`` most likely alternatives, most likely first. vLLM lists the
    sampled token and the ``k`` most likely ones (k + 1 when the sampled one ranks below them,
    keyed by decoded text); keeping the best ``k`` leaves it out exactly then, as
    ``VllmEngine`` does. Two alternatives that decode to the same text collapse into one key at
    the server; ``-9999.0`` is how it writes minus infinity."""
    out = []
    tops = logprobs.get("top_logprobs") or []
    for i, token in enumerate(logprobs.get("tokens") or []):
        value = logprobs["token_logprobs"][i]
        top = tops[i] if i < len(tops) and tops[i] else {}
        best = sorted(top.items(), key=lambda item: -item[1])[:k]
        out.append(
            TokenLogprob(
                token=str(token),
                logprob=float(value) if value is not None else math.nan,
                top=[TopLogprob(str(t), float(lp)) for t, lp in best],
            )
        )
    return out


def _served_models(client: httpx.Client) -> dict[str, int | None]:
    """``name → max_model_len`` from a healthy server. Raises ``httpx.HTTPError`` while it is
    not (``/health`` not 200, or no answer)."""
    client.get("/health").raise_for_status()
    response = client.get("/v1/models")
    response.raise_for_status()
    return {m["id"]: m.get("max_model_len") for m in response.json()["data"]}


def _error_message(response: httpx.Response) -> str:
    """The server's error message (OpenAI's ``{"error": {"message"}}``), else its text."""
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except ValueError:
        pass
    return f"the server answered {response.status_code}: {response.text[:300]}"
