"""Admin pages for the registry. Actions call the same service functions as the API, so a
refusal (a locked model, an attached SAE) reads the same here as anywhere else."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.template.defaultfilters import filesizeformat

from core.admin_actions import RefusableDeleteMixin, run_each
from core.errors import MillmError
from registry import job_lifecycle, services, vectors
from registry.access import check_remote_code
from registry.models import SAE, FeatureExplanation, Job, Model, SteeringVector


class ModelRegisterForm(forms.ModelForm):
    """The admin's "Add model": register a checkpoint on the server's disk. The checks are
    the service's own (``model_check_local``), shown on the form before anything is saved;
    the row itself is made by ``model_register_local`` in ``ModelAdmin.save_model``. A hub
    download starts from the Models page, ``POST /api/models`` or ``manage.py
    download_model``, which follow its progress."""

    local_path = forms.CharField(
        max_length=1000,
        label="Local path",
        help_text="Absolute path of a transformers checkpoint directory (config.json + "
        "safetensors) or a .gguf file on the server, under LOCAL_MODEL_ROOTS. "
        "Deleting the model never removes these files.",
    )
    name = forms.CharField(
        max_length=200,
        required=False,
        help_text="The name clients use as `model` on /v1. Default: the directory's (or GGUF file's) name.",
    )

    class Meta:
        model = Model
        fields = ("local_path", "name", "quantization", "trust_remote_code", "backend")

    # which field a refusal belongs to, by its code; the rest go above the form
    field_of_code = {
        "INVALID_LOCAL_PATH": "local_path",
        "MODEL_ALREADY_EXISTS": "name",
        "REMOTE_CODE_NOT_ALLOWED": "trust_remote_code",
    }

    def clean(self):
        data = super().clean()
        if "local_path" in self.errors or "backend" in self.errors:
            return data
        try:
            check_remote_code(trust_remote_code=bool(data.get("trust_remote_code")))
            services.model_check_local(
                local_path=data["local_path"],
                name=data.get("name") or None,
                quantization=data.get("quantization"),
                backend=data.get("backend") or "",
            )
        except MillmError as exc:
            field = "backend" if "backend" in exc.details.get("fields", {}) else self.field_of_code.get(exc.code)
            self.add_error(field, f"{exc.message} ({exc.code})")
        return data


class ModelChangeForm(forms.ModelForm):
    """A registered model's page: a backend that cannot read its format is refused on the
    form (``check_backend_format``, as ``PATCH /api/models/{id}`` refuses it)."""

    def clean_backend(self):
        backend = self.cleaned_data.get("backend") or ""
        try:
            services.check_backend_format(backend, self.instance.format)
        except MillmError as exc:
            raise forms.ValidationError(f"{exc.message} ({exc.code})") from exc
        return backend


@admin.register(Model)
class ModelAdmin(RefusableDeleteMixin, admin.ModelAdmin):
    list_display = (
        "name",
        "status",
        "source",
        "format",
        "backend_display",
        "architecture",
        "params_display",
        "disk_display",
        "locked",
        "engine",
        "updated_at",
    )
    list_filter = ("status", "source", "format", "backend", "quantization", "locked")
    search_fields = ("name", "repo_id", "local_path", "architecture")
    readonly_fields = (
        "status",
        "error_message",
        "architecture",
        "num_layers",
        "hidden_size",
        "context_length",
        "parameter_count",
        "disk_size_bytes",
        "estimated_memory_bytes",
        "locked",
        "engine",
        "loaded_at",
        "created_at",
        "updated_at",
    )
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "name",
                    "source",
                    "repo_id",
                    "revision",
                    "local_path",
                    "format",
                    "gguf_file",
                    "quantization",
                    "trust_remote_code",
                    "backend",
                )
            },
        ),
        ("State", {"fields": ("status", "error_message", "locked", "engine", "loaded_at")}),
        (
            "Checkpoint",
            {
                "fields": (
                    "architecture",
                    "num_layers",
                    "hidden_size",
                    "context_length",
                    "parameter_count",
                    "disk_size_bytes",
                    "estimated_memory_bytes",
                )
            },
        ),
        ("Timestamps", {"fields": ("created_at", "updated_at")}),
    )
    actions = ("lock_models", "unlock_models", "refresh_metadata", "delete_models")

    def get_actions(self, request):
        actions = super().get_actions(request)
        # Django's bulk delete would bypass model_delete's lock/loaded checks.
        actions.pop("delete_selected", None)
        return actions

    @admin.display(description="Parameters")
    def params_display(self, obj: Model) -> str:
        if not obj.parameter_count:
            return "—"
        count = obj.parameter_count
        for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if count >= size:
                return f"{count / size:.1f}{unit}"
        return str(count)

    @admin.display(description="Backend", ordering="backend")
    def backend_display(self, obj: Model) -> str:
        # blank follows the site setting: show which one it is
        return obj.backend or f"{obj.effective_backend()} (MILLM_BACKEND)"

    # where the weights are: the identity of the row, which delete relies on (only what
    # miLLM downloaded is ever removed); set by registration or download, as on the API
    identity_fields = ("source", "repo_id", "revision", "local_path", "format", "gguf_file")
    # what else decides what the engine holds: its name is the engine's model id
    engine_fields = ("name", "quantization", "trust_remote_code", "backend")

    def get_form(self, request, obj=None, **kwargs):
        kwargs["form"] = ModelRegisterForm if obj is None else ModelChangeForm
        return super().get_form(request, obj, **kwargs)

    def get_fieldsets(self, request, obj=None):
        if obj is None:
            return ((None, {"fields": ModelRegisterForm.Meta.fields}),)
        return super().get_fieldsets(request, obj)

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        fields = (*super().get_readonly_fields(request, obj), *self.identity_fields)
        if obj.status in (Model.Status.LOADED, Model.Status.LOADING, Model.Status.UNLOADING):
            # the engine holds the weights as they were loaded: an edit here would change
            # the registry and not the engine (unload the model first)
            fields += self.engine_fields
        return fields

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is not None and request.method == "POST":
            # a load cannot start between reading the status (which fields are read-only)
            # and saving: it takes the same row lock (the admin's view is one transaction)
            obj = Model.objects.select_for_update().get(pk=obj.pk)
        return obj

    def save_model(self, request, obj, form, change):
        if change:
            # only what the form changed: the row's state (status, loaded_at) is the
            # engine's to write, and a whole-row save would put back what the page read
            obj.save(update_fields=[*form.changed_data, "updated_at"])
            return None
        data = form.cleaned_data
        model = services.model_register_local(
            local_path=data["local_path"],
            name=data.get("name") or None,
            quantization=data["quantization"],
            trust_remote_code=data["trust_remote_code"],
            backend=data.get("backend") or "",
        )
        # the admin goes on with ``obj`` (its message, the log entry, the redirect)
        obj.pk = model.pk
        obj.refresh_from_db()
        return None

    @admin.display(description="Disk")
    def disk_display(self, obj: Model) -> str:
        return filesizeformat(obj.disk_size_bytes) if obj.disk_size_bytes else "—"

    @admin.action(description="Lock selected models")
    def lock_models(self, request, queryset):
        run_each(self, request, queryset, "Locked", lambda m: services.model_lock(model=m))

    @admin.action(description="Unlock selected models")
    def unlock_models(self, request, queryset):
        run_each(self, request, queryset, "Unlocked", lambda m: services.model_unlock(model=m))

    @admin.action(description="Re-read metadata from the files")
    def refresh_metadata(self, request, queryset):
        run_each(self, request, queryset, "Refreshed", lambda m: services.model_refresh_metadata(model=m))

    @admin.action(description="Delete selected models (refused while loaded or locked)")
    def delete_models(self, request, queryset):
        run_each(self, request, queryset, "Deleted", lambda m: services.model_delete(model=m))

    def delete_model(self, request, obj):
        services.model_delete(model=obj)


class SAERegisterForm(forms.ModelForm):
    """The admin's "Add SAE": register a directory on the server's disk. The checks are
    the service's own (``sae_check_local``), shown on the form before anything is saved;
    the row itself is made by ``sae_register_local`` in ``SAEAdmin.save_model``."""

    local_path = forms.CharField(
        max_length=1000,
        label="Local path",
        help_text="Absolute path of the SAE's directory on the server: SAELens (cfg.json + "
        "sae_weights.safetensors) or Gemma Scope (params.npz). Its files stay "
        "yours: deleting the SAE here never removes them.",
    )

    class Meta:
        model = SAE
        fields = ("local_path", "name", "trained_on_model", "trained_on_layer")
        help_texts = {
            "name": "Default: the directory's name.",
            "trained_on_model": "Only used where the SAE's own files do not name it.",
            "trained_on_layer": "Only used where the SAE's own files do not name it.",
        }

    def clean_local_path(self) -> str:
        try:
            path, _ = services.sae_check_local(local_path=self.cleaned_data["local_path"])
        except MillmError as exc:
            raise forms.ValidationError(f"{exc.message} ({exc.code})") from exc
        return str(path)


@admin.register(SAE)
class SAEAdmin(RefusableDeleteMixin, admin.ModelAdmin):
    list_display = (
        "id",
        "name",
        "status",
        "source_display",
        "format",
        "activation",
        "d_in",
        "d_sae",
        "trained_on_model",
        "trained_on_layer",
        "neuronpedia_id",
        "updated_at",
    )
    list_filter = ("status", "format", "activation")
    search_fields = (
        "id",
        "name",
        "repository_id",
        "file_path",
        "local_path",
        "trained_on_model",
        "hook_name",
        "neuronpedia_id",
    )
    readonly_fields = (
        "id",
        "status",
        "error_message",
        "format",
        "d_in",
        "d_sae",
        "width",
        "activation",
        "topk_k",
        "trained_on_model",
        "trained_on_layer",
        "hook_name",
        "created_at",
        "updated_at",
    )
    # where the files are and where they came from: the identity of the row, which delete
    # relies on (only a hub download's files are ever removed)
    identity_fields = ("repository_id", "revision", "file_path", "local_path")
    actions = ("delete_saes",)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = SAERegisterForm
        return super().get_form(request, obj, **kwargs)

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        return (*self.identity_fields, *super().get_readonly_fields(request, obj))

    @admin.display(description="Source")
    def source_display(self, obj: SAE) -> str:
        return "hub" if obj.repository_id else "local"

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        data = form.cleaned_data
        sae = services.sae_register_local(
            local_path=data["local_path"],
            name=data.get("name") or None,
            trained_on_model=data.get("trained_on_model") or None,
            trained_on_layer=data.get("trained_on_layer"),
        )
        # the admin goes on with ``obj`` (its message, the log entry, the redirect)
        obj.pk = sae.pk
        obj.refresh_from_db()
        return None

    @admin.action(description="Delete selected SAEs (refused while attached)")
    def delete_saes(self, request, queryset):
        run_each(self, request, queryset, "Deleted", lambda s: services.sae_delete(sae=s))

    def delete_model(self, request, obj):
        services.sae_delete(sae=obj)


class VectorImportForm(forms.ModelForm):
    """Import a vector file from the server's disk (``vectors.vector_import``): checked on
    the form first (``vector_read_file``), so a refusal shows before anything is written."""

    path = forms.CharField(
        max_length=1000,
        label="File",
        help_text="Absolute path of a safetensors file of layer.<L> tensors. "
        "miLLM stores its own copy; this file is never changed.",
    )
    model = forms.ModelChoiceField(queryset=Model.objects.all(), help_text="The model the vector was made for.")
    layer = forms.IntegerField(min_value=0, required=False, help_text="Keep only this layer's vector (default: all).")

    class Meta:
        model = SteeringVector
        fields = ("name",)

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        from pathlib import Path

        try:
            vectors.check_name_free(data.get("name") or "")
            vectors.vector_read_file(path=Path(data["path"]), model=data["model"], layer=data.get("layer"))
        except MillmError as exc:
            raise forms.ValidationError(f"{exc.message} ({exc.code})") from exc
        return data


@admin.register(SteeringVector)
class SteeringVectorAdmin(RefusableDeleteMixin, admin.ModelAdmin):
    list_display = ("id", "name", "trained_on_model", "vector_layers", "d_in", "vector_source", "status", "updated_at")
    list_filter = ("status", "vector_source")
    search_fields = ("id", "name", "trained_on_model")
    readonly_fields = (
        "id",
        "name",
        "status",
        "trained_on_model",
        "vector_layers",
        "vector_norms",
        "d_in",
        "vector_source",
        "vector_recipe",
        "local_path",
        "files_owned",
        "created_at",
        "updated_at",
    )
    fields = readonly_fields
    actions = ("delete_vectors",)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = VectorImportForm
            kwargs["fields"] = None
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        return ("name", "path", "model", "layer") if obj is None else self.fields

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else self.readonly_fields

    def save_model(self, request, obj, form, change):
        if change:
            return None
        data = form.cleaned_data
        row = vectors.vector_import(path=data["path"], name=data["name"], model=data["model"], layer=data.get("layer"))
        obj.pk = row.pk
        obj.refresh_from_db()
        return None

    @admin.action(description="Delete selected vectors (refused while attached)")
    def delete_vectors(self, request, queryset):
        run_each(self, request, queryset, "Deleted", lambda s: services.sae_delete(sae=s))

    def delete_model(self, request, obj):
        services.sae_delete(sae=obj)


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "target", "status", "progress", "stage", "created_at", "finished_at")
    list_filter = ("kind", "status")
    search_fields = ("target", "stage", "error")
    readonly_fields = (
        "kind",
        "model",
        "sae",
        "target",
        "status",
        "progress",
        "stage",
        "bytes_done",
        "bytes_total",
        "error",
        "cancel_requested",
        "created_at",
        "started_at",
        "finished_at",
        "updated_at",
    )
    actions = ("cancel_jobs",)

    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Cancel selected jobs")
    def cancel_jobs(self, request, queryset):
        run_each(self, request, queryset, "Cancelled", lambda j: job_lifecycle.job_cancel(job=j))


@admin.register(FeatureExplanation)
class FeatureExplanationAdmin(admin.ModelAdmin):
    """Explanations of SAE features (registry.labels: a feature's label is its best one).
    Written, imported and generated through /api/saes/{id}/explanations; here they can be
    read, corrected or deleted."""

    list_display = ("id", "sae", "index", "short_description", "source", "explainer_model", "score", "created_at")
    list_filter = ("source",)
    search_fields = ("description", "sae__id", "sae__name", "explainer_model")
    list_select_related = ("sae",)
    raw_id_fields = ("sae",)
    readonly_fields = ("provenance", "score_detail", "created_by", "created_at")
    ordering = ("sae_id", "index", "-created_at")

    @admin.display(description="Description")
    def short_description(self, obj: FeatureExplanation) -> str:
        return obj.description if len(obj.description) <= 80 else obj.description[:79] + "…"
