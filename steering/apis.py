"""/api/saes/steering* (live steering) and /api/profiles: thin views, one per action.
Each validates its input, calls one service or selector and answers the envelope."""

from __future__ import annotations

import json
import re

from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import body_object, envelope, validated
from core.auth import principal
from core.errors import Forbidden, SAENotAttached, ValidationFailed
from core.schema import enveloped
from steering import live, rules, services
from steering import serializers as io
from steering.documents import load_document
from steering.errors import PayloadTooLarge
from steering.models import Profile
from steering.profiles import steering_map

STEERING, PROFILES = ["steering"], ["profiles"]
TARGET = [
    OpenApiParameter("sae_id", str, required=False),
    OpenApiParameter("layer", int, required=False),
    OpenApiParameter(
        "scope",
        str,
        required=False,
        description="`global` (default) or `key:<label>`; an inference key may name only its own",
    ),
]
SCOPE = re.compile(r"key:[A-Za-z0-9_.@-]{1,64}")


def _target(request) -> dict:
    """sae_id / layer from the body, else the query."""
    data = {k: v for k, v in request.query_params.items() if k in ("sae_id", "layer", "scope")}
    data.update({k: v for k, v in body_object(request).items() if k in ("sae_id", "layer", "scope")})
    target = validated(io.ScopedTargetInput, data)
    return {"sae_id": target.get("sae_id"), "layer": target.get("layer")}


def _scope(request) -> str:
    """The live-steering scope a call addresses: ``scope`` from the body, else the query,
    else ``global`` (for every caller, so a call without it answers as before scopes). An
    inference key may address only its own, ``key:<its label>`` (403 FORBIDDEN before
    anything is read or changed); an admin key, and everyone with keys off, any."""
    data = {k: v for k, v in request.query_params.items() if k == "scope"}
    data.update({k: v for k, v in body_object(request).items() if k == "scope"})
    asked = data.get("scope")
    if asked is None:
        asked = live.GLOBAL
    if not isinstance(asked, str) or not (asked == live.GLOBAL or SCOPE.fullmatch(asked)):
        raise ValidationFailed(
            "scope must be 'global' or 'key:<label>'", details={"fields": {"scope": ["'global' or 'key:<label>'"]}}
        )
    caller = principal(request)
    if not caller.admin and asked != live.key_scope(caller.owner):
        raise Forbidden(
            f"Live steering scope {asked!r} needs an admin key (MILLM_ADMIN_API_KEYS); "
            f"this inference key may address only its own (scope={caller.owner})",
            details={"param": "scope"},
        )
    return asked


def raw_document(request) -> tuple[dict, str | None]:
    """An import body, with its exact text (the export gives it back unchanged)."""
    try:
        body = request.body
    except RequestDataTooBig:
        raise PayloadTooLarge("The document is larger than the server accepts", details={}) from None
    data, text = load_document(body)
    if set(data) >= {"success", "data"} and isinstance(data.get("data"), dict):
        data, text = data["data"], None  # an answer of ours, saved with its envelope
    return data, text


def raw_json(text: str, filename: str) -> HttpResponse:
    response = HttpResponse(text, content_type="application/json")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


# --------------------------------------------------------------------------- live steering


