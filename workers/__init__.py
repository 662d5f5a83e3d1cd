"""Execution: the Celery app and tasks, the batch runner, and the engine adapter."""
