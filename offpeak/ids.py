"""Identifiers in OpenAI's shapes (``file-…``, ``batch_…``, ``batch_req_…``) and clocks."""

from __future__ import annotations

import secrets
import time


def new_id(prefix: str) -> str:
    """``prefix`` + 13 hex digits of the creation time in microseconds + 11 random hex digits.

    Ids of one prefix therefore sort in creation order, which list pagination relies on
    (``ORDER BY id``, ``after=<id>``), as ULIDs do.
    """
    return f"{prefix}{time.time_ns() // 1000:013x}{secrets.token_hex(6)[:11]}"


def now() -> int:
    """Unix seconds, as the API shows times."""
    return int(time.time())
