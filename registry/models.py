"""The registry: models and SAEs known to the server, and the jobs that move them.

Rows carry metadata only; weights stay on disk. Mutations go through ``services``.
"""

from __future__ import annotations

import secrets

from django.core.exceptions import ValidationError
from django.db import models

from gpu_engine.api.host import backend_names


def validate_backend(value: str) -> None:
    if value and value not in backend_names():
        raise ValidationError(f"unknown backend {value!r}; known: {', '.join(backend_names())}")


class Model(models.Model):
    class Source(models.TextChoices):
        HUGGINGFACE = "huggingface", "Hugging Face hub"
        LOCAL = "local", "Local directory"

    class Format(models.TextChoices):
        TRANSFORMERS = "transformers", "transformers (safetensors)"
        GGUF = "gguf", "GGUF"

    class Quantization(models.TextChoices):
        FP32 = "FP32", "FP32"
        FP16 = "FP16", "FP16 / BF16"
        Q8 = "Q8", "8-bit"
        Q4 = "Q4", "4-bit"
        Q2 = "Q2", "2-bit"

    class Status(models.TextChoices):
        DOWNLOADING = "downloading", "Downloading"
        READY = "ready", "Ready"
        LOADING = "loading", "Loading"
        LOADED = "loaded", "Loaded"
        # Between an unload's start and the weights leaving: running requests finish,
        # new ones are refused with 503 model_busy.
        UNLOADING = "unloading", "Unloading"
        ERROR = "error", "Error"

    name = models.CharField(max_length=200, unique=True, help_text="The name clients use as `model` on /v1.")
    source = models.CharField(max_length=16, choices=Source.choices)
    repo_id = models.CharField(max_length=300, blank=True)
    revision = models.CharField(max_length=100, blank=True, default="main")
    local_path = models.CharField(
        max_length=1000, blank=True, help_text="Directory (or GGUF file) holding the weights."
    )
    format = models.CharField(max_length=16, choices=Format.choices, default=Format.TRANSFORMERS)
    gguf_file = models.CharField(max_length=300, blank=True)
    quantization = models.CharField(max_length=8, choices=Quantization.choices, default=Quantization.FP32)
    trust_remote_code = models.BooleanField(default=False)
    backend = models.CharField(
        max_length=32,
        blank=True,
        default="",
        validators=[validate_backend],
        help_text="The engine backend that loads and runs it (transformers, vllm, llamacpp); "
        "blank: the site's MILLM_BACKEND.",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY, db_index=True)
    error_message = models.TextField(blank=True)
    architecture = models.CharField(max_length=200, blank=True)
    num_layers = models.PositiveIntegerField(null=True, blank=True)
    hidden_size = models.PositiveIntegerField(null=True, blank=True)
    context_length = models.PositiveIntegerField(null=True, blank=True)
    parameter_count = models.BigIntegerField(null=True, blank=True)
    disk_size_bytes = models.BigIntegerField(null=True, blank=True)
    estimated_memory_bytes = models.BigIntegerField(null=True, blank=True)
    files_dir = models.CharField(
        max_length=1000,
        blank=True,
        help_text="The folder the registry downloaded this row's files into; deleting the "
        "row removes it and nothing else (empty: the row owns no files).",
    )
    locked = models.BooleanField(default=False)
    locked_by_operator = models.BooleanField(
        default=False,
        help_text="Locked through lock (API, admin), not only because SAEs are "
        "attached: detaching the last SAE then leaves it locked.",
    )
    loaded_at = models.DateTimeField(null=True, blank=True)
    device = models.CharField(max_length=32, blank=True, help_text="Where the resident weights are (set while loaded).")
    dtype = models.CharField(max_length=16, blank=True, help_text="Dtype of the resident weights (set while loaded).")
    engine = models.CharField(
        max_length=40,
        blank=True,
        default="",
        help_text="The engine (ENGINE_NAME) that holds or is loading the model (set while loading or loaded).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def effective_backend(self) -> str:
        """The backend a load uses: the row's own, else ``llamacpp`` for a GGUF file (the
        only backend that reads one), else the site's ``MILLM_BACKEND``."""
        from django.conf import settings

        if self.backend:
            return self.backend
        return "llamacpp" if self.format == self.Format.GGUF else settings.MILLM_BACKEND

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                name="model_hub_needs_repo",
                condition=~models.Q(source="huggingface") | ~models.Q(repo_id=""),
            ),
            models.CheckConstraint(
                name="model_local_needs_path",
                condition=~models.Q(source="local") | ~models.Q(local_path=""),
            ),
        ]

    def __str__(self) -> str:
        return self.name


