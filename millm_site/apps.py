from django.apps import AppConfig


class MillmSiteConfig(AppConfig):
    name = "millm_site"
    verbose_name = "miLLM site"
