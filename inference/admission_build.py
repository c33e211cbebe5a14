"""Which admission controller this process uses: in-process or shared through Redis.

Its own module because it names both: ``inference.admission_shared`` builds on
``inference.admission``, so the choice cannot live in either without a circle.
"""

from __future__ import annotations

from django.conf import settings

from inference.admission import AdmissionController
from inference.admission_shared import SharedAdmissionController


def build_admission() -> AdmissionController | SharedAdmissionController:
    """The controller this process's settings call for (the runtime builds it once): in
    this process embedded, shared through Redis in distributed mode."""
    if settings.EMBEDDED:
        return AdmissionController.from_settings()
    return SharedAdmissionController.from_settings()
