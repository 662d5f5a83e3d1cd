"""The periodic sweep's clock (celery beat) as a thread of the control worker.

Celery's ``worker -B`` runs beat as a child process; when the worker was SIGKILLed that child lived
on (parent 1), and the restarted worker added a second one. A thread dies with its process. Only
one beat per data folder runs: it holds an exclusive lock on ``<schedule>.lock`` (the schedule is
a ``shelve`` file, which two writers corrupt); another control worker on the same folder stands
by and takes over when the holder exits, within ``retry_seconds``. On several hosts, each host's
control worker runs its own beat: the sweep is idempotent, so extra sweeps cost only a query.
"""

from __future__ import annotations

import fcntl
import logging
import threading
from pathlib import Path

from celery import Celery
from celery.beat import Service

log = logging.getLogger(__name__)


class BeatThread(threading.Thread):
    """Runs ``celery.beat.Service`` for ``app`` while holding the schedule's lock file."""

    def __init__(self, app: Celery, schedule_filename: Path, retry_seconds: float = 5.0) -> None:
        super().__init__(name="beat", daemon=True)
        self.app = app
        self.schedule_filename = schedule_filename
        self.retry_seconds = retry_seconds
        self._stopping = threading.Event()
        self._service: Service | None = None
        #: Set once this thread holds the lock and beat runs (tests wait on it).
        self.running = threading.Event()

    def run(self) -> None:
        lock_path = self.schedule_filename.with_name(self.schedule_filename.name + ".lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a") as lock_file:
            if not self._acquire(lock_file.fileno()):
                return
            # max_interval 1 s: the loop sees a stop request within a second.
            service = Service(
                self.app, max_interval=1, schedule_filename=str(self.schedule_filename)
            )
            self._service = service
            if self._stopping.is_set():
                return
            self.running.set()
            log.info("beat: running the periodic sweep (lock %s)", lock_path)
            service.start()

    def _acquire(self, fd: int) -> bool:
        waiting = False
        while not self._stopping.is_set():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if not waiting:
                    log.info("beat: another control worker runs the sweep here; standing by")
                    waiting = True
                self._stopping.wait(self.retry_seconds)
        return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop beat (it saves its schedule) and wait up to ``timeout`` seconds for the thread."""
        self._stopping.set()
        if self._service is not None:
            self._service.stop(wait=False)
        if self.is_alive():
            self.join(timeout)
