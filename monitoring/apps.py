from django.apps import AppConfig


class MonitoringConfig(AppConfig):
    name = "monitoring"
    verbose_name = "Monitoring"

    def ready(self) -> None:
        from core import attachment_flags
        from monitoring.sensing import connect_signals
        from monitoring.services import monitoring_state

        connect_signals()

        def monitored(attachment) -> bool:
            state = monitoring_state()
            return bool(
                state["enabled"] and state["sae_id"] == attachment.sae_id and state["layer"] == attachment.layer
            )

        attachment_flags.provide("monitoring_enabled", monitored)
