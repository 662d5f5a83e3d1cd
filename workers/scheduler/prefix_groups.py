"""A request line's prefix group: lines whose prompts start alike get the same number, so the
claim, which takes lines in (deadline, prefix group, id) order, hands the engine a group's lines
together while their shared prefix is in its KV cache (vLLM's automatic prefix caching).

Computed at validation from the line's body, without a tokenizer (the control worker has none,
and tokenizing every line of a 50,000-line file would cost more than the rest of validation): the
prompt is cut at two boundaries that chat files share in practice, and the two parts' hashes
make one ordered key.

- The *context*: everything rendered before the last message (``instructions``, ``tools``, the
  earlier messages: a system prompt, a few-shot conversation): the high 31 bits.
- The *stem*: the last message up to its last line break (a document, a schema, a form before
  the question under it): the low 32 bits.

Each part is its length's rank, longest first (``_LENGTH_BITS``: a third of an octave of bytes
per rank), above its hash. Sorting by the key keeps lines of one context together and, within
them, lines of one stem together (a trie of depth two), and takes the longest shared prefix
first: the longest contexts, and within a context the longest stems. The length is the line's
own, and the group's shared prefix by construction (its lines agree on both parts), so every
line's key is known as it is read; a group's *size* (how many lines) is known only once the
file is whole, after its rows were copied in, and rewriting every row's key then would double
intake's writes. The text, not tokens: equal text renders to equal tokens, and a
prefix shorter than the engine's KV block (32 tokens on a CPU) groups lines without a hit, which
costs nothing. Source of the rule (whole-workload prefix grouping before the engine): BatchLLM,
Zheng et al., MLSys 2026.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import orjson

#: The key of a line with nothing to group by (no prompt this module reads).
NO_GROUP = 0

_CONTEXT_BITS = 31
_STEM_BITS = 32
#: Bits of each part's length rank: 64 ranks of a third of an octave reach 2 MiB, past which
#: lengths share the first rank.
_LENGTH_BITS = 6
_RANKS = 1 << _LENGTH_BITS
_RANKS_PER_OCTAVE = 3


def _length_rank(length: int) -> int:
    """0 for the longest text, ``_RANKS - 1`` for an empty one: the part's place in the key."""
    return _RANKS - 1 - min(_RANKS - 1, int(math.log2(length + 1) * _RANKS_PER_OCTAVE))


def _part(data: bytes, bits: int) -> int:
    """``data``'s ``bits``-bit key: its length's rank, then its hash."""
    hash_bits = bits - _LENGTH_BITS
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return (_length_rank(len(data)) << hash_bits) | (
        int.from_bytes(digest, "big") >> (64 - hash_bits)
    )


def _stem(content: Any) -> bytes:
    """The last message's text up to its last line break (``b""`` when it has none)."""
    if isinstance(content, list):  # content parts: the text parts, in order
        content = "".join(
            part.get("text", "") if isinstance(part, dict) else "" for part in content
        )
    if not isinstance(content, str):
        return b""
    cut = content.rfind("\n")
    return content[:cut].encode() if cut > 0 else b""


def prefix_group(body: Any) -> int:
    """The prefix group of a request line's ``body`` (a chat body's ``messages``, a responses
    body's ``input`` list or text, a completions body's ``prompt`` text): a non-negative
    63-bit key, ``context << 32 | stem``, each part ``length rank << hash bits | hash``;
    ``NO_GROUP`` for a body with no prompt read here (embeddings, token-id prompts). Never
    raises.

    Ascending keys put the longest context first and, within one context, the longest stem
    first (each to within a third of an octave of bytes; equal ranks in hash order)."""
    if not isinstance(body, dict):
        return NO_GROUP
    messages = body.get("messages")
    if messages is None:
        messages = body.get("input")
    if isinstance(messages, str):
        messages = [{"content": messages}]
    if not isinstance(messages, list) or not messages:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return NO_GROUP
        messages = [{"content": prompt}]
    last = messages[-1]
    context_parts = [body.get("instructions"), body.get("tools"), messages[:-1]]
    try:
        context = orjson.dumps(context_parts, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON (a huge integer): group by the stem alone
        context = b""
    stem = _stem(last.get("content") if isinstance(last, dict) else None)
    return (_part(context, _CONTEXT_BITS) << _STEM_BITS) | _part(stem, _STEM_BITS)
