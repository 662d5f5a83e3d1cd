"""The engine worker's Python a request line, without the database: the claimed rows prepared
(``prepare_chunk``), run on the instant engine, answered, their records built and the
write-back's parameters dumped as psycopg sends them. What ``offpeak bench control`` spends in
the engine worker's interpreter besides the round trips and the loop's bookkeeping.

For a figure that does not drift with the host (shared cloud machines change speed from one
minute to the next), count instructions at two sizes and take the
difference, which leaves the interpreter's start out::

    for n in 1000 5000; do
      valgrind --tool=cachegrind --cache-sim=no python -m bench.line_cost $n 2>&1 | grep refs
    done
    # instructions a line = (I refs at 5000 - I refs at 1000) / 4000

Deterministic input (``bench.generator.padded_lines``, seed 0).
"""

from __future__ import annotations

import sys

import orjson
from psycopg._queries import PostgresQuery
from psycopg.adapt import Transformer

from bench.control import LINE_BYTES
from bench.generator import padded_lines
from storage.repositories import requests as requests_repo
from storage.repositories.requests import ClaimedRequest
from workers.engine.instant import InstantEngine
from workers.runner import results
from workers.runner.admission import prepare_chunk

#: Lines a claim takes (about ``offpeak bench control``'s mean claim).
CHUNK = 500
#: Unix seconds stamped on every line, so runs are alike.
AT = 1_796_000_000.0


def run(lines: int) -> int:
    """Take ``lines`` padded chat lines through the per-line path in claims of ``CHUNK``;
    returns the lines answered."""
    raws = [raw.rstrip(b"\n").decode() for raw in padded_lines(lines, LINE_BYTES, model="m")]
    rows = [
        ClaimedRequest(n, "batch_line_cost", orjson.loads(raw)["custom_id"], raw, 1)
        for n, raw in enumerate(raws, start=1)
    ]
    engine = InstantEngine("m")
    query = f"WITH {requests_repo.RESULTS_CTES} SELECT id, batch_id FROM written"
    answered = 0
    for start in range(0, lines, CHUNK):
        chunk = prepare_chunk(
            rows[start : start + CHUNK], engine, held=set(), urgent=set(), max_attempts=3, at=AT
        )
        held = {line.request_id: line for line in chunk.ready}
        for line in chunk.ready:
            engine.add(line.prepared.request)
        finished = [
            results.answered(held[r.request_id].row, held[r.request_id].prepared, r, int(AT), AT)
            for r in engine.step()
        ]
        stored = [results.stored(line) for line in finished]
        PostgresQuery(Transformer()).convert(query, requests_repo.results_params("w", stored))
        answered += len(stored)
    return answered


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else 1000), "lines")
