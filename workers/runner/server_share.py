"""Engine seconds of a co-served batch: our share of a shared server's time.

An in-process engine is ours alone, so a write-back period's engine seconds are the seconds the
runner spent stepping it. A remote engine's server also runs other people's requests (the
real-time traffic), so a period's engine seconds are

    busy wall seconds × min(1, our weighted tokens ÷ the server's weighted tokens)

where *busy wall seconds* are the period's wall seconds during which at least one of our
requests was at the server, *the server's tokens* are what its Prometheus counters
(``vllm:prompt_tokens_total``, ``vllm:prompt_tokens_cached_total``,
``vllm:generation_tokens_total``) grew by in those seconds, for everyone, and *our tokens* are
those of the lines written back in the period; both weighed as the ledger weighs them
(``offpeak.billing.TokenWeights``: ``prefill × (prompt − cached) + cached × cached + decode ×
completion``). The ledger then splits each period's seconds over its batches by the same weights
(``storage.repositories.billing``), so a batch is charged wall seconds × its weighted tokens ÷ all
the server processed, and the batches' shares add up to the period's seconds as before.

Our tokens count when a line finishes, the server's as it computes them: a period in which many
long lines finish can hold more of ours than the server counted in it. The excess carries to the
next period (``carry``), so, alone on a server, the seconds charged add up to the busy wall
seconds. Tokens of lines aborted at the server (yields, cancels) are in the server's counts and
no batch's: those seconds are charged to nobody, as the server's other users' time is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from offpeak.billing import TokenWeights
from storage.repositories.engine_chunks import BatchTokens
from workers.engine.remote_meter import ServerUsage
from workers.vllm_metrics import ServerTokens

log = logging.getLogger(__name__)


class UsageMeter(Protocol):
    """What the share reads: ``workers.engine.remote_meter.ServerMeter``."""

    def usage(self) -> ServerUsage: ...


def weighted_tokens(prompt: float, cached: float, completion: float, w: TokenWeights) -> float:
    """The ledger's weight of these tokens (``storage.repositories.billing``)."""
    return (prompt - cached) * w.prefill + cached * w.cached + completion * w.decode


def server_weight(tokens: ServerTokens, w: TokenWeights) -> float:
    return weighted_tokens(tokens.prompt, tokens.cached, tokens.generation, w)


class ServerShare:
    """One runner's share of a shared server, period by period.

    ``seconds(per_batch)`` prices the period since the last commit; ``commit()`` (after the
    write-back stored it) starts the next one. A write-back that fails leaves the period open,
    so the next one covers both.
    """

    def __init__(self, meter: UsageMeter, weights: TokenWeights) -> None:
        self.meter = meter
        self.weights = weights
        self._committed = meter.usage()
        #: Our weighted tokens not yet matched by the server's (see the module docstring).
        self.carry = 0.0
        self._open: tuple[ServerUsage, float] | None = None
        self._warned = False

    def seconds(self, per_batch: Mapping[str, BatchTokens]) -> float:
        """Engine seconds of the lines ``per_batch`` (this period's finished tokens)."""
        now = self.meter.usage()
        period = now.since(self._committed)
        ours = self.carry + sum(
            weighted_tokens(t.prompt_tokens, t.cached_tokens, t.completion_tokens, self.weights)
            for t in per_batch.values()
        )
        theirs = server_weight(period.tokens, self.weights)
        if theirs > 0:
            fraction = min(1.0, ours / theirs)
            carry = max(0.0, ours - theirs)
        else:
            # Busy seconds without counts: the server's /metrics could not be read (or weighs
            # nothing). All of the busy time is charged rather than none of it.
            fraction, carry = (1.0 if ours > 0 else 0.0), 0.0
            if period.busy_seconds > 0 and not self._warned:
                self._warned = True
                log.warning(
                    "no server token counts for %.1f busy s: charged in full", period.busy_seconds
                )
        self._open = (now, carry)
        return period.busy_seconds * fraction

    def commit(self) -> None:
        """The period priced by the last ``seconds`` was stored: the next starts where it ended."""
        if self._open is not None:
            self._committed, self.carry = self._open
            self._open = None
