"""Wire shapes of /api/models, /api/saes and /api/jobs, the inputs: what a request may
send and how it is validated (hub repository ids, revisions and tokens that are safe in
a header or a path, layers in range). What comes back is ``registry.outputs``. No logic
here: views call services and selectors."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from core.schema import MAX_LAYER
from registry.models import Job, Model

# a hub repository, optionally with the GGUF quantization to fetch (``org/repo:Q4_K_M``)
REPO_ID = r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[A-Za-z0-9_]+)?$"


def _hub_repo_id(value: str) -> None:
    """What the hub itself accepts (length, '--' and '..', leading/trailing marks)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value.partition(":")[0])
    except HFValidationError as exc:
        raise serializers.ValidationError(str(exc).split("\n")[0]) from None


class RepoIdField(serializers.RegexField):
    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", 96)
        super().__init__(REPO_ID, **kwargs)
        self.validators.append(_hub_repo_id)


class HubTokenField(serializers.CharField):
    """Used for the one call that carries it; never echoed, stored or logged."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        kwargs.setdefault("allow_null", True)
        kwargs.setdefault("allow_blank", True)
        kwargs.setdefault("write_only", True)
        kwargs.setdefault("max_length", 512)
        kwargs.setdefault("trim_whitespace", True)
        kwargs.setdefault("help_text", "Hugging Face token for this call only; never stored")
        super().__init__(**kwargs)
        self.validators.append(_header_safe)


def _header_safe(value: str | None) -> None:
    # it travels in an Authorization header: printable ASCII, no spaces (and the message
    # never quotes it)
    if value and not all(33 <= ord(c) <= 126 for c in value):
        raise serializers.ValidationError("hf_token must be printable ASCII without spaces")


class RevisionField(serializers.CharField):
    """A branch, tag or commit: printable ASCII, no spaces."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 100)
        kwargs.setdefault("required", False)
        kwargs.setdefault("allow_null", True)
        kwargs.setdefault("allow_blank", True)
        kwargs.setdefault("default", "main")
        super().__init__(**kwargs)
        self.validators.append(_revision_safe)


def _revision_safe(value: str | None) -> None:
    if value and (not all(33 <= ord(c) <= 126 for c in value) or ".." in value):
        raise serializers.ValidationError(
            "revision must be a branch, tag or commit name (printable ASCII, no spaces, no '..')"
        )


# --- inputs ----------------------------------------------------------------------------


class ModelCreateInput(serializers.Serializer):
    source = serializers.ChoiceField(choices=Model.Source.choices, default="huggingface")
    repo_id = RepoIdField(required=False, allow_null=True)
    revision = RevisionField()
    local_path = serializers.CharField(max_length=1000, required=False, allow_null=True)
    quantization = serializers.ChoiceField(choices=Model.Quantization.choices, default="FP16")
    trust_remote_code = serializers.BooleanField(default=False)
    backend = serializers.CharField(
        max_length=32,
        required=False,
        allow_blank=True,
        default="",
        help_text="a registered backend; blank: MILLM_BACKEND",
    )
    custom_name = serializers.CharField(max_length=100, required=False, allow_null=True, allow_blank=True)
    hf_token = HubTokenField()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["source"] == Model.Source.HUGGINGFACE and not attrs.get("repo_id"):
            raise serializers.ValidationError({"repo_id": ["repo_id is required for the huggingface source"]})
        if attrs["source"] == Model.Source.LOCAL and not attrs.get("local_path"):
            raise serializers.ValidationError({"local_path": ["local_path is required for the local source"]})
        return attrs


class ModelUpdateInput(serializers.Serializer):
    backend = serializers.CharField(
        max_length=32, allow_blank=True, help_text="a registered backend; blank: MILLM_BACKEND"
    )
    # any other field (name, quantization, local_path) is refused as unknown by
    # core.api.validated: a change that cannot happen here must not answer 200


class ModelPreviewInput(serializers.Serializer):
    repo_id = RepoIdField()
    revision = RevisionField()
    hf_token = HubTokenField()


class SAEDownloadInput(serializers.Serializer):
    repository_id = RepoIdField()
    file_path = serializers.CharField(max_length=500, required=False, allow_null=True, allow_blank=True, default="")
    revision = RevisionField()
    hf_token = HubTokenField()

    def validate_file_path(self, value: str | None) -> str:
        value = (value or "").strip()
        parts = value.split("/")
        if value.startswith("/") or ".." in parts:
            raise serializers.ValidationError("file_path must be relative, without '..'")
        return value


class SAECreateInput(SAEDownloadInput):
    """``POST /api/saes``: the hub download's fields, or a local directory to register."""

    source = serializers.ChoiceField(
        choices=[("huggingface", "Hugging Face hub"), ("local", "Local directory")], default="huggingface"
    )
    repository_id = RepoIdField(required=False, allow_null=True)
    local_path = serializers.CharField(
        max_length=1000,
        required=False,
        allow_null=True,
        help_text="local source: the SAE's directory (SAELens cfg.json + "
        "sae_weights.safetensors, or Gemma Scope params.npz), absolute",
    )
    name = serializers.CharField(
        max_length=200,
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="local source: default the directory's name",
    )
    trained_on = serializers.CharField(
        max_length=300,
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="local source: the model it was trained on, where its files do not say",
    )
    trained_layer = serializers.IntegerField(
        min_value=0,
        max_value=MAX_LAYER,
        required=False,
        allow_null=True,
        help_text="local source: the layer it was trained on, where its files do not say",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["source"] == "huggingface" and not attrs.get("repository_id"):
            raise serializers.ValidationError(
                {"repository_id": ["repository_id is required for the huggingface source"]}
            )
        if attrs["source"] == "local" and not attrs.get("local_path"):
            raise serializers.ValidationError({"local_path": ["local_path is required for the local source"]})
        return attrs


class SAEPreviewInput(serializers.Serializer):
    repository_id = RepoIdField()
    revision = RevisionField()
    hf_token = HubTokenField()


class AttachInput(serializers.Serializer):
    layer = serializers.IntegerField(min_value=0, max_value=MAX_LAYER)


class DetachInput(serializers.Serializer):
    layer = serializers.IntegerField(min_value=0, max_value=MAX_LAYER, required=False, allow_null=True)


class AttachSetItem(serializers.Serializer):
    sae_id = serializers.CharField(max_length=40)
    layer = serializers.IntegerField(min_value=0, max_value=MAX_LAYER)


class AttachSetInput(serializers.Serializer):
    attachments = AttachSetItem(many=True, allow_empty=False, max_length=64, required=False)
    # the original's clients send the set as ``saes``
    saes = AttachSetItem(
        many=True, allow_empty=False, max_length=64, required=False, help_text="the same list under the original's key"
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        given = [key for key in ("attachments", "saes") if key in attrs]
        if len(given) != 1:
            raise serializers.ValidationError({"attachments": ["give the set as attachments (or saes), once"]})
        return {"attachments": attrs[given[0]]}


class CompatibilityQuery(serializers.Serializer):
    layer = serializers.IntegerField(min_value=0, max_value=MAX_LAYER)


class JobListQuery(serializers.Serializer):
    kind = serializers.ChoiceField(choices=Job.Kind.choices, required=False)
    status = serializers.ChoiceField(choices=Job.Status.choices, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=500, default=50)
