"""The Celery app: downloads and maintenance on their own queues, prefetch 1, time limits.

Workers never touch CUDA: the engine lives in its own process (or thread, embedded), and
tasks take ids, not objects.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")

app = Celery("millm")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
