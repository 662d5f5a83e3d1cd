"""What a served model's tokens are worth and what its engine time costs
(``Settings.pricing``, ``OFFPEAK_PRICING``; ``offpeak.billing`` computes the figures).
``offpeak.settings`` re-exports ``ModelPricing``."""

from __future__ import annotations

from pydantic import BaseModel, Field

from offpeak.model_config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL


class ModelPricing(BaseModel):
    """What one model's tokens are worth and what its engine time costs, in US dollars.

    List prices are the real-time (non-batch) prices per million tokens that the batch price is a
    discount of; ``gpu_cost_per_hour`` maps a worker pool (an engine chunk's ``device``: ``cpu`` or
    the GPU's name, or ``default``) to dollars per hour of engine time for this model and, where
    it has a pool, overrides ``Settings.gpu_cost_per_hour``.
    """

    input_per_million: float = Field(
        default=0.0, description="List price of a million prompt tokens, in US dollars."
    )
    cached_input_per_million: float | None = Field(
        default=None,
        description="Prompt tokens served from the prefix cache; ``None``: the input price.",
    )
    output_per_million: float = Field(
        default=0.0, description="List price of a million completion tokens, in US dollars."
    )
    batch_discount: float | None = Field(
        default=None,
        description="Overrides ``Settings.batch_discount`` for this model (0.5 = half price).",
    )
    gpu_cost_per_hour: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Dollars per hour of engine time for this model per worker pool (``cpu``, the "
            "GPU's name or ``default``); where it has the pool, it overrides "
            "``Settings.gpu_cost_per_hour``."
        ),
    )


def default_pricing() -> dict[str, ModelPricing]:
    """``Settings.pricing`` when unset: list prices of the two default models."""
    # Placeholders of the right order for a 135M model sold by a hosted API; set your own.
    return {
        DEFAULT_MODEL: ModelPricing(input_per_million=0.10, output_per_million=0.20),
        # An embedding model's tokens are input only (OpenAI's small embedding model: $0.02).
        DEFAULT_EMBEDDING_MODEL: ModelPricing(input_per_million=0.02),
    }
