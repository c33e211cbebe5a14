"""Admin pages for profiles, clusters, circuits and live steering. Every change goes
through the same services as the API (activation, import, export, delete), so a refusal
reads the same here; imports and exports are an admin view and an action."""

from __future__ import annotations

import json
from collections.abc import Callable

from django import forms
from django.contrib import admin, messages
from django.http import HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from core.admin_actions import RefusableDeleteMixin, run_each
from core.errors import MillmError
from steering import rules, services
from steering.documents import load_document
from steering.models import Circuit, Cluster, LiveSteering, Profile
from steering.profiles import steering_map


def _download(payload: str, filename: str) -> HttpResponse:
    response = HttpResponse(payload, content_type="application/json")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


class ImportForm(forms.Form):
    document = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 16, "cols": 100}), required=False, help_text="Paste the JSON document"
    )
    file = forms.FileField(required=False, help_text="…or upload it")

    def text(self) -> str:
        upload = self.cleaned_data.get("file")
        return upload.read().decode("utf-8", "replace") if upload else self.cleaned_data.get("document") or ""


class ImportMixin:
    """An ``import/`` page on the changelist that hands the document to a service."""

    import_help = ""

    def get_urls(self):
        opts = self.model._meta
        return [
            path(
                "import/",
                self.admin_site.admin_view(self.import_view),
                name=f"{opts.app_label}_{opts.model_name}_import",
            ),
            *super().get_urls(),
        ]

    # Each admin using the mixin defines do_import(data, text) -> the message to show.
    do_import: Callable[[dict, str | None], str]

    def import_view(self, request):
        form = ImportForm(request.POST or None, request.FILES or None)
        if request.method == "POST" and form.is_valid():
            try:
                data, text = load_document(form.text())
                self.message_user(request, self.do_import(data, text), level=messages.SUCCESS)
                opts = self.model._meta
                return HttpResponseRedirect(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
            except MillmError as exc:
                self.message_user(request, f"{exc.message} ({exc.code})", level=messages.ERROR)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "form": form,
            "title": f"Import {self.model._meta.verbose_name_plural}",
            "help": self.import_help,
        }
        return TemplateResponse(request, "admin/steering/import.html", context)


class ProfileForm(forms.ModelForm):
    steering = forms.JSONField(help_text='{"<index>": strength}, each within ±200')
    controls = forms.JSONField(
        required=False,
        initial=list,
        help_text="[{index, mode, value, phase, window, condition}] (docs/steering.md, Modes)",
    )

    class Meta:
        model = Profile
        fields = ("name", "description", "model_name", "sae_id", "layer", "steering", "controls", "intensity")

    def clean_steering(self):
        try:
            return {str(k): v for k, v in steering_map(self.cleaned_data["steering"]).items()}
        except MillmError as exc:
            raise forms.ValidationError(exc.message) from None

    def clean_controls(self):
        try:
            return [rules.control_json(c) for c in rules.controls_parse(self.cleaned_data.get("controls") or [])]
        except MillmError as exc:
            raise forms.ValidationError(exc.message) from None

    def clean(self):
        data = super().clean()
        try:
            features = rules.feature_set(
                {int(k): v for k, v in (data.get("steering") or {}).items()},
                rules.controls_parse(data.get("controls") or []),
            )
        except MillmError as exc:
            raise forms.ValidationError(exc.message) from None
        data["steering"], data["controls"] = (features.stored_values(), features.stored_controls())
        if features and (not data.get("sae_id") or data.get("layer") is None):
            raise forms.ValidationError("A profile with values names its sae_id and layer")
        return data


@admin.register(Profile)
class ProfileAdmin(RefusableDeleteMixin, ImportMixin, admin.ModelAdmin):
    form = ProfileForm
    list_display = ("name", "sae_id", "layer", "feature_count", "intensity", "is_active", "updated_at")
    list_filter = ("is_active",)
    search_fields = ("name", "description", "sae_id", "model_name")
    readonly_fields = ("is_active", "created_at", "updated_at")
    actions = ("activate", "deactivate", "export", "delete_profiles")
    import_help = "A profile export ({version, name, …, steering}); names must be unique."
    change_list_template = "admin/steering/change_list_import.html"

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    @admin.display(description="Features")
    def feature_count(self, obj: Profile) -> int:
        return len(obj.steering or {}) + len(obj.controls or [])

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        if change:
            updated = services.profile_update(
                profile=Profile.objects.get(pk=obj.pk),
                data={
                    "name": data["name"],
                    "description": data["description"],
                    "model_name": data["model_name"],
                    "steering": data["steering"],
                    "controls": data.get("controls") or [],
                    "sae_id": data["sae_id"],
                    "layer": data["layer"],
                    "intensity": data["intensity"],
                },
            )
        else:
            updated = services.profile_create(
                name=data["name"],
                steering=data["steering"],
                controls=data.get("controls") or [],
                sae_id=data["sae_id"] or None,
                layer=data["layer"],
                model_name=data["model_name"] or "",
                description=data["description"] or "",
                intensity=data["intensity"],
            )
        obj.pk = updated.pk

    def delete_model(self, request, obj):
        services.profile_delete(profile=obj)

    def do_import(self, data, text):
        profile = services.profile_import(document=data, on_conflict="rename")
        return f"Imported profile {profile.name!r}."

    @admin.action(description="Activate (replaces the live steering)")
    def activate(self, request, queryset):
        run_each(self, request, queryset[:1], "Activated", lambda p: services.profile_activate(profile=p))

    @admin.action(description="Deactivate")
    def deactivate(self, request, queryset):
        run_each(self, request, queryset, "Deactivated", lambda p: services.profile_deactivate(profile=p))

    @admin.action(description="Export selected (JSON)")
    def export(self, request, queryset):
        docs = [services.profile_export(profile=p) for p in queryset]
        if len(docs) == 1:
            return _download(json.dumps(docs[0], indent=2), f"{docs[0]['name']}.profile.json")
        return _download(json.dumps(docs, indent=2), "profiles.json")

    @admin.action(description="Delete selected profiles")
    def delete_profiles(self, request, queryset):
        run_each(self, request, queryset, "Deleted", lambda p: services.profile_delete(profile=p))


