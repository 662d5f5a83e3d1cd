"""Hosts on a virtual network of the test's own: each host a network namespace (``ip netns``)
joined by a veth pair to a bridge in this namespace, which holds the network's first address
(where the test's servers listen). A host runs ``python -m offpeak …`` processes under its own
hostname (a UTS namespace: worker ids and leases name the host), with its own data, temp and
home folders, so nothing is shared but the network. Its link can be cut (``ip link set … down``:
packets are dropped, connections hang, as when a host vanishes) and restored.

Needs root and ``ip``/``unshare``; ``virtual_network`` skips with the reason otherwise. Every
namespace, link and process is removed when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Host:
    """One host: namespace ``namespace``, address ``address``, hostname ``name``, folders under
    ``root``; ``link`` is the veth end on the bridge's side."""

    def __init__(self, name: str, namespace: str, link: str, address: str, root: Path) -> None:
        self.name, self.namespace, self.link, self.address = name, namespace, link, address
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def env(self) -> dict[str, str]:
        """The host's own folders: data dir, temp dir, home and model cache."""
        folders = {k: self.root / k for k in ("data", "tmp", "home", "models")}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        return {
            "OFFPEAK_DATA_DIR": str(folders["data"]),
            "TMPDIR": str(folders["tmp"]),
            "HOME": str(folders["home"]),
            "OFFPEAK_MODEL_CACHE_DIR": str(folders["models"]),
        }

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """``python -m offpeak <args>`` in the host's namespaces; its log: ``<root>/<name>.log``."""
        command = [
            "ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c",
            f'hostname {self.name} && exec "$@"', "sh", sys.executable, "-m", "offpeak", *args,
        ]  # fmt: skip
        full_env = {**os.environ, **env, **self.env()}
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                command, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def tail(self, name: str, lines: int = 60) -> str:
        path = self.root / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}/{name} exited with {proc.returncode}:\n{self.tail(name)}"
                )

    def cut(self) -> None:
        """The host's cable pulled: its packets are dropped from now on."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


class VirtualNetwork:
    """A bridge with address ``gateway`` (``10.213.<n>.1/24``) and the hosts added to it."""

    def __init__(self, root: Path) -> None:
        self.tag = f"{os.getpid() % 10000:04d}"
        taken = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
        choices = [n for n in range(100, 250) if f"10.213.{n}." not in taken]
        self.prefix = f"10.213.{random.choice(choices)}"
        self.gateway = f"{self.prefix}.1"
        self.bridge = f"ofb{self.tag}"
        self.root = root
        self.hosts: list[Host] = []

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        index = len(self.hosts)
        host = Host(
            name,
            namespace=f"ofp{self.tag}-{name}",
            link=f"ofv{self.tag}h{index}",
            address=f"{self.prefix}.{10 + index}",
            root=self.root / name,
        )
        self.hosts.append(host)
        inner = f"ofv{self.tag}n{index}"
        _ip("netns", "add", host.namespace)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", host.namespace)
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", inner)
        _ip("-n", host.namespace, "link", "set", inner, "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        return host

    def destroy(self) -> None:
        for host in self.hosts:
            host.stop()
        for host in self.hosts:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", host.namespace)  # its veth pair goes with it
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)


@contextlib.contextmanager
def virtual_network(root: Path) -> Iterator[VirtualNetwork]:
    """A virtual network, removed afterwards with its hosts; skips where namespaces cannot be
    made (not root, no ``ip``, a container without ``CAP_SYS_ADMIN``)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    network = VirtualNetwork(root)
    try:
        network.create()
        probe = network.add_host("probe")
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        network.destroy()
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"cannot make network namespaces here: {detail}")
    network.hosts.remove(probe)
    _ip("netns", "del", probe.namespace)
    try:
        yield network
    finally:
        network.destroy()
