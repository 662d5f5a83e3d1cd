"""The remote engine's tokenizers: the model's own folder when there is one, else the server's.

Either way a prompt renders exactly as the in-process engine renders it, so a line costs the same
tokens on both engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from workers.engine.base import EngineFault
from workers.engine.chat_template import TemplateTokenizer, flatten_message
from workers.engine.remote_wire import VERDICTS, error_message


def local_tokenizer(path: Path) -> TemplateTokenizer:
    """The model's own tokenizer (a Hugging Face folder), rendering exactly as ``VllmEngine``."""
    from transformers import AutoTokenizer

    return TemplateTokenizer(AutoTokenizer.from_pretrained(str(path)))


class ServerTokenizer:
    """The server's ``/tokenize`` (one round trip per line), for a model without a local folder.

    Raises ``ValueError`` for messages the server's template refuses (its 400) and
    ``EngineFault`` (blameless) when the server cannot be reached: the chunk goes back unrun.
    """

    def __init__(self, client: httpx.Client, model: str) -> None:
        self._client = client
        self._model = model
        #: Unknown here: the server checks token ids (``logit_bias``) itself, a 400 verdict.
        self.vocab_size: int | None = None

    def _tokenize(self, body: dict[str, Any]) -> list[int]:
        try:
            response = self._client.post("/tokenize", json={"model": self._model, **body})
        except httpx.HTTPError as exc:
            raise EngineFault(f"/tokenize failed: {exc!r}", blameless=True) from exc
        if response.status_code in VERDICTS:
            raise ValueError(error_message(response))
        if response.status_code != 200:
            raise EngineFault(f"/tokenize answered {response.status_code}: {response.text[:200]}")
        return [int(t) for t in response.json()["tokens"]]

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        flat = [flatten_message(m) for m in messages]
        offered = {"tools": tools} if tools else {}
        return self._tokenize({"messages": flat, "add_generation_prompt": True, **offered})

    def encode_text(self, text: str) -> list[int]:
        return self._tokenize({"prompt": text, "add_special_tokens": True})

    def count(self, text: str) -> int:
        return len(self._tokenize({"prompt": text, "add_special_tokens": False}))
