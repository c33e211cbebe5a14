from django.apps import AppConfig


class MillmSiteConfig(AppConfig):
    name = "millm_site"
    verbose_name = "miLLM site"

    def ready(self) -> None:
        # The site is the top layer: it alone may import every app, so it says what the
        # process's runtime is made of (each part is built on first use, once).
        from core.engine_client_build import EngineSet, build_engine_client
        from core.events import EventBus
        from core.jobs import JobDispatch
        from core.runtime import runtime
        from inference.admission_build import build_admission
        from inference.residency import Residency
        from monitoring.analysis import Analyzers
        from orchestration.engine_events import handle as on_engine_event
        from registry.hub import HubBreakers
        from system.metrics import MetricsPush

        runtime().install(
            engine=lambda: build_engine_client(on_event=on_engine_event),
            engines=EngineSet,
            admission=build_admission,
            residency=Residency,
            metrics_push=MetricsPush,
            events=EventBus,
            jobs=JobDispatch,
            hub=HubBreakers,
            analyzers=Analyzers.from_settings,
        )
        self._check_analyzers()
        self._share_metrics()

    @staticmethod
    def _share_metrics() -> None:
        """Distributed mode: every process (web, Celery, commands) sends what its counters
        grew to the stack's sums from the start (core.metrics_store), not when first read.
        OTEL_ENABLED: every process traces (core.tracing)."""
        from django.conf import settings

        from core.metrics import store

        if settings.REDIS_URL:
            store()  # built now: its flusher runs from here
        if settings.OTEL_ENABLED:
            import atexit

            from core.tracing import configure

            atexit.register(configure().shutdown)  # the last spans are sent at exit

    @staticmethod
    def _check_analyzers() -> None:
        """A deployment's ANALYZERS_EXTRA is imported at start, so a bad entry stops the
        process with one line (as a bad variable does) rather than failing a request."""
        import sys

        from django.conf import settings

        from core.runtime import runtime

        if not settings.ANALYZERS_EXTRA:
            return  # the built-in registry is built on first use
        try:
            runtime().analyzers  # noqa: B018 - built now, to fail now
        except Exception as exc:  # noqa: BLE001 - whatever the deployment's code raised
            sys.stderr.write(f"miLLM configuration error: ANALYZERS_EXTRA: {exc}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None
