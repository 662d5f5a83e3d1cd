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

from offpeak.endpoints.tools import hermes_messages


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
        #: Token ids are ``0 .. vocab_size - 1`` (added tokens included).
        self.vocab_size: int = len(tokenizer)
        self._lock: AbstractContextManager[Any] = threading.Lock() if thread_safe else nullcontext()
        self._bos_id: int | None = tokenizer.bos_token_id
        probe = tokenizer.encode("a")
        self._adds_bos = self._bos_id is not None and bool(probe) and probe[0] == self._bos_id

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template, offering ``tools``.
        Raises ``ValueError`` for messages the template cannot render (missing role or content,
        non-text parts, a template error).

        A template that ignores tools (one that renders the same text with them as without
        them, or drops the calls of assistant turns; SmolLM2's) gets them the Hermes way instead
        (``hermes_messages``): a system block describing the tools, ``<tool_call>`` blocks in
        assistant turns, which the ``hermes`` tool parser reads back. Without it such a model
        would never hear of the tools. Rendering twice, rather than looking for the tools' names
        in the text, is not fooled by a name the conversation happens to say."""
        flat = [flatten_message(m) for m in messages]
        rendered = self._render(flat, tools)
        calls = any(m.get("tool_calls") for m in flat)
        if (tools or calls) and self._ignores_tools(flat, tools, rendered, calls):
            rendered = self._render(hermes_messages(flat, tools or []), None)
        with self._lock:
            ids = list(self.tokenizer.encode(rendered, add_special_tokens=False))
        if self._adds_bos and self._bos_id is not None and (not ids or ids[0] != self._bos_id):
            ids.insert(0, self._bos_id)
        return ids

    def _ignores_tools(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        rendered: str,
        calls: bool,
    ) -> bool:
        """Whether the template's ``rendered`` text leaves out the offered ``tools`` or the
        ``calls`` of assistant turns (each compared with a rendering without them)."""
        without_tools = self._render(messages, None) if tools else rendered
        if tools and without_tools == rendered:
            return True
        if not calls:
            return False
        stripped = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        return self._render(stripped, None) == without_tools

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        try:
            with self._lock:
                rendered = self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, tokenize=False, add_generation_prompt=True
                )
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors, KeyError/TypeError from odd messages
            raise ValueError(f"chat template cannot render these messages: {exc}") from exc
        if not isinstance(rendered, str):
            raise ValueError("chat template did not render to text")
        return rendered

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt, with the tokenizer's BOS if it adds one."""
        with self._lock:
            return list(self.tokenizer.encode(text))

    def count(self, text: str) -> int:
        """Tokens of ``text`` without special tokens (a completion's length)."""
        with self._lock:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
