"""The Celery app of tests/clients/celery_worker.py: its broker, queue and marks file come from
the environment the driver sets (CELERY_BROKER_URL, CELERY_QUEUE, CELERY_MARKS). Every task
appends "name monotonic-seconds" to the marks file when it runs, so the driver can tell what
ran, in which order, and when.
"""
import os
import time

from celery import Celery

app = Celery("ringmq_checks", broker=os.environ["CELERY_BROKER_URL"])
app.conf.update(
    task_default_queue=os.environ["CELERY_QUEUE"],
    worker_prefetch_multiplier=int(os.environ.get("CELERY_PREFETCH_MULTIPLIER", "1")),
    task_acks_late=os.environ.get("CELERY_ACKS_LATE") == "1",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_heartbeat=0,
    task_queue_max_priority=int(os.environ.get("CELERY_MAX_PRIORITY", "0")) or None,
    task_default_priority=None,
)
if os.environ.get("CELERY_EXTRA_QUEUE"):
    # Tasks routed to a second queue by name (several queues per worker).
    app.conf.task_routes = {"celery_app.mark_extra": {"queue": os.environ["CELERY_EXTRA_QUEUE"]}}


def _mark(name):
    with open(os.environ["CELERY_MARKS"], "a") as f:
        f.write("%s %.6f\n" % (name, time.monotonic()))


@app.task
def mark(name):
    _mark(name)


@app.task
def mark_extra(name):
    _mark(name)


@app.task
def busy(name, seconds):
    """Occupies the worker for `seconds`, then marks."""
    time.sleep(seconds)
    _mark(name)


@app.task(bind=True, max_retries=1)
def flaky(self, name, countdown):
    """Fails its first run with a retry `countdown` seconds later; marks the second run."""
    if self.request.retries == 0:
        _mark(name + "-first")
        raise self.retry(countdown=countdown)
    _mark(name)
