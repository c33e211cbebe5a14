from django.apps import AppConfig


class MillmSiteConfig(AppConfig):
    name = "millm_site"
    verbose_name = "miLLM site"

    def ready(self) -> None:
        # The site is the top layer: it alone may import every app, so it says what the
        # process's runtime is made of (each part is built on first use, once).
        from core.engine_client import build_engine_client
        from core.events import EventBus
        from core.jobs import JobDispatch
        from core.runtime import runtime
        from inference.admission import build_admission
        from inference.residency import Residency
        from orchestration.engine_events import handle as on_engine_event
        from registry.hub import HubBreakers
        from system.metrics import MetricsPush

        runtime().install(
            engine=lambda: build_engine_client(on_event=on_engine_event),
            admission=build_admission,
            residency=Residency,
            metrics_push=MetricsPush,
            events=EventBus,
            jobs=JobDispatch,
            hub=HubBreakers,
        )
