"""The scheduler's shared state: the keys of the ``scheduler_state`` table and what their values
mean, for everyone who writes or reads them (the admin switch in ``storage.repositories.scheduler``,
the workers' load readings, ``/metrics``, the dashboard, the admin view).

Keys:

- ``paused``: the admin switch for every pool (``*``); ``paused:<pool>``: for one worker pool.
  Value ``{"paused": bool, "hard": bool, "reason": str | None, "at": unix seconds}``.
- ``load:<pool>``: the pool's last load reading (``workers.scheduler.signals.LoadReading``),
  ``{"load": float | None, "parts", "errors", "paused", "hard", "reason", "gate_open",
  "worker", ...}``.
- ``replicas:<model>``: the engines the model's running batches need to finish before their
  deadlines (``workers.scheduler.slack.replicas_needed``, stored by the control worker's sweep),
  ``{"replicas": int, "remaining_tokens", "engine_tokens_per_second", "workers", "at"}``.

Values are read leniently (``paused_of``, ``load_of``): a bare boolean or number, or an object
with the field (or a ``value`` member), so a hand-written row does not break a scrape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: The pool name meaning every pool (``offpeak pause --pool '*'``, ``{"pool": "*"}``).
ALL_POOLS = "*"
#: The key of the switch for every pool, and the prefix of one pool's switch.
PAUSE_ALL_KEY = "paused"
PAUSE_PREFIX = "paused:"
LOAD_PREFIX = "load:"
REPLICAS_PREFIX = "replicas:"


def pause_key(pool: str | None) -> str:
    """The key of the pause switch of ``pool``; ``None``, ``""`` or ``"*"``: every pool."""
    return PAUSE_ALL_KEY if pool in (None, "", ALL_POOLS) else f"{PAUSE_PREFIX}{pool}"


def load_key(pool: str) -> str:
    """The key of ``pool``'s last load reading."""
    return f"{LOAD_PREFIX}{pool}"


def replicas_key(model: str) -> str:
    """The key of the replicas ``model``'s backlog needs."""
    return f"{REPLICAS_PREFIX}{model}"


@dataclass(frozen=True)
class StateKey:
    """A parsed key: a pause switch or a load reading, and its pool (``*``: every pool)."""

    kind: Literal["pause", "load"]
    pool: str


def parse_key(key: str) -> StateKey | None:
    """What ``key`` holds; ``None`` for a key that is neither a switch nor a load reading."""
    if key == PAUSE_ALL_KEY:
        return StateKey("pause", ALL_POOLS)
    if key.startswith(PAUSE_PREFIX):
        return StateKey("pause", key.removeprefix(PAUSE_PREFIX))
    if key.startswith(LOAD_PREFIX):
        return StateKey("load", key.removeprefix(LOAD_PREFIX))
    return None


def paused_of(value: Any) -> bool:
    """The switch in a stored value: a boolean, or the ``paused`` (else ``value``) member of an
    object."""
    if isinstance(value, dict):
        value = value.get("paused", value.get("value"))
    return bool(value)


def load_of(value: Any) -> float | None:
    """The load in a ``load:<pool>`` value: a number, or the ``load`` (else ``value``) member of
    an object; ``None`` if there is none."""
    if isinstance(value, dict):
        value = value.get("load", value.get("value"))
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def pause_value(hard: bool, reason: str | None, at: float) -> dict[str, Any]:
    """The value stored for a switch that is on (``at``: unix seconds)."""
    return {"paused": True, "hard": hard, "reason": reason, "at": at}


@dataclass(frozen=True)
class PauseState:
    """The admin switch as a worker pool sees it."""

    paused: bool = False
    #: A hard pause stops urgent batches too (windows may then be missed).
    hard: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class PauseSwitch:
    """One switch as stored: its pool (``*``: every pool), whether it is on, and when it was last
    set (unix seconds; ``None`` if unknown)."""

    pool: str
    paused: bool
    hard: bool
    reason: str | None
    updated_at: float | None

    @classmethod
    def of(cls, pool: str, value: Any, updated_at: float | None) -> PauseSwitch:
        """The switch of ``pool`` from its stored value."""
        fields = value if isinstance(value, dict) else {}
        return cls(
            pool=pool,
            paused=paused_of(value),
            hard=bool(fields.get("hard")),
            reason=fields.get("reason"),
            updated_at=updated_at,
        )


def pause_for(states: Mapping[str, Any], pool: str) -> PauseState:
    """The switch that applies to ``pool`` given ``key → value`` states: a pause of every pool
    or of this one (a hard one wins; reasons joined with ``; ``)."""
    found = [
        value
        for value in (states.get(PAUSE_ALL_KEY), states.get(pause_key(pool)))
        if paused_of(value)
    ]
    if not found:
        return PauseState()
    objects = [v for v in found if isinstance(v, dict)]
    return PauseState(
        paused=True,
        hard=any(bool(v.get("hard")) for v in objects),
        reason="; ".join(str(v["reason"]) for v in objects if v.get("reason")) or None,
    )


def pauses(states: Mapping[str, Any]) -> dict[str, bool]:
    """``pool → paused`` of the switches in ``key → value`` states; ``*`` (every pool) always
    present."""
    out = {ALL_POOLS: paused_of(states.get(PAUSE_ALL_KEY))}
    for key, value in states.items():
        parsed = parse_key(key)
        if parsed is not None and parsed.kind == "pause" and parsed.pool != ALL_POOLS:
            out[parsed.pool] = paused_of(value)
    return out


def loads(states: Mapping[str, Any]) -> dict[str, float | None]:
    """``pool → load`` of the load readings in ``key → value`` states (``None``: no number)."""
    out = {}
    for key, value in states.items():
        parsed = parse_key(key)
        if parsed is not None and parsed.kind == "load":
            out[parsed.pool] = load_of(value)
    return out


def replicas(states: Mapping[str, Any]) -> dict[str, int]:
    """``model → replicas needed`` of the ``replicas:<model>`` entries in ``key → value`` states
    (a value without a whole number is left out)."""
    out = {}
    for key, value in states.items():
        if not key.startswith(REPLICAS_PREFIX):
            continue
        count = value.get("replicas", value.get("value")) if isinstance(value, dict) else value
        if isinstance(count, int | float) and not isinstance(count, bool):
            out[key.removeprefix(REPLICAS_PREFIX)] = int(count)
    return out
