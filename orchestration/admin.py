"""Admin actions that change what the engine holds. Activating a circuit attaches its SAEs,
which is orchestration's; the circuit admin itself is the steering app's, so this app adds
the action to it (it is listed after steering in INSTALLED_APPS)."""

from django.contrib import admin

from core.admin_actions import run_each
from orchestration import services
from steering.admin import CircuitAdmin
from steering.models import Circuit


@admin.action(description="Activate (acknowledging a rung below 2)")
def activate_acknowledged(modeladmin, request, queryset):
    run_each(
        modeladmin,
        request,
        queryset,
        "Activated",
        lambda c: services.circuit_activate(circuit=c, acknowledge_unvalidated=True),
    )


class OrchestratedCircuitAdmin(CircuitAdmin):
    actions = (activate_acknowledged, *CircuitAdmin.actions)


admin.site.unregister(Circuit)
admin.site.register(Circuit, OrchestratedCircuitAdmin)
