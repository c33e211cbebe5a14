"""Calibration from the command line: the services behind ``POST /api/experiments/calibrate``
(see ``manage.py sweep``, whose options it shares).

    manage.py calibrate BODY.json [--wait]
"""

from __future__ import annotations

from typing import Any

from core.api import validated
from core.auth import ANONYMOUS
from experiments import services
from experiments.management.commands.sweep import ExperimentCommand
from experiments.models import ExperimentRun


class Command(ExperimentCommand):
    help = "Find the strength whose mean KL meets a budget (bisection), list experiments, or download one's points."
    kind = ExperimentRun.Kind.CALIBRATION
    route = "/api/experiments/calibrate"

    def start(self, data: dict[str, Any]) -> ExperimentRun:
        from experiments.apis import CalibrateInput

        return services.experiment_calibrate_start(principal=ANONYMOUS, data=dict(validated(CalibrateInput, data)))