def _sae_id() -> str:
    return f"sae_{secrets.token_hex(8)}"


class SAE(models.Model):
    """An SAE, or a raw steering vector (``format="vector"``: a direction per layer, no
    encoder). Both are one kind of row so that a vector attaches, steers, detaches and is
    restored after an engine restart through exactly the SAE paths; the ``vector_*``
    fields say what only a vector has."""

    class Format(models.TextChoices):
        SAELENS = "saelens", "SAELens (cfg.json + safetensors)"
        GEMMASCOPE = "gemmascope", "Gemma Scope (params.npz)"
        VECTOR = "vector", "Steering vector (layer.<L> safetensors)"

    class Activation(models.TextChoices):
        RELU = "relu", "ReLU"
        JUMPRELU = "jumprelu", "JumpReLU"
        TOPK = "topk", "TopK"
        NONE = "none", "None (a steering vector: no encoder)"

    class VectorSource(models.TextChoices):
        UPLOAD = "upload", "Uploaded (or imported) file"
        COMPUTED = "computed", "Computed from contrastive prompt pairs"

    class Status(models.TextChoices):
        DOWNLOADING = "downloading", "Downloading"
        READY = "ready", "Ready"
        ATTACHED = "attached", "Attached"
        ERROR = "error", "Error"

    id = models.CharField(primary_key=True, max_length=40, default=_sae_id, editable=False)
    name = models.CharField(max_length=200, blank=True)
    repository_id = models.CharField(max_length=300, blank=True, help_text="Hub repository, empty for a local SAE.")
    revision = models.CharField(max_length=100, blank=True, default="main")
    file_path = models.CharField(max_length=500, blank=True, help_text="Path of the SAE inside the repository.")
    local_path = models.CharField(max_length=1000, blank=True)
    format = models.CharField(max_length=16, choices=Format.choices)
    d_in = models.PositiveIntegerField(null=True, blank=True)
    d_sae = models.PositiveIntegerField(null=True, blank=True)
    trained_on_model = models.CharField(max_length=300, blank=True)
    trained_on_layer = models.IntegerField(null=True, blank=True)
    hook_name = models.CharField(max_length=200, blank=True)
    activation = models.CharField(max_length=16, choices=Activation.choices, default=Activation.RELU)
    topk_k = models.PositiveIntegerField(null=True, blank=True)
    width = models.PositiveIntegerField(null=True, blank=True, help_text="Dictionary width (= d_sae).")
    average_l0 = models.FloatField(null=True, blank=True)
    neuronpedia_id = models.CharField(
        max_length=300,
        blank=True,
        help_text="Neuronpedia's id of this SAE (\"model/source\", from a SAELens cfg.json's neuronpedia_id): "
        "what explanations are imported and exported under.",
    )
    labels_file_read = models.BooleanField(
        default=False,
        help_text="The SAE folder's feature_labels.json was imported as explanations (registry.labels): "
        "it is read once, so a label deleted later does not come back.",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY, db_index=True)
    error_message = models.TextField(blank=True)
    # steering vectors only
    vector_source = models.CharField(max_length=16, choices=VectorSource.choices, blank=True)
    vector_layers = models.JSONField(default=list, blank=True, help_text="The layers the vector file has a vector for.")
    vector_norms = models.JSONField(
        default=list, blank=True, help_text="The L2 norm of each layer's vector, in the order of vector_layers."
    )
    vector_recipe = models.JSONField(
        default=dict, blank=True, help_text="How a computed vector was made (pairs, pooling)."
    )
    files_owned = models.BooleanField(
        default=False,
        help_text="miLLM wrote these files (an upload or a computed vector); deleting the row removes them.",
    )
    files_dir = models.CharField(
        max_length=1000,
        blank=True,
        help_text="The folder the registry downloaded this row's files into; deleting the "
        "row removes it and nothing else (empty: no download).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    @property
    def is_vector(self) -> bool:
        return self.format == self.Format.VECTOR

    class Meta:
        verbose_name = "SAE"
        ordering = ["name", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["repository_id", "revision", "file_path"],
                condition=~models.Q(repository_id=""),
                name="sae_unique_hub_file",
            ),
        ]

    def __str__(self) -> str:
        return self.name or self.id