class SteeringApi(APIView):
    @extend_schema(
        tags=STEERING,
        summary="Live steering of one attachment (the named one, else the only one)",
        parameters=TARGET,
        responses=enveloped(io.SteeringStateOutput),
    )
    def get(self, request) -> Response:
        target = _target(request)
        scope = _scope(request)
        try:
            attachment = services.attachment_choose(**target)
        except SAENotAttached:
            if target["sae_id"] is not None or target["layer"] is not None:
                raise
            return envelope(
                {
                    "sae_id": None,
                    "layer": None,
                    "enabled": False,
                    "values": {},
                    "controls": [],
                    "active_count": 0,
                    "source": "manual",
                }
                | ({} if scope == live.GLOBAL else {"scope": scope})
            )
        return envelope(services.live_state(attachment=attachment, scope=scope))

    @extend_schema(
        tags=STEERING,
        summary="Set one feature's value (enables steering)",
        request=io.SteeringSetInput,
        responses=enveloped(io.SteeringStateOutput),
    )
    def post(self, request) -> Response:
        data = validated(io.SteeringSetInput, body_object(request))
        control = rules.control_parse(
            {
                "index": data["feature_idx"],
                **{k: data[k] for k in ("mode", "value", "phase", "window", "condition") if data.get(k) is not None},
            }
        )
        scope, attachment = _scope(request), services.attachment_choose(**_target(request))
        return envelope(services.live_set(attachment=attachment, values={}, controls=[control], scope=scope))

    @extend_schema(
        tags=STEERING,
        summary="Clear every value and disable",
        parameters=TARGET,
        request=None,
        responses=enveloped(io.SteeringStateOutput),
    )
    def delete(self, request) -> Response:
        scope, attachment = _scope(request), services.attachment_choose(**_target(request))
        return envelope(services.live_clear(attachment=attachment, scope=scope))


class SteeringBatchApi(APIView):
    @extend_schema(
        tags=STEERING,
        summary="Set up to 1000 values, all or nothing",
        request=io.SteeringBatchInput,
        responses=enveloped(io.SteeringStateOutput),
    )
    def post(self, request) -> Response:
        data = validated(io.SteeringBatchInput, body_object(request))
        values = steering_map(data["steering"])
        controls = rules.controls_parse(data["controls"])
        scope, attachment = _scope(request), services.attachment_choose(**_target(request))
        return envelope(services.live_set(attachment=attachment, values=values, controls=controls, scope=scope))


class SteeringEnableApi(APIView):
    enabled = True

    @extend_schema(
        tags=STEERING,
        summary="Apply (or stop applying) the configured values",
        request=io.ScopedTargetInput,
        responses=enveloped(io.SteeringStateOutput),
    )
    def post(self, request) -> Response:
        scope, attachment = _scope(request), services.attachment_choose(**_target(request))
        return envelope(services.live_enable(attachment=attachment, enabled=self.enabled, scope=scope))


class SteeringDisableApi(SteeringEnableApi):
    enabled = False


class SteeringFeatureApi(APIView):
    @extend_schema(
        tags=STEERING,
        summary="Remove one feature (the last one disables)",
        operation_id="saes_steering_feature_destroy",
        parameters=TARGET,
        request=None,
        responses=enveloped(io.SteeringStateOutput),
    )
    def delete(self, request, feature_idx: int) -> Response:
        scope, attachment = _scope(request), services.attachment_choose(**_target(request))
        return envelope(services.live_remove(attachment=attachment, index=feature_idx, scope=scope))


# --------------------------------------------------------------------------- profiles


class ProfileListApi(APIView):
    @extend_schema(
        tags=PROFILES, summary="List profiles", operation_id="profiles_list", responses=enveloped(OpenApiTypes.OBJECT)
    )
    def get(self, request) -> Response:
        rows = [io.profile_out(p) for p in Profile.objects.all()]
        return envelope({"profiles": rows, "total": len(rows)})

    @extend_schema(
        tags=PROFILES,
        summary="Create a profile (unique name)",
        request=io.ProfileInput,
        responses={201: enveloped(OpenApiTypes.OBJECT)},
    )
    def post(self, request) -> Response:
        data = validated(io.ProfileInput, body_object(request))
        profile = services.profile_create(
            name=data["name"],
            steering=data.get("steering") or {},
            controls=data.get("controls") or [],
            sae_id=data.get("sae_id") or None,
            layer=data.get("layer"),
            model_name=data.get("model_id") or "",
            description=data.get("description") or "",
            intensity=data.get("intensity", 1.0),
        )
        return envelope(io.profile_out(profile), status_code=status.HTTP_201_CREATED)


