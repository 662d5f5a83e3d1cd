"""Test doubles for the scheduler tests: a real HTTP endpoint serving Prometheus text whose
values a test changes, and engines that decode over several steps on a virtual clock (a runner
given the same clock, ``Runner(..., clock=engine.clock)``, lives in that time: no test waits
for a step or a poll interval, as ``offpeak simulate day`` does not)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workers.planner import StepModel
from workers.scheduler.clock import VirtualClock
from workers.sim.engine import SimEngine


class MetricsEndpoint:
    """``/metrics`` of a pretend real-time vLLM server, on 127.0.0.1 at a free port.

    Set ``running``, ``waiting`` and ``kv`` (0-1) at any time; ``status`` other than 200 makes
    the endpoint fail. Two label sets are exposed per metric (two engines), as a server with
    data parallelism does: the signal must sum the counts and take the fuller KV cache.
    """

    def __init__(self) -> None:
        self.running = 0.0
        self.waiting = 0.0
        self.kv = 0.0
        self.status = 200
        self.scrapes = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                endpoint.scrapes += 1
                body = endpoint.text().encode()
                self.send_response(endpoint.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        # A short poll: ``close`` waits up to one poll interval for the serving thread.
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def set(self, running: float = 0.0, waiting: float = 0.0, kv: float = 0.0) -> None:
        self.running, self.waiting, self.kv = running, waiting, kv

    def text(self) -> str:
        half_running, half_waiting = self.running / 2, self.waiting / 2
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="rt"}} {half_running}\n'
            f'vllm:num_requests_running{{engine="1",model_name="rt"}} {half_running}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="rt"}} {half_waiting}\n'
            f'vllm:num_requests_waiting{{engine="1",model_name="rt"}} {half_waiting}\n'
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="rt"}} {self.kv}\n'
            f'vllm:kv_cache_usage_perc{{engine="1",model_name="rt"}} {self.kv / 2}\n'
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
            "# TYPE vllm:prompt_tokens_total counter\n"
            'vllm:prompt_tokens_total{engine="0",model_name="rt"} 12345.0\n'
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def metrics_endpoint() -> Iterator[MetricsEndpoint]:
    endpoint = MetricsEndpoint()
    try:
        yield endpoint
    finally:
        endpoint.close()


def decoding_engine(
    model: str,
    max_num_seqs: int = 16,
    kv_cache_tokens: int = 100_000,
    base_ms: float = 0.0,
    per_seq_ms: float = 0.0,
) -> SimEngine:
    """An engine that runs like vLLM does: at most ``max_num_seqs`` sequences at once, each
    finishing after ``max_tokens`` steps, a step costing ``base_ms + per_seq_ms × running`` on
    its virtual clock (``engine.clock``, starting now), which moves only when it steps or a
    runner on the same clock waits. It reports a KV cache of ``kv_cache_tokens`` for the
    sizing."""
    clock = VirtualClock(time.time())
    engine = SimEngine(
        clock,
        StepModel(base_ms, per_seq_ms),
        max_num_seqs=max_num_seqs,
        kv_cache_tokens=kv_cache_tokens,
        max_model_len=4096,
    )
    engine.model_name = model
    return engine
