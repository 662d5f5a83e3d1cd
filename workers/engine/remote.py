"""The remote engine: batch lines through an existing OpenAI-compatible vLLM server.

Instead of loading a model of its own, an engine worker whose model has ``engine: "remote"``
sends each request line to the server at ``ModelConfig.url`` (the real-time fleet's) as token ids
(``workers.engine.remote_wire``), at vLLM's ``priority`` ``ModelConfig.priority``: positive, so
the server runs real-time requests (priority 0) first when both wait (the server needs
``--scheduling-policy priority``).

Concurrency: one asyncio event loop in a daemon thread drives every HTTP request with one
``httpx.AsyncClient``. A thread per request would need as many threads as lines in flight, and a
blocked thread cannot be stopped; a task can: ``abort`` cancels it, httpx closes its connection,
and vLLM aborts a request whose client disconnected. ``add`` only queues a line here, never in
the server's queue, so ``vllm:num_requests_waiting`` stays real-time work; at most
``max_in_flight`` lines are at the server.

Verdicts and faults: a 4xx answer for a line is that line's verdict (the line fails alone with
the server's message); a server that cannot be reached, resets the connection, times out or
answers 5xx is an ``EngineFault`` (``blameless`` when the server went away, so no line is charged
an attempt), raised from ``step``; ``connect`` waits with exponential backoff until the server's
``/health`` answers again.

Cost: the engine's ``ServerMeter`` (``workers.engine.remote_meter``) reads the server's token
counters, from which the write-back charges our share of the server's time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
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
    EngineCapabilities,
    EngineFault,
    EngineRequest,
    EngineResult,
    SamplingSpec,
)
from workers.engine.chat_template import TemplateTokenizer
from workers.engine.remote_meter import ServerMeter
from workers.engine.remote_tokenizer import ServerTokenizer, local_tokenizer
from workers.engine.remote_wire import (
    VERDICTS,
    completion_body,
    error_message,
    refusal,
    served_models,
    to_result,
)

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


class ServerUnavailable(RuntimeError):
    """``connect`` gave up: the worker is stopping while the server is still away."""


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
                models = served_models(client)
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

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """As ``VllmEngine.encode_chat``; with the server's tokenizer, raises ``EngineFault``
        (blameless) when the server cannot be reached."""
        return self._tokenizer.encode_chat(messages, tools)

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode_text(text)

    @property
    def vocab_size(self) -> int | None:
        """The local tokenizer's vocabulary; ``None`` with the server's (it checks ids)."""
        return self._tokenizer.vocab_size

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

    def take_unfinished(self) -> list[EngineRequest]:
        """Every request queued here or at the server, oldest first, dropped from this engine
        (their HTTP requests cancelled, none gives a result): what a fleet sends to another
        replica when this one went away."""
        taken = [sent.request for sent in self._sent.values()] + list(self._waiting)
        self.abort([r.request_id for r in taken])
        return taken

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
        if response.status_code in VERDICTS:
            refused = refusal(request, error_message(response))
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
        # vLLM's server runs an adapter named as the model (its ``--lora-modules`` names).
        model = request.lora.name if request.lora is not None else self.served_model_name
        return completion_body(model, request, self.priority + request.priority)

    # Answers ---------------------------------------------------------------------------------

    def _to_result(self, rid: str, spec: SamplingSpec, body: dict[str, Any]) -> EngineResult:
        usage = body.get("usage") or {}
        if usage.get("prompt_tokens_details") is None and not self._warned_no_cached:
            self._warned_no_cached = True
            log.warning(
                "%s: the server reports no cached tokens; start it with "
                "--enable-prompt-tokens-details",
                self.base_url,
            )
        return to_result(rid, spec, body, self._tokenizer.count)
