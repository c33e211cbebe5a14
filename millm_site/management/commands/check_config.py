"""Print the effective configuration by topic (secrets redacted), and after each value
where it takes effect: the source files that read it (``millm_site.config_readers``), or
"not built yet" for a variable of the original's reference that nothing reads yet; then
the generation slots a model on each backend gets and the setting they come from
(MAX_CONCURRENT_REQUESTS, or with it unset the backend's own batch: VLLM_MAX_NUM_SEQS).

Reaching this command at all means the configuration passed validation: a bad value stops
``manage.py`` before any command runs, with one line naming the variable.
"""

import structlog
from django.core.management.base import BaseCommand

from millm_site.config import VARIABLES, get_config
from millm_site.config_readers import readers

log = structlog.get_logger("millm.config")


class Command(BaseCommand):
    help = "Validate and print the configuration miLLM runs with."

    def handle(self, *args, **options):
        config = get_config()
        found = readers()
        topic = None
        for var in VARIABLES:
            if var.topic != topic:
                topic = var.topic
                self.stdout.write(f"\n[{topic}]")
            value = config[var.name]
            if var.secret and value:
                value = "(set)"
            elif isinstance(value, list):
                value = ",".join(value)
            elif value is None:
                value = "(auto)"
            if var.unbuilt:
                where = f"not built yet: {var.unbuilt}"
            else:
                files = found[var.name]
                where = "read in " + ", ".join(files) if files else "READ BY NOTHING"
            self.stdout.write(f"{var.name}={value}    # {where}")
        self._slots(config)
        mode = "embedded" if config.embedded else "distributed"
        log.info("config_ok", mode=mode, database=config.database()["ENGINE"].rsplit(".", 1)[-1])
        self.stdout.write(self.style.SUCCESS(f"\nConfiguration OK ({mode} mode)."))

    def _slots(self, config) -> None:
        """Which setting sizes /v1's generation slots, for a model on each backend."""
        from core.engine_options import interactive_slots
        from gpu_engine.api.host import backend_names

        asked = config["MAX_CONCURRENT_REQUESTS"]
        how = (
            f"MAX_CONCURRENT_REQUESTS={asked} caps them; a backend's own batch caps it in turn"
            if asked
            else "MAX_CONCURRENT_REQUESTS unset (0): they follow the loaded model's backend"
        )
        self.stdout.write(f"\n[Generation slots of /v1] {how}")
        for name in backend_names():
            slots = interactive_slots(name)
            self.stdout.write(f"a model on {name}: {slots.value} slot(s), from {slots.source}")
