"""The workers' Celery app: the shared one (``offpeak.celery_app.make_celery``) with the sweep on
beat's schedule. The tasks register on it (``workers.tasks``); ``workers.celery_worker`` imports
both and is what Celery runs."""

from __future__ import annotations

from offpeak.celery_app import make_celery
from offpeak.settings import get_settings

app = make_celery(get_settings())
app.conf.beat_schedule = {
    "sweep": {"task": "offpeak.sweep", "schedule": get_settings().sweep_seconds},
}
app.conf.beat_schedule_filename = str(get_settings().data_dir.resolve() / "celerybeat-schedule")
