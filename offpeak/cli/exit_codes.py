"""The ``offpeak`` client commands' exit codes, in one place (docs/cli.md lists them).

Scripts branch on them: ``offpeak submit --wait`` returns the batch's outcome, so
``offpeak submit in.jsonl --wait && offpeak download …`` downloads only a completed batch.
A batch that completed with some failed lines still exits ``OK`` (its status is ``completed``;
the error file says which lines failed).
"""

from __future__ import annotations

from offpeak.statuses import BatchStatus

#: The command did what it was asked (``submit --wait``: the batch completed).
OK = 0
#: The API answered with an error (a 4xx/5xx in OpenAI's error shape), or a local fault such
#: as a data folder that cannot be opened; one line on stderr says which.
ERROR = 1
#: Bad arguments or options (click's own code).
USAGE = 2
#: ``submit --wait``: the batch ended ``failed`` (its file broke the rules: ``errors.data``).
BATCH_FAILED = 3
#: ``submit --wait``: the batch ended ``expired`` (its window ran out; finished lines are kept).
BATCH_EXPIRED = 4
#: ``submit --wait``: the batch ended ``cancelled``.
BATCH_CANCELLED = 5
#: ``download``: the batch has no output or error file (not ended yet, or ended without one);
#: ``retry``: the batch has no line to run again.
NOTHING_TO_DO = 6
#: The API cannot be reached (connection refused, DNS, timeout).
UNREACHABLE = 7
#: Ctrl-C while watching a batch (128 + SIGINT, as a shell reports it); the batch runs on.
INTERRUPTED = 130

#: Exit code of a batch that ended with this status.
FOR_STATUS: dict[str, int] = {
    BatchStatus.COMPLETED: OK,
    BatchStatus.FAILED: BATCH_FAILED,
    BatchStatus.EXPIRED: BATCH_EXPIRED,
    BatchStatus.CANCELLED: BATCH_CANCELLED,
}
