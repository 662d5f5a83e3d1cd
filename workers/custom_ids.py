"""Duplicate ``custom_id``s of an input file in memory that does not grow with its lines'
text: validation keeps 8 bytes a line (the ``custom_id``'s hash) while it streams the file, and
only when two hashes are equal reads the file again for the lines that carry them, to compare
the ``custom_id``s themselves (equal hashes of different ids are then told apart).

A set of the ids themselves held every id of the file at once: about 100 bytes a line, 200 MB
for a file of 2,000,000 lines.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable

import numpy as np


class CustomIdHashes:
    """The hashes of the ``custom_id``s seen so far, in a flat array (8 bytes each). Python's
    ``hash`` of a ``str`` is stable within the process, which is all a pass and its re-read
    need."""

    def __init__(self) -> None:
        self._hashes = array("q")

    def add(self, custom_id: str) -> None:
        self._hashes.append(hash(custom_id))

    def repeated(self) -> set[int]:
        """The hashes added more than once (a sorted copy of the array: 8 bytes a line, while
        it runs)."""
        if len(self._hashes) < 2:
            return set()
        ordered = np.sort(np.frombuffer(self._hashes, dtype=np.int64))
        return set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())


def duplicates(
    lines: Iterable[tuple[int, bytes]], custom_id_of: Callable[[int, bytes], str], hashes: set[int]
) -> list[tuple[int, str]]:
    """``(line number, custom_id)`` of each line whose ``custom_id`` an earlier line of
    ``lines`` carries, in line order, among the lines whose id hashes to one of ``hashes``
    (``CustomIdHashes.repeated``). ``custom_id_of(number, raw)``: the line's id as the first
    pass took it, ``""`` for a line that had none."""
    first: dict[str, int] = {}
    found = []
    for number, raw in lines:
        custom_id = custom_id_of(number, raw)
        if not custom_id or hash(custom_id) not in hashes:
            continue
        if custom_id in first:
            found.append((number, custom_id))
        else:
            first[custom_id] = number
    return found
