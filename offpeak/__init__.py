"""Offpeak: the OpenAI Batch API on a self-hosted vLLM fleet's idle time."""

__version__ = "0.1.0"
