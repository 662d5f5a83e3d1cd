"""A fleet of real-time servers as one engine: batch lines through several ``vllm serve``
replicas of a model, each taking what its own batch lane allows.

A model behind a load balancer or a Kubernetes Service is served by N replicas; sent through the
balancer, batch lines would land on replicas whose metrics no lane reads. So the fleet talks to
each replica directly, one ``RemoteEngine`` each: ``ModelConfig.url`` and ``urls`` name them, or
``discover`` resolves ``url``'s host to every address it has (a headless Service's DNS answer)
every ``discover_seconds``. The runner's lane (``workers.lane.fleet_steering``) gives each
replica its own limit from its own ``/metrics``; a line goes to the replica with the most room
under its limit.

Replicas come and go: one that answers (``/health``, ``/v1/models`` serving the model) joins at
the next ``step``; one that faults blamelessly (unreachable, reset, its metrics unreadable) is
dropped and its lines, queued or at that server, go to the others as they were added, with no
attempt counted and no result, so nothing is billed twice. Only when no replica is left does
``step`` raise the ``EngineFault`` (blameless): the runner hands every line back and the worker
waits for the fleet. A fault that may be a line's (a 5xx for one request) is raised as it is.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from offpeak.settings import ModelConfig
from workers.engine.base import EngineCapabilities, EngineFault, EngineRequest, EngineResult
from workers.engine.remote import (
    FIRST_BACKOFF_SECONDS,
    MAX_BACKOFF_SECONDS,
    RemoteEngine,
    ServerUnavailable,
)
from workers.engine.remote_meter import ServerUsage
from workers.engine.remote_tokenizer import local_tokenizer
from workers.engine.remote_wire import served_models

log = logging.getLogger(__name__)
#: Seconds a probe of a replica that is not (yet) in the fleet may take.
PROBE_TIMEOUT_SECONDS = 2.0


def resolve(url: str) -> list[str]:
    """Base URLs for every address ``url``'s host resolves to (same scheme, port and path),
    sorted; ``[]`` when it does not resolve."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    out = set()
    for family, *_rest, address in infos:
        ip = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
        out.add(urlunsplit((parts.scheme, f"{ip}:{port}", parts.path, "", "")).rstrip("/"))
    return sorted(out)


def candidates(config: ModelConfig) -> list[str]:
    """The replicas the fleet should have now: the configured URLs, plus what ``url``
    resolves to with ``discover``; at most ``max_replicas``."""
    found = config.replica_urls()
    if config.discover and config.url:
        found = resolve(config.url) + [u for u in found if u != config.url.rstrip("/")]
    return list(dict.fromkeys(found))[: config.max_replicas]


class FleetMeter:
    """The fleet's usage: the replicas' ``ServerMeter``s added up, a departed replica's last
    reading kept, so the sum never goes back."""

    def __init__(self) -> None:
        self._retired = ServerUsage()
        self._live: dict[str, Any] = {}
        self._lock = threading.Lock()

    def add(self, url: str, meter: Any) -> None:
        with self._lock:
            self._live[url] = meter

    def retire(self, url: str) -> None:
        with self._lock:
            meter = self._live.pop(url, None)
            if meter is not None:
                self._retired = _plus(self._retired, meter.usage())

    def usage(self) -> ServerUsage:
        with self._lock:
            total = self._retired
            for meter in self._live.values():
                total = _plus(total, meter.usage())
            return total


def _plus(a: ServerUsage, b: ServerUsage) -> ServerUsage:
    return ServerUsage(a.busy_seconds + b.busy_seconds, a.tokens.plus(b.tokens))


