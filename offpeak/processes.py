"""Start the API and workers as child processes (used by ``offpeak demo``, the end-to-end tests
and the benchmarks), with their logs in files and a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServiceProcesses:
    """The API, a control worker and an engine worker, sharing one environment."""

    def __init__(
        self,
        env: dict[str, str],
        port: int,
        log_dir: Path,
        roles: tuple[str, ...] = ("control", "engine"),
    ) -> None:
        self.env = {**os.environ, **env}
        self.port = port
        self.log_dir = log_dir
        self.roles = roles
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "offpeak", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "offpeak", "migrate"],
            env=self.env,
            check=True,
            capture_output=True,
        )
        self._spawn("api", ["serve", "--port", str(self.port)])
        for role in self.roles:
            self.start_worker(role)

    def start_worker(self, role: str, name: str | None = None) -> None:
        self._spawn(name or role, ["worker", "--role", role])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_http(self, timeout: float = 60) -> None:
        """Wait until the API answers ``/healthz``; raises ``TimeoutError`` with its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"API not up after {timeout} s:\n{self.tail('api')}")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