class SteeringVectorManager(models.Manager):
    def get_queryset(self):
        return super().get_queryset().filter(format=SAE.Format.VECTOR)


class SteeringVector(SAE):
    """The steering-vector rows of ``SAE`` (the admin's own page for them)."""

    objects = SteeringVectorManager()

    class Meta:
        proxy = True
        verbose_name = "steering vector"


class Job(models.Model):
    class Kind(models.TextChoices):
        MODEL_DOWNLOAD = "model_download", "Model download"
        SAE_DOWNLOAD = "sae_download", "SAE download"
        MODEL_LOAD = "model_load", "Model load"
        MODEL_UNLOAD = "model_unload", "Model unload"
        MAINTENANCE = "maintenance", "Maintenance"

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
    ACTIVE = (Status.QUEUED, Status.RUNNING)

    kind = models.CharField(max_length=32, choices=Kind.choices)
    model = models.ForeignKey(Model, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    sae = models.ForeignKey(SAE, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    target = models.CharField(
        max_length=500, blank=True, help_text="What the job acts on, kept after the row it names is deleted."
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    progress = models.PositiveSmallIntegerField(default=0)
    stage = models.CharField(max_length=100, blank=True)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(name="job_progress_0_100", condition=models.Q(progress__lte=100)),
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} {self.target} ({self.status})"


class Attachment(models.Model):
    """An SAE hooked into a layer of the loaded model. Recorded so that a restarted engine
    can restore exactly what was attached."""

    sae = models.ForeignKey(SAE, on_delete=models.CASCADE, related_name="attachments")
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="attachments")
    layer = models.PositiveIntegerField()
    layer_module_path = models.CharField(max_length=200)
    # where on the layer the SAE reads and writes (gpu_engine.sae.hookpoints.HOOK_POINTS),
    # as the engine reported it when attaching
    hook_point = models.CharField(max_length=32, default="resid_post")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["layer", "sae_id"]
        constraints = [
            models.UniqueConstraint(fields=["sae", "layer"], name="attachment_unique_sae_layer"),
        ]

    def __str__(self) -> str:
        return f"{self.sae_id}@{self.layer_module_path}"


class FeatureExplanation(models.Model):
    """What a feature means, in words: imported (Neuronpedia's export, an SAE folder's
    feature_labels.json), written by a user, or generated by an explainer model from the
    feature's top contexts (``provenance`` says how; ``score`` is the held-out scoring
    pass's, when one ran). A feature's label is its best explanation
    (``registry.labels``): the highest score, then the newest."""

    class Source(models.TextChoices):
        NEURONPEDIA = "neuronpedia", "Imported from Neuronpedia's export"
        LABELS_FILE = "labels_file", "The SAE folder's feature_labels.json"
        EXPLAINER = "explainer", "Generated by an explainer model"
        USER = "user", "Written by a user"

    sae = models.ForeignKey(SAE, on_delete=models.CASCADE, related_name="explanations")
    index = models.PositiveIntegerField()
    description = models.TextField()
    source = models.CharField(max_length=16, choices=Source.choices)
    explainer_model = models.CharField(max_length=300, blank=True)
    provenance = models.JSONField(default=dict, blank=True)
    score = models.FloatField(null=True, blank=True)
    score_detail = models.JSONField(default=dict, blank=True)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["sae_id", "index", "-created_at"]
        indexes = [models.Index(fields=["sae", "index"])]

    def __str__(self) -> str:
        return f"{self.sae_id}#{self.index}: {self.description[:40]}"
