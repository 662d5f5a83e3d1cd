"""Prices: what a batch's engine time cost us, what we bill for its tokens, and what the same
tokens would cost at the real-time list price. Pure arithmetic on settings, used by both the API
(live figures on a running batch, usage) and the workers (the ledger); amounts in US dollars.

- cost = Σ over worker pools of attributed engine seconds × that pool's dollars per hour / 3600
- real-time price = uncached input × input list price + cached input × cached list price
  + output × output list price, each per million tokens
- price billed = real-time price × (1 − batch discount); saving = real-time price − price billed
- cost per million tokens = cost / (input + output tokens) × 1e6
- engine seconds are attributed to batches by weighted tokens (``TokenWeights``; the rule is in
  ``storage.repositories.billing``)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from offpeak.settings import ModelPricing, Settings

#: Digits kept for dollar amounts (the ledger stores 10).
MONEY_DIGITS = 10
#: Significant digits shown for an amount under one dollar (``format_usd``).
SHOWN_DIGITS = 3
_NO_PRICES = ModelPricing()


def cost_per_million_tokens(cost: float, tokens: int) -> float | None:
    """Dollars per million (prompt + completion) tokens; ``None`` before any token. The one
    rule behind every "cost / 1M tokens" figure (a batch's, ``GET /v1/usage``, the dashboard's
    cards, the CLI), so they agree for the same engine time and tokens.

    ``cost`` is taken at the ledger's resolution (``MONEY_DIGITS``) first: a bill's cost is
    stored rounded, while the dashboard sums its engines' seconds unrounded, and a difference
    below that resolution must not move the figure across a shown digit ($0.152 against
    $0.153)."""
    if tokens <= 0:
        return None
    return round(round(cost, MONEY_DIGITS) / tokens * 1e6, MONEY_DIGITS)


def format_usd(amount: float | None) -> str:
    """A dollar amount as people read it, never in scientific notation: ``$1,234.50`` from one
    dollar up, ``SHOWN_DIGITS`` significant digits in fixed point below (``$0.0000474`` for
    4.73535e-05), ``$0`` for zero and ``-`` for ``None``. Every amount the CLI prints and the
    dashboard shows (its data carries these strings) goes through here."""
    if amount is None:
        return "-"
    if amount == 0:
        return "$0"
    sign = "-" if amount < 0 else ""
    value = abs(amount)
    if value >= 1:
        return f"{sign}${value:,.2f}"
    decimals = SHOWN_DIGITS - 1 - math.floor(math.log10(value))
    # 0.0009996 rounds up to 0.001: count the digits from the rounded value ($0.00100).
    decimals = SHOWN_DIGITS - 1 - math.floor(math.log10(round(value, decimals)))
    shown = f"{value:.{decimals}f}"
    return f"{sign}${shown}"


@dataclass(frozen=True)
class TokenWeights:
    """Engine-time weight of one uncached prompt token, one cached prompt token and one
    completion token (only their ratios matter)."""

    prefill: float = 1.0
    cached: float = 0.0
    decode: float = 1.0


def token_weights(settings: Settings) -> TokenWeights:
    """The attribution weights of prefill, cached and decode tokens (settings)."""
    return TokenWeights(
        settings.prefill_token_weight, settings.cached_token_weight, settings.decode_token_weight
    )


@dataclass(frozen=True)
class Bill:
    """A batch's figures: engine seconds, our cost, the price billed and the real-time price.

    ``billed_at`` (unix seconds) is set when the figures come from the ledger and are final;
    ``None`` means a live estimate for a batch that has not ended (or not been billed yet).
    """

    gpu_seconds: float
    cost: float
    price: float
    realtime_price: float
    tokens: int
    billed_at: float | None = None

    @property
    def saving(self) -> float:
        return round(self.realtime_price - self.price, MONEY_DIGITS)

    @property
    def cost_per_million_tokens(self) -> float | None:
        """Our cost per million (input + output) tokens; ``None`` before any token."""
        return cost_per_million_tokens(self.cost, self.tokens)


def gpu_cost_per_hour(settings: Settings, model: str | None, device: str) -> float:
    """Dollars per hour of engine time for ``model`` on worker pool ``device``: the model's own
    pool price, else its ``default``, else the fleet's pool price, else the fleet's ``default``
    (0 if none is set)."""
    own = settings.pricing.get(model or "", _NO_PRICES).gpu_cost_per_hour
    for table in (own, settings.gpu_cost_per_hour):
        if device in table:
            return table[device]
        if "default" in table:
            return table["default"]
    return 0.0


def realtime_price(
    settings: Settings, model: str | None, input_tokens: int, cached_tokens: int, output_tokens: int
) -> float:
    """The same tokens at the model's real-time list prices, in dollars."""
    prices = settings.pricing.get(model or "", _NO_PRICES)
    cached_rate = (
        prices.input_per_million
        if prices.cached_input_per_million is None
        else prices.cached_input_per_million
    )
    total = (
        (input_tokens - cached_tokens) * prices.input_per_million
        + cached_tokens * cached_rate
        + output_tokens * prices.output_per_million
    ) / 1e6
    return round(total, MONEY_DIGITS)


def batch_discount(settings: Settings, model: str | None) -> float:
    own = settings.pricing.get(model or "", _NO_PRICES).batch_discount
    return settings.batch_discount if own is None else own


def bill(
    settings: Settings,
    model: str | None,
    seconds_by_pool: Mapping[str, float],
    input_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    billed_at: float | None = None,
) -> Bill:
    """Price a batch from its attributed engine seconds per worker pool and its billed tokens."""
    cost = sum(
        seconds * gpu_cost_per_hour(settings, model, pool) / 3600
        for pool, seconds in seconds_by_pool.items()
    )
    listed = realtime_price(settings, model, input_tokens, cached_tokens, output_tokens)
    return Bill(
        gpu_seconds=sum(seconds_by_pool.values()),
        cost=round(cost, MONEY_DIGITS),
        price=round(listed * (1 - batch_discount(settings, model)), MONEY_DIGITS),
        realtime_price=listed,
        tokens=input_tokens + output_tokens,
        billed_at=billed_at,
    )