class DocumentAdmin(RefusableDeleteMixin, ImportMixin, admin.ModelAdmin):
    """Clusters and circuits: imported documents, not edited field by field here."""

    change_list_template = "admin/steering/change_list_import.html"

    def has_add_permission(self, request) -> bool:
        return False  # import instead

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions


@admin.register(Cluster)
class ClusterAdmin(DocumentAdmin):
    list_display = ("name", "sae_id", "layer", "member_count", "intensity", "is_active", "unbound_reason", "updated_at")
    list_filter = ("is_active",)
    search_fields = ("name", "narrative", "model_ref")
    fields = (
        "name",
        "narrative",
        "intensity",
        "intensity_range",
        "sae_id",
        "layer",
        "unbound_reason",
        "warnings",
        "members",
        "model_ref",
        "sae_ref",
        "n_features",
        "is_active",
        "document",
        "created_at",
        "updated_at",
    )
    readonly_fields = tuple(f for f in fields if f not in ("name", "narrative"))
    actions = ("activate", "deactivate", "export", "delete_clusters")
    import_help = (
        "A mistudio.cluster-definition/v1 document or a mistudio.cluster-bundle/v1 "
        "(≤ 50 definitions, ≤ 20 members each, ≤ 1 MB)."
    )

    @admin.display(description="Members")
    def member_count(self, obj: Cluster) -> int:
        return len(obj.members)

    def save_model(self, request, obj, form, change):
        services.cluster_update(cluster=Cluster.objects.get(pk=obj.pk), name=obj.name, narrative=obj.narrative)

    def delete_model(self, request, obj):
        services.cluster_delete(cluster=obj)

    def do_import(self, data, text):
        out = services.cluster_import(document=data, text=text)
        return f"Imported {out['imported']} cluster(s); {out['failed']} failed."

    @admin.action(description="Activate (replaces the live steering)")
    def activate(self, request, queryset):
        run_each(self, request, queryset[:1], "Activated", lambda c: services.cluster_activate(cluster=c))

    @admin.action(description="Deactivate")
    def deactivate(self, request, queryset):
        run_each(self, request, queryset, "Deactivated", lambda c: services.cluster_deactivate(cluster=c))

    @admin.action(description="Export selected (the documents as imported)")
    def export(self, request, queryset):
        rows = list(queryset)
        if len(rows) == 1:
            return _download(rows[0].document, f"{rows[0].name}.cluster.json")
        bundle = {
            "kind": "mistudio.cluster-bundle",
            "schema_version": "1",
            "definitions": [json.loads(c.document) for c in rows],
        }
        return _download(json.dumps(bundle, indent=2, ensure_ascii=False), "clusters.bundle.json")

    @admin.action(description="Delete selected clusters")
    def delete_clusters(self, request, queryset):
        run_each(self, request, queryset, "Deleted", lambda c: services.cluster_delete(cluster=c))


@admin.register(Circuit)
class CircuitAdmin(DocumentAdmin):
    list_display = ("name", "rung", "layers", "edges_count", "intensity", "is_active", "updated_at")
    list_filter = ("is_active", "rung")
    search_fields = ("name", "narrative")
    fields = (
        "name",
        "narrative",
        "rung",
        "intensity",
        "intensity_range",
        "saes",
        "members",
        "edges_count",
        "is_active",
        "serving",
        "composed_layers",
        "document",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields
    # "Activate" attaches SAEs, so orchestration.admin adds it
    actions = ("deactivate", "export", "delete_circuits")
    import_help = (
        "A mistudio.circuit-definition/v1 document (≤ 16 SAEs, ≤ 20 members per "
        "layer, ≤ 200 edges). Import never activates."
    )

    @admin.display(description="Layers")
    def layers(self, obj: Circuit) -> str:
        return ", ".join(sorted(obj.members, key=int))

    def delete_model(self, request, obj):
        services.circuit_delete(circuit=obj)

    def do_import(self, data, text):
        circuit = services.circuit_import(document=data, text=text)
        return f"Imported circuit {circuit.name!r} (rung {circuit.rung})."

    @admin.action(description="Deactivate")
    def deactivate(self, request, queryset):
        run_each(self, request, queryset, "Deactivated", lambda c: services.circuit_deactivate(circuit=c))

    @admin.action(description="Export selected (the document as imported)")
    def export(self, request, queryset):
        circuit = queryset.first()
        return _download(circuit.document, f"{circuit.name}.circuit.json")

    @admin.action(description="Delete selected circuits")
    def delete_circuits(self, request, queryset):
        run_each(self, request, queryset, "Deleted", lambda c: services.circuit_delete(circuit=c))


@admin.register(LiveSteering)
class LiveSteeringAdmin(admin.ModelAdmin):
    list_display = ("attachment", "scope", "enabled", "source", "updated_at")
    list_filter = ("scope",)
    readonly_fields = ("attachment", "scope", "enabled", "values", "controls", "source", "updated_at")
    actions = ("clear",)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.action(description="Clear (and disable)")
    def clear(self, request, queryset):
        run_each(
            self, request, queryset, "Cleared", lambda r: services.live_clear(attachment=r.attachment, scope=r.scope)
        )
