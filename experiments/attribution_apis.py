"""``POST /api/experiments/attribution`` (docs/api.md, "Experiments"; docs/experiments.md,
"Attribution"): a thin view over ``experiments.attribution.attribution_run``. The body is
checked by its serializer first (422 VALIDATION_ERROR naming the field: sizes, one of
prompt or messages, the target's type); everything the engine's state decides (the SAE
attached, the backend's gradients, a target string that is one token) is the service's."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import body_object, envelope, validated
from core.run_apis import layer_field
from core.schema import enveloped
from experiments.attribution import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_TARGET_CHARS, attribution_run
from gpu_engine.api.jobs import MAX_ATTRIBUTION_ABLATE, MAX_ATTRIBUTION_TOP_N

EXPERIMENTS = ["experiments"]


class MessageInput(serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "user", "assistant"])
    content = serializers.CharField(allow_blank=True, trim_whitespace=False, max_length=MAX_PROMPT_CHARS)


class AttributionInput(serializers.Serializer):
    sae_id = serializers.CharField(max_length=100, help_text="the SAE's id; it must be attached")
    layer = layer_field("the attachment's layer; null: the SAE's only one")
    prompt = serializers.CharField(
        required=False,
        max_length=MAX_PROMPT_CHARS,
        trim_whitespace=False,
        help_text="a text, read as a completion prompt (with the model's special tokens)",
    )
    messages = MessageInput(
        many=True,
        required=False,
        min_length=1,
        max_length=MAX_MESSAGES,
        help_text="a conversation, rendered with the model's chat template",
    )
    add_generation_prompt = serializers.BooleanField(
        required=False, default=True, help_text="messages only: end with the assistant's header"
    )
    target_token = serializers.JSONField(
        required=False,
        allow_null=True,
        default=None,
        help_text="a token id, or the text of exactly one token (' Paris'); null: the greedy next token",
    )
    top_n = serializers.IntegerField(required=False, default=10, min_value=1, max_value=MAX_ATTRIBUTION_TOP_N)
    ablate_top = serializers.IntegerField(
        required=False,
        default=5,
        min_value=0,
        max_value=MAX_ATTRIBUTION_ABLATE,
        help_text="how many of the top features to check by ablation (≤ top_n)",
    )

    def validate_target_token(self, value: Any) -> int | str | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise serializers.ValidationError("a token id (integer) or the text of one token (string)")
        if isinstance(value, int) and value < 0:
            raise serializers.ValidationError("a token id is a non-negative integer")
        if isinstance(value, str) and not 1 <= len(value) <= MAX_TARGET_CHARS:
            raise serializers.ValidationError(f"a token's text is 1 to {MAX_TARGET_CHARS} characters")
        return value

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        given = [k for k in ("prompt", "messages") if data.get(k) is not None]
        if len(given) != 1:
            raise serializers.ValidationError({"prompt": ["give exactly one of prompt or messages"]})
        if data.get("prompt") == "":
            raise serializers.ValidationError({"prompt": ["the prompt is empty"]})
        if "messages" in data and sum(len(m["content"]) for m in data["messages"]) > MAX_PROMPT_CHARS:
            raise serializers.ValidationError({"messages": [f"at most {MAX_PROMPT_CHARS} characters in all"]})
        if "messages" not in data and "add_generation_prompt" in self.initial_data:
            raise serializers.ValidationError({"add_generation_prompt": ["applies to messages only"]})
        if data["ablate_top"] > data["top_n"]:
            raise serializers.ValidationError({"ablate_top": [f"at most top_n ({data['top_n']})"]})
        return data


class TokenOutput(serializers.Serializer):
    id = serializers.IntegerField()
    text = serializers.CharField(help_text="as the engine's tokenizer decodes that one id")


class TargetOutput(serializers.Serializer):
    id = serializers.IntegerField()
    text = serializers.CharField()
    logit = serializers.FloatField(help_text="its clean logit at the last position")
    greedy = serializers.BooleanField(help_text="the greedy next token (no target_token given)")


class HeatFeatureOutput(serializers.Serializer):
    index = serializers.IntegerField()
    attribution = serializers.FloatField()
    label = serializers.CharField(allow_null=True)


class HeatOutput(serializers.Serializer):
    position = serializers.IntegerField()
    total = serializers.FloatField(help_text="sum over features of |attribution| at this position")
    sum = serializers.FloatField(help_text="sum over features of attribution at this position")
    top = HeatFeatureOutput(many=True, help_text="the largest by magnitude at this position")


class FeatureOutput(serializers.Serializer):
    index = serializers.IntegerField()
    attribution = serializers.FloatField(help_text="activation × gradient, summed over positions")
    activation_sum = serializers.FloatField()
    max_position = serializers.IntegerField()
    max_attribution = serializers.FloatField()
    ablation_delta = serializers.FloatField(
        allow_null=True, help_text="logit with the feature zeroed at every position − clean logit"
    )
    label = serializers.CharField(allow_null=True)
    dashboard = serializers.CharField(help_text="the feature's page: /features/<sae>/<index>/")


class AttributionOutput(serializers.Serializer):
    sae_id = serializers.CharField()
    layer = serializers.IntegerField()
    backend = serializers.CharField()
    model = serializers.CharField()
    tokens = TokenOutput(many=True)
    target = TargetOutput()
    heat = HeatOutput(many=True)
    features = FeatureOutput(many=True)
    top_n = serializers.IntegerField()
    ablate_top = serializers.IntegerField()


class AttributionApi(APIView):
    @extend_schema(
        tags=EXPERIMENTS,
        summary="Attribute the next token's logit to an attached SAE's features (transformers only)",
        operation_id="experiments_attribution",
        request=AttributionInput,
        responses=enveloped(AttributionOutput),
    )
    def post(self, request) -> Response:
        return envelope(attribution_answer(validated(AttributionInput, body_object(request))))


def attribution_answer(data: dict[str, Any]) -> dict[str, Any]:
    """``AttributionOutput`` for ``AttributionInput``'s checked ``data``: the route's and
    ``manage.py attribution``'s one way in."""
    return attribution_run(
        sae_id=data["sae_id"],
        layer=data["layer"],
        prompt=data.get("prompt"),
        messages=[dict(m) for m in data["messages"]] if "messages" in data else None,
        add_generation_prompt=data["add_generation_prompt"],
        target_token=data["target_token"],
        top_n=data["top_n"],
        ablate_top=data["ablate_top"],
    )