class FleetEngine:
    """Implements ``workers.engine.base.Engine`` over the replicas of the module docstring.
    Beyond the protocol: ``replica_urls``, ``replica_of``, ``sent_to`` (lines each replica was
    sent, a running count), ``set_replica_limits`` and ``replica_room`` (for the lanes)."""

    def __init__(
        self,
        model_name: str,
        config: ModelConfig,
        tokenizer_path: Path | None,
        *,
        build: Callable[[str], RemoteEngine] | None = None,
    ) -> None:
        self.model_name = model_name
        self.config = config
        self.served_model_name = config.served_model_name or model_name
        #: Lines one replica may have in flight: the server's ``max_num_seqs``.
        self.replica_room = config.max_in_flight or config.max_num_seqs_on(on_cpu=False)
        self._tokenizer = local_tokenizer(tokenizer_path) if tokenizer_path is not None else None
        self._build = build or self._connect_replica
        self.replicas: dict[str, RemoteEngine] = {}
        self.limits: dict[str, int] = {}
        self.sent_to: dict[str, int] = {}
        self.meter = FleetMeter()
        self.max_model_len = config.max_model_len
        most = config.max_replicas if config.discover else max(1, len(config.replica_urls()))
        room = self.replica_room * most
        self.capabilities = EngineCapabilities(step_is_poll=True, max_num_seqs=room)
        self._waiting: deque[EngineRequest] = deque()
        self._where: dict[str, str] = {}
        self._joined: queue.SimpleQueue[RemoteEngine] = queue.SimpleQueue()
        self._probing: set[str] = set()
        self._stop = threading.Event()
        self._finder: threading.Thread | None = None

    # Replicas ------------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        name: str,
        config: ModelConfig,
        tokenizer_path: Path | None,
        *,
        stop: Callable[[], bool] = lambda: False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> FleetEngine:
        """A fleet with every replica that answers now, once at least one does (exponential
        back-off while none does, as ``RemoteEngine.connect``); the rest join when they answer.
        Raises ``ServerUnavailable`` when ``stop()`` turns true while waiting."""
        fleet = cls(name, config, tokenizer_path)
        wait = FIRST_BACKOFF_SECONDS
        while True:
            for url in candidates(config):
                fleet._try_join(url)
            fleet._take_joined()
            if fleet.replicas:
                break
            if stop():
                raise ServerUnavailable(f"no replica of {name} answers; stopping")
            log.warning("%s: no replica answers (%s); next look in %.1f s", name,
                        candidates(config), wait)  # fmt: skip
            sleep(wait)
            wait = min(wait * 2, MAX_BACKOFF_SECONDS)
        fleet.start_finding()
        return fleet

    def start_finding(self) -> None:
        """Look for replicas that joined (or came back) every ``discover_seconds``, on a thread
        of its own; they enter the fleet at the next ``step``."""
        self._finder = threading.Thread(target=self._find_forever, daemon=True,
                                        name=f"fleet-{self.model_name}")  # fmt: skip
        self._finder.start()

    def _find_forever(self) -> None:
        while not self._stop.wait(self.config.discover_seconds):
            for url in candidates(self.config):
                if url not in self.replicas and url not in self._probing:
                    self._try_join(url)

    def _try_join(self, url: str) -> None:
        self._probing.add(url)
        try:
            engine = self._build(url)
            if self._stop.is_set():  # the fleet closed while the replica answered
                engine.close()
                return
            self._joined.put(engine)
        except (httpx.HTTPError, ValueError, OSError) as exc:
            log.debug("%s: replica %s not joining: %s", self.model_name, url, exc)
            self._probing.discard(url)

    def _connect_replica(self, url: str) -> RemoteEngine:
        """A replica's engine, if it answers now. Raises ``httpx.HTTPError`` when it does not,
        ``ValueError`` when it does not serve the model."""
        with httpx.Client(base_url=url, timeout=PROBE_TIMEOUT_SECONDS) as client:
            models = served_models(client)
        if self.served_model_name not in models:
            raise ValueError(f"{url} serves {sorted(models)}, not {self.served_model_name!r}")
        one = self.config.model_copy(update={"url": url, "urls": [], "discover": False})
        max_len = int(models[self.served_model_name] or self.config.max_model_len)
        return RemoteEngine(self.model_name, one, self._tokenizer, max_len)

    def _take_joined(self) -> None:
        while True:
            try:
                engine = self._joined.get_nowait()
            except queue.Empty:
                return
            url = engine.base_url
            self._probing.discard(url)
            if url in self.replicas or self._stop.is_set():
                engine.close()
                continue
            if not self.replicas:
                self.max_model_len = engine.max_model_len
            self.max_model_len = min(self.max_model_len, engine.max_model_len)
            engine.set_max_in_flight(self.replica_room)
            self.replicas[url] = engine
            self.limits.setdefault(url, self.replica_room)
            self.sent_to.setdefault(url, 0)
            self.meter.add(url, engine.server_meter)
            log.info("%s: replica %s joined the fleet (%d replicas)", self.model_name, url,
                     len(self.replicas))  # fmt: skip

    def _lose(self, url: str, why: str) -> None:
        """Drop replica ``url``; its lines go back to the front of the queue, in order."""
        engine = self.replicas.pop(url)
        back = engine.take_unfinished()
        for request in back:
            self._where.pop(request.request_id, None)
        self._waiting.extendleft(reversed(back))
        self.meter.retire(url)
        self.limits.pop(url, None)
        engine.close()
        log.warning("%s: replica %s left the fleet (%s); %d lines go to the others",
                    self.model_name, url, why, len(back))  # fmt: skip

    def replica_urls(self) -> list[str]:
        return list(self.replicas)

    def replica_of(self, request_id: str) -> str | None:
        """The replica a line was sent to; ``None`` while it waits in the fleet."""
        return self._where.get(request_id)

    def set_replica_limits(self, limits: dict[str, int]) -> None:
        """Lines each replica may have from now on (a lane's decision); unknown URLs ignored."""
        for url, limit in limits.items():
            if url in self.replicas:
                self.limits[url] = max(0, int(limit))
        self._dispatch()

    # The engine ----------------------------------------------------------------------------

    @property
    def server_meter(self) -> FleetMeter:
        return self.meter

    def _any(self) -> RemoteEngine:
        if not self.replicas:
            raise EngineFault("no replica in the fleet", blameless=True)
        return next(iter(self.replicas.values()))

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        if self._tokenizer is not None:
            return self._tokenizer.encode_chat(messages, tools)
        return self._any().encode_chat(messages, tools)

    def encode_text(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            return self._tokenizer.encode_text(text)
        return self._any().encode_text(text)

    @property
    def vocab_size(self) -> int | None:
        """The local tokenizer's vocabulary; ``None`` without one (the servers check ids)."""
        return self._tokenizer.vocab_size if self._tokenizer is not None else None

    def add(self, request: EngineRequest) -> None:
        """Queue ``request`` for the replica with room. Raises ``ValueError`` for an id already
        in the fleet."""
        rid = request.request_id
        if rid in self._where or any(r.request_id == rid for r in self._waiting):
            raise ValueError(f"request {rid!r} is already in the engine")
        self._waiting.append(request)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._waiting:
            room = {u: self.limits.get(u, 0) - e.num_unfinished() for u, e in self.replicas.items()}
            url = max(room, key=lambda u: room[u], default=None)
            if url is None or room[url] <= 0:
                return
            request = self._waiting.popleft()
            self.replicas[url].add(request)
            self._where[request.request_id] = url
            self.sent_to[url] = self.sent_to.get(url, 0) + 1

    def step(self) -> list[EngineResult]:
        """Finished lines of every replica. A replica's blameless fault drops it (its lines to
        the others); raises ``EngineFault`` (blameless) once none is left, and any fault that
        may be a line's as it is."""
        self._take_joined()
        self._dispatch()
        results: list[EngineResult] = []
        for url, engine in list(self.replicas.items()):
            try:
                done = engine.step()
            except EngineFault as fault:
                if not fault.blameless:
                    raise
                self._lose(url, str(fault))
                continue
            for result in done:
                self._where.pop(result.request_id, None)
            results.extend(done)
        if not self.replicas and (self._waiting or self._where):
            raise EngineFault(
                f"every replica of {self.model_name} is away",
                [r.request_id for r in self._waiting],
                blameless=True,
            )
        self._dispatch()
        return results

    def abort(self, request_ids: list[str]) -> None:
        drop = set(request_ids)
        self._waiting = deque(r for r in self._waiting if r.request_id not in drop)
        by_replica: dict[str, list[str]] = {}
        for rid in drop:
            url = self._where.pop(rid, None)
            if url is not None:
                by_replica.setdefault(url, []).append(rid)
        for url, ids in by_replica.items():
            if url in self.replicas:
                self.replicas[url].abort(ids)
        self._dispatch()

    def num_unfinished(self) -> int:
        return len(self._waiting) + sum(e.num_unfinished() for e in self.replicas.values())

    def in_flight_ids(self) -> list[str]:
        return [rid for e in self.replicas.values() for rid in e.in_flight_ids()]

    def close(self) -> None:
        """Stop looking for replicas and close every one. Safe to call twice."""
        self._stop.set()
        for url in list(self.replicas):
            self.meter.retire(url)
            self.replicas.pop(url).close()
        self._take_joined()  # closes what joined meanwhile
        self._waiting.clear()
        self._where.clear()
