from django.apps import AppConfig


class SteeringConfig(AppConfig):
    name = "steering"
    verbose_name = "Steering documents"
