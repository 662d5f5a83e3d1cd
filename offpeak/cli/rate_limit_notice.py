"""The CLI's ``openai`` client, which says on stderr each time the server rate-limits it.

The SDK retries a 429 on its own, silently, after the server's ``Retry-After``; a person at the
terminal then sees a command that stalls for no reason. An ``httpx`` response hook on the SDK's
own HTTP client sees every 429 and prints the wait, and leaves the retrying to the SDK.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import openai
from openai import OpenAI

# The SDK honours a server's Retry-After up to this many seconds and gives up past it
# (openai._constants.MAX_RETRY_AFTER_DELAY, read by _base_client._should_retry).
SDK_MAX_RETRY_AFTER_S = 120.0


def retry_after_seconds(headers: object) -> float | None:
    """Seconds the server asked the client to wait: ``retry-after-ms`` / 1000, else a numeric
    ``retry-after``, as the SDK reads them; None when neither is a number."""
    get = getattr(headers, "get", None)
    if get is None:
        return None
    for header, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = get(header)
        if value is None:
            continue
        try:
            delay = float(value) / divisor
        except ValueError:
            continue
        if math.isfinite(delay):
            return delay
    return None


def wait_line(retry_after: float | None) -> str:
    """The sentence for one 429 the SDK will retry: the wait it takes first (the server's
    Retry-After, or its own back-off when the server named none it honours)."""
    if retry_after is None or not 0 < retry_after <= SDK_MAX_RETRY_AFTER_S:
        return "rate-limited by the server: retrying after a short back-off"
    shown = f"{retry_after:g}" if retry_after < 10 else f"{round(retry_after)}"
    return f"rate-limited by the server: retrying in {shown} s (Retry-After)"


def sdk_retries(response: object, max_retries: int) -> bool:
    """Whether the SDK retries this 429, by its own rules (``_base_client._should_retry``):
    retries left (the ``x-stainless-retry-count`` it puts on each attempt, 0 on the first,
    against ``max_retries``), no Retry-After past its ceiling, and no ``x-should-retry:
    false`` (which a quota's 429 carries: no wait frees a quota)."""
    request = getattr(response, "request", None)
    try:
        taken = int(getattr(request, "headers", {}).get("x-stainless-retry-count", "0"))
    except ValueError:
        taken = 0
    headers = getattr(response, "headers", {})
    retry_after = retry_after_seconds(headers)
    if taken >= max_retries or (retry_after is not None and retry_after > SDK_MAX_RETRY_AFTER_S):
        return False
    return headers.get("x-should-retry") != "false"


def say_each_rate_limit(max_retries: int, say: Callable[[str], None]) -> Callable[..., None]:
    """An ``httpx`` response hook that calls ``say`` with ``wait_line`` for each 429 the SDK
    will retry; a 429 it gives up on is left to the error the command then prints."""

    def hook(response: object) -> None:
        if getattr(response, "status_code", None) == 429 and sdk_retries(response, max_retries):
            say(wait_line(retry_after_seconds(getattr(response, "headers", None))))

    return hook


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def client(base_url: str, api_key: str, say: Callable[[str], None] = _to_stderr) -> OpenAI:
    """An ``openai.OpenAI`` for ``base_url`` whose HTTP client (the SDK's default one, with its
    timeouts and pool) calls ``say`` for each 429 it receives; retries stay the SDK's."""
    hook = say_each_rate_limit(openai.DEFAULT_MAX_RETRIES, say)
    http_client = openai.DefaultHttpxClient(event_hooks={"response": [hook]})
    return OpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=openai.DEFAULT_MAX_RETRIES,
        http_client=http_client,
    )
