"""What the runner counts: a run's totals (``DrainStats``) and its engine's recent tokens/s
(``TokenRate``, which the slack estimates prefer to the step model once it is trusted)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Seconds of engine stepping over which the runner's own tokens/s is averaged, and the least
#: it must have stepped before that rate is trusted.
RATE_SECONDS = 300.0
RATE_TRUSTED_AFTER = 30.0


@dataclass
class DrainStats:
    """What one ``Runner.run`` did."""

    #: Claims that returned lines.
    chunks: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    #: Wall (or virtual) seconds of the run, and of them the seconds spent in ``engine.step``.
    seconds: float = 0.0
    busy_seconds: float = 0.0
    yields: int = 0
    #: Running sequences aborted on a yield, and queued lines handed back unrun.
    aborted: int = 0
    released: int = 0
    #: ``drained`` (nothing runnable left), ``yielded`` (load or a pause stopped it with work
    #: left) or ``stopped`` (the caller's ``until``, or the worker shutting down: its lines went
    #: back to pending).
    outcome: str = ""
    touched: set[str] = field(default_factory=set)

    @property
    def prefix_hit_rate(self) -> float:
        """``cached_tokens / prompt_tokens`` of the requests that finished."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def count(self, requests: int, prompt: int, cached: int, completion: int) -> None:
        """Add ``requests`` answered lines and their tokens."""
        self.requests += requests
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion


class TokenRate:
    """Tokens generated per second stepped, decayed over ``RATE_SECONDS`` of stepping."""

    def __init__(self) -> None:
        self._tokens = self._seconds = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        """Count ``tokens`` generated in a step of ``seconds``."""
        keep = math.exp(-seconds / RATE_SECONDS)
        self._tokens = self._tokens * keep + tokens
        self._seconds = self._seconds * keep + seconds

    @property
    def per_second(self) -> float | None:
        """Tokens/s, once ``RATE_TRUSTED_AFTER`` seconds were stepped; ``None`` before."""
        if self._seconds < RATE_TRUSTED_AFTER:
            return None
        return self._tokens / self._seconds
