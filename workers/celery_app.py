"""The Celery app workers run (``celery -A workers.celery_app worker``), tasks registered."""

from __future__ import annotations

from offpeak.queues import make_celery
from offpeak.settings import get_settings

app = make_celery(get_settings())
app.conf.beat_schedule = {
    "sweep": {"task": "offpeak.sweep", "schedule": get_settings().sweep_seconds},
}
app.conf.beat_schedule_filename = str(get_settings().data_dir.resolve() / "celerybeat-schedule")

import workers.liveness  # noqa: E402,F401  (every worker process heartbeats: /healthz)
import workers.tasks  # noqa: E402,F401  (registers the tasks on ``app``)
