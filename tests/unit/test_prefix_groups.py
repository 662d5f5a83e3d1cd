"""A line's prefix group (``workers.scheduler.prefix_groups``): lines that start alike share
it, lines that do not are apart, and sorting by it keeps a shared context together."""

from __future__ import annotations

from typing import Any

from workers.scheduler.prefix_groups import NO_GROUP, prefix_group

SYSTEM = {"role": "system", "content": "You answer questions about our contracts."}


def _chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_one_document_asked_several_questions_is_one_group() -> None:
    doc = "Document:\nThe lease runs for five years.\nRent is due monthly."
    first = prefix_group(_chat(_user(f"{doc}\n\nQuestion: how long?")))
    second = prefix_group(_chat(_user(f"{doc}\n\nQuestion: when is rent due?")))
    other = prefix_group(_chat(_user("Document:\nAnother text.\n\nQuestion: how long?")))
    assert first == second
    assert first != other


def test_the_context_before_the_last_message_is_the_high_part_of_the_key() -> None:
    """Lines with one system prompt but different documents sort next to each other: the
    context's hash is above the stem's, so sorting by the key is a trie of depth two."""
    keys = {
        (system, doc): prefix_group(
            _chat({"role": "system", "content": system}, _user(f"doc {doc}\nQuestion?"))
        )
        for system in ("policy A", "policy B", "policy C")
        for doc in range(20)
    }
    ordered = sorted(keys, key=keys.__getitem__)
    systems = [system for system, _ in ordered]
    # Each system prompt's 20 lines are one run in the sorted order.
    runs = [s for i, s in enumerate(systems) if i == 0 or systems[i - 1] != s]
    assert len(runs) == 3


def test_keys_are_non_negative_63_bit_and_stable() -> None:
    body = _chat(SYSTEM, _user("context\nquestion"))
    key = prefix_group(body)
    assert 0 <= key < 2**63
    assert key == prefix_group(_chat(SYSTEM, _user("context\nquestion")))
    # Key order inside a message does not change the group (the JSON is canonical).
    swapped = {"content": SYSTEM["content"], "role": "system"}
    assert key == prefix_group(_chat(swapped, _user("context\nquestion")))


def test_tools_and_content_parts_count_as_the_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    plain = prefix_group(_chat(SYSTEM, _user("a\nb")))
    assert prefix_group(_chat(SYSTEM, _user("a\nb"), tools=tools)) != plain
    parts = _user([{"type": "text", "text": "a\n"}, {"type": "text", "text": "b"}])  # type: ignore[arg-type]
    assert prefix_group(_chat(SYSTEM, parts)) == plain


def test_completions_and_responses_prompts_group_too() -> None:
    assert prefix_group({"prompt": "shared\nx"}) == prefix_group({"prompt": "shared\ny"})
    assert prefix_group({"input": "shared\nx"}) == prefix_group({"prompt": "shared\ny"})
    assert prefix_group({"input": [_user("shared\nx")]}) == prefix_group({"prompt": "shared\nz"})


def test_nothing_to_group_by_is_no_group_and_never_raises() -> None:
    assert prefix_group({"prompt": [1, 2, 3]}) == NO_GROUP
    assert prefix_group("not a body") == NO_GROUP
    assert prefix_group({"messages": []}) == NO_GROUP
    assert prefix_group(_chat("not a message", {"content": 7})) >= 0  # type: ignore[arg-type]
    assert prefix_group(_chat(_user("x"), tools=[2**70])) >= 0


def test_groups_sort_longest_shared_prefix_first_and_keep_a_context_together() -> None:
    """Ascending keys take the longest context first and, within a context, the longest stem
    (document) first; a context's lines stay one run whatever their documents' lengths."""
    systems = {"short": "Be brief.", "long": "You review contracts for a law firm. " * 40}
    keys = {
        (name, words): prefix_group(
            _chat(
                {"role": "system", "content": system},
                _user("clause " * words + "\nQuestion?"),
            )
        )
        for name, system in systems.items()
        for words in (5, 40, 300, 2000)
    }
    ordered = sorted(keys, key=keys.__getitem__)
    assert ordered == [
        ("long", 2000), ("long", 300), ("long", 40), ("long", 5),
        ("short", 2000), ("short", 300), ("short", 40), ("short", 5),
    ]  # fmt: skip
    # A last message with no line break (no stem) comes after the stems of its context.
    bare = prefix_group(_chat({"role": "system", "content": systems["long"]}, _user("Question?")))
    assert keys[("long", 5)] < bare < keys[("short", 2000)]
