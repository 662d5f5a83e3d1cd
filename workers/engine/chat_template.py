"""Prompt token ids from a Hugging Face tokenizer, by one set of rules for every user of them: the
in-process vLLM engine, the remote engine's local tokenizer and the control worker's cost
estimate (``workers.estimate``). The same line must give the same ids in all three, or the
estimate and the remote engine's prefix-cache hits would differ from the engine's.

No vLLM import here: the control worker tokenizes for estimates without loading an engine.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any


def flatten_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with list content (OpenAI's ``[{"type": "text", "text": …}]`` parts) joined
    into one string, as chat templates expect. Raises ``ValueError`` for a non-text part."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts are supported, not {kind!r}")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "".join(texts)}


class TemplateTokenizer:
    """``encode_chat`` / ``encode_text`` / ``count`` on a Hugging Face tokenizer.

    Chat: the template rendered as text with the assistant's generation prompt, encoded without
    the tokenizer's own special tokens (the template writes them as text; adding them again put
    a second BOS in front with Llama 3 style templates), and the BOS put in front only when the
    tokenizer adds one to plain text and the template did not write it (SmolLM2's adds none).
    ``thread_safe``: serialize calls (Hugging Face fast tokenizers are not safe across threads;
    the control worker estimates from several).
    """

    def __init__(self, tokenizer: Any, *, thread_safe: bool = False) -> None:
        self.tokenizer = tokenizer
        self._lock: AbstractContextManager[Any] = threading.Lock() if thread_safe else nullcontext()
        self._bos_id: int | None = tokenizer.bos_token_id
        probe = tokenizer.encode("a")
        self._adds_bos = self._bos_id is not None and bool(probe) and probe[0] == self._bos_id

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template. Raises ``ValueError`` for
        messages the template cannot render (missing role or content, non-text parts, a
        template error)."""
        try:
            with self._lock:
                rendered = self.tokenizer.apply_chat_template(
                    [flatten_message(m) for m in messages],
                    tokenize=False,
                    add_generation_prompt=True,
                )
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors, KeyError/TypeError from odd messages
            raise ValueError(f"chat template cannot render these messages: {exc}") from exc
        if not isinstance(rendered, str):
            raise ValueError("chat template did not render to text")
        with self._lock:
            ids = list(self.tokenizer.encode(rendered, add_special_tokens=False))
        if self._adds_bos and self._bos_id is not None and (not ids or ids[0] != self._bos_id):
            ids.insert(0, self._bos_id)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt, with the tokenizer's BOS if it adds one."""
        with self._lock:
            return list(self.tokenizer.encode(text))

    def count(self, text: str) -> int:
        """Tokens of ``text`` without special tokens (a completion's length)."""
        with self._lock:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
