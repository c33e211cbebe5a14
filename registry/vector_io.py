"""Wire shapes of /api/vectors (docs/api.md, "Steering vectors"): inputs and outputs."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from registry.models import SAE

MAX_PAIRS = 1024
POOLINGS = ("last", "mean")


class VectorUploadInput(serializers.Serializer):
    """multipart/form-data: the file and what it is."""

    file = serializers.FileField(help_text="safetensors: one 1-D tensor per layer, named layer.<L> (docs/steering.md)")
    name = serializers.CharField(max_length=200)
    model = serializers.CharField(max_length=200, help_text="the registered model it was made for (id or name)")
    layer = serializers.IntegerField(
        min_value=0, required=False, allow_null=True, help_text="keep only this layer's vector (default: all)"
    )


class PairInput(serializers.Serializer):
    positive = serializers.CharField(max_length=20_000, trim_whitespace=False)
    negative = serializers.CharField(max_length=20_000, trim_whitespace=False)


class VectorComputeInput(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    layer = serializers.IntegerField(min_value=0)
    pairs = PairInput(many=True, allow_empty=False, max_length=MAX_PAIRS)
    model = serializers.CharField(
        max_length=200, required=False, allow_blank=True, help_text="must name the resident model when given"
    )
    pooling = serializers.ChoiceField(
        choices=POOLINGS,
        default="last",
        help_text="last: the last token's residual (default); mean: the mean over the prompt's tokens",
    )


class VectorOutput(serializers.Serializer):
    id = serializers.CharField()
    name = serializers.CharField()
    model = serializers.CharField(allow_null=True)
    layers = serializers.ListField(child=serializers.IntegerField())
    norms = serializers.DictField(child=serializers.FloatField(), help_text="L2 norm of each layer's vector, by layer")
    d_model = serializers.IntegerField(allow_null=True)
    hook_point = serializers.CharField()
    source = serializers.CharField(help_text="upload or computed")
    recipe = serializers.DictField()
    local_path = serializers.CharField(allow_null=True)
    status = serializers.CharField()
    attached_layers = serializers.ListField(child=serializers.IntegerField())
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


def vector_out(sae: SAE) -> dict[str, Any]:
    layers = list(sae.vector_layers or [])
    return VectorOutput(
        {
            "id": sae.id,
            "name": sae.name,
            "model": sae.trained_on_model or None,
            "layers": layers,
            "norms": {str(k): v for k, v in zip(layers, sae.vector_norms or [], strict=False)},
            "d_model": sae.d_in,
            "hook_point": "resid_post",
            "source": sae.vector_source,
            "recipe": sae.vector_recipe or {},
            "local_path": sae.local_path or None,
            "status": sae.status,
            "attached_layers": sorted(sae.attachments.values_list("layer", flat=True)),
            "created_at": sae.created_at,
            "updated_at": sae.updated_at,
        }
    ).data


class VectorListOutput(serializers.Serializer):
    vectors = VectorOutput(many=True)
    total = serializers.IntegerField()