class ProfileSaveCurrentApi(APIView):
    @extend_schema(
        tags=PROFILES,
        summary="Save the live steering of one attachment as a profile",
        request=io.SaveCurrentInput,
        responses={201: enveloped(OpenApiTypes.OBJECT)},
    )
    def post(self, request) -> Response:
        data = validated(io.SaveCurrentInput, body_object(request))
        profile = services.profile_save_current(
            name=data["name"],
            description=data.get("description") or "",
            sae_id=data.get("sae_id"),
            layer=data.get("layer"),
        )
        return envelope(io.profile_out(profile), status_code=status.HTTP_201_CREATED)


class ProfileActiveApi(APIView):
    @extend_schema(tags=PROFILES, summary="The active profile (or null)", responses=enveloped(OpenApiTypes.OBJECT))
    def get(self, request) -> Response:
        profile = Profile.objects.filter(is_active=True).first()
        return envelope(io.profile_out(profile) if profile else None)


class ProfileImportApi(APIView):
    @extend_schema(
        tags=PROFILES,
        summary="Import a profile export (also the features form)",
        parameters=[OpenApiParameter("on_conflict", str, required=False, enum=["fail", "rename"])],
        request=OpenApiTypes.OBJECT,
        responses={201: enveloped(OpenApiTypes.OBJECT)},
    )
    def post(self, request) -> Response:
        query = validated(io.ImportQuery, request.query_params)
        data, _ = raw_document(request)
        profile = services.profile_import(document=data, on_conflict=query.get("on_conflict") or "fail")
        return envelope(io.profile_out(profile), status_code=status.HTTP_201_CREATED)


class ProfileDetailApi(APIView):
    @extend_schema(tags=PROFILES, summary="One profile (by id or name)", responses=enveloped(OpenApiTypes.OBJECT))
    def get(self, request, profile_id: str) -> Response:
        return envelope(io.profile_detail_out(services.profile_get(profile_id=profile_id)))

    @extend_schema(
        tags=PROFILES,
        summary="Update (steering, when given, replaces the map)",
        request=io.ProfileUpdateInput,
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def patch(self, request, profile_id: str) -> Response:
        profile = services.profile_get(profile_id=profile_id)
        data = validated(io.ProfileUpdateInput, body_object(request))
        return envelope(io.profile_out(services.profile_update(profile=profile, data=data)))

    put = patch

    @extend_schema(
        tags=PROFILES,
        summary="Delete (an active profile is deactivated first)",
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def delete(self, request, profile_id: str) -> Response:
        profile = services.profile_get(profile_id=profile_id)
        services.profile_delete(profile=profile)
        return envelope({"status": "deleted", "id": profile.pk})


class ProfileActivateApi(APIView):
    @extend_schema(
        tags=PROFILES,
        summary="Activate: replaces the live steering (validated first; values × λ, each clamped to ±200)",
        request=io.IntensityInput,
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def post(self, request, profile_id: str) -> Response:
        profile = services.profile_get(profile_id=profile_id)
        data = validated(io.IntensityInput, {**request.query_params.dict(), **body_object(request)})
        profile = services.profile_activate(profile=profile, intensity=data.get("intensity"))
        return envelope(io.profile_out(profile))


class ProfileDeactivateApi(APIView):
    @extend_schema(
        tags=PROFILES,
        summary="Deactivate (clears the live steering unless clear_steering=false)",
        parameters=[OpenApiParameter("clear_steering", bool, required=False)],
        request=None,
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def post(self, request, profile_id: str) -> Response:
        profile = services.profile_get(profile_id=profile_id)
        clear = str(request.query_params.get("clear_steering", "true")).lower() != "false"
        profile = services.profile_deactivate(profile=profile, clear_steering=clear)
        return envelope(io.profile_out(profile))


class ProfileExportApi(APIView):
    @extend_schema(
        tags=PROFILES,
        summary="Export as versioned JSON (the document itself, ready for import)",
        responses={(200, "application/json"): OpenApiTypes.OBJECT},
    )
    def get(self, request, profile_id: str) -> HttpResponse:
        profile = services.profile_get(profile_id=profile_id)
        return raw_json(json.dumps(services.profile_export(profile=profile), indent=2), f"{profile.name}.profile.json")
