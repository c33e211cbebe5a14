from django.apps import AppConfig


class SteeringConfig(AppConfig):
    name = "steering"
    verbose_name = "Steering documents"

    def ready(self) -> None:
        from core import attachment_flags
        from steering.live import live_state

        attachment_flags.provide("steering_enabled", lambda attachment: live_state(attachment=attachment)["enabled"])
