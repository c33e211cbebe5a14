"""The steering of ``manage.py capture``'s lines, decided as /v1 decides a request's: the
line's (or the command's) ``steering``, ``profile`` and ``steering_intensity`` are read by
the /v1 request model (``inference.protocol``), turned into the resolver's arguments by
``inference.planning.steering_args`` and resolved by ``steering_resolve_request`` against
the attachments the engine holds; then checked against what the loaded backend can run
(its capabilities, and a raw vector's missing encoder) before any line runs.

What differs from /v1: a line that names no steering runs unsteered, never the live
steering set through /api (an offline capture is reproducible from its input alone), so
``steering_intensity`` alone, with nothing to dial, is refused.

Every refusal is an ``OfflineSteeringError`` naming the line (or the command option the
value came from) and the field, with /v1's error code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from core.errors import MillmError
from gpu_engine.api.capabilities import Capabilities
from gpu_engine.api.errors import EngineError
from gpu_engine.api.protocol import AttachmentStatus, refuse_encoder_controls, to_builtins
from inference.errors import OpenAIError, openai_error_from_exception, openai_error_from_validation
from inference.planning import steering_args
from inference.protocol import CompletionRequest
from steering.services import ResolvedSteering, steering_resolve_request

# a line's keys that say how it is steered, as a /v1 body spells them
STEERING_KEYS = ("steering", "profile", "steering_intensity")
# the layout of a raw steering vector's attachment (an SAE with no encoder)
VECTOR_LAYOUT = "vector"


class OfflineSteeringError(Exception):
    """A line's steering refused: ``where`` is ``line <n>`` (and the option its value came
    from), ``error`` /v1's error for it (code, param, message)."""

    def __init__(self, where: str, error: OpenAIError) -> None:
        self.where = where
        self.error = error
        message = error.message
        if error.param and message.startswith(f"{error.param}: "):
            message = message[len(error.param) + 2 :]
        param = f"{error.param}: " if error.param else ""
        super().__init__(f"{where}: {param}{error.code}: {message}")


@dataclass(frozen=True)
class LineSteering:
    """What one line asks: the body fields as sent (``body``), and for each the option it
    came from (``origin``; absent: the line itself)."""

    line: int
    body: dict[str, Any]
    origin: dict[str, str]

    @property
    def asked(self) -> bool:
        return bool(self.body)

    def where(self, param: str | None = None) -> str:
        keys = [k for k in STEERING_KEYS if param is not None and (param == k or param.startswith(f"{k}."))]
        options = sorted({self.origin[k] for k in (keys or self.body) if k in self.origin})
        return f"line {self.line}" + (f" ({', '.join(options)})" if options else "")


def line_steering(line: int, item: Mapping[str, Any], defaults: Mapping[str, tuple[Any, str]]) -> LineSteering:
    """A line's steering fields over the command's (``defaults``: field -> (value, option)).
    A line that sends ``steering`` or ``profile`` replaces both of the command's (it would
    otherwise name both, which is refused); its ``steering_intensity`` replaces the
    command's. ``null`` is not sent, as on /v1."""
    body: dict[str, Any] = {}
    origin: dict[str, str] = {}
    own = {k: item[k] for k in STEERING_KEYS if item.get(k) is not None}
    base = ("steering", "profile")
    for key in STEERING_KEYS:
        if key in own:
            body[key] = own[key]
        elif key in defaults and not (key in base and any(k in own for k in base)):
            body[key], origin[key] = defaults[key]
    return LineSteering(line, body, origin)


def refused(asked: LineSteering, exc: BaseException) -> OfflineSteeringError:
    """``exc`` (a validation, domain or engine error) as /v1 answers it, at this line."""
    error = openai_error_from_validation(exc) if isinstance(exc, ValidationError) else openai_error_from_exception(exc)
    return OfflineSteeringError(asked.where(error.param), error)


def read(asked: LineSteering, model: str) -> CompletionRequest | None:
    """The line's steering fields read by the /v1 request model (None: it asks none)."""
    if not asked.asked:
        return None
    try:
        req = CompletionRequest.model_validate({"model": model, "prompt": "-", **asked.body})
    except ValidationError as exc:
        raise refused(asked, exc) from None
    if req.steering is None and req.profile is None:
        raise OfflineSteeringError(
            asked.where("steering_intensity"),
            OpenAIError(
                "steering_intensity dials steering or a profile, and this line names neither "
                "(the offline command runs no live steering)",
                status=400,
                code="invalid_parameter",
                param="steering_intensity",
            ),
        )
    return req


def resolve(
    asked: LineSteering,
    req: CompletionRequest | None,
    *,
    attachments: Sequence[AttachmentStatus],
    model: str,
    capabilities: Capabilities | None = None,
    backend: str | None = None,
) -> ResolvedSteering | None:
    """The line's steering resolved against ``attachments`` as a /v1 request's is, and
    checked against the backend (``capabilities``, when known) and the vectors among the
    attachments: None when the line asks none (it runs unsteered)."""
    if req is None:
        return None
    try:
        resolved = steering_resolve_request(
            attachments=attachments, model_name=model, check_indices=True, **steering_args(req, req.profile)
        )
        spec = resolved.spec
        if spec is None:
            # /v1 runs a profile unsteered while no SAE is attached; a line asked for it
            raise OpenAIError(
                f"profile {req.profile!r} steers an SAE, and none is attached",
                status=400,
                code="sae_not_attached",
                param="profile",
            )
        if spec is not None:
            layouts = {(a.sae_id, a.layer): a.layout for a in attachments}
            for entry in spec.entries:
                if layouts.get(entry.key) == VECTOR_LAYOUT:
                    refuse_encoder_controls(entry)
        if spec is not None and capabilities is not None:
            _check_capabilities(spec, capabilities, backend or "loaded")
    except (MillmError, EngineError, OpenAIError) as exc:
        raise refused(asked, exc) from None
    return resolved


def _check_capabilities(spec: Any, caps: Capabilities, backend: str) -> None:
    """What the engine refuses a job for before it runs (``gpu_engine.runtime.prepare.
    check_capabilities``), asked of the steering before any line is sent."""
    needs = []
    if not spec.is_empty():
        needs.append(("per_request_steering", caps.per_request_steering, "steering"))
    if spec.has_controls():
        needs.append(("steering_controls", caps.steering_controls, "steering.features.mode"))
    for capability, has, param in needs:
        if not has:
            raise OpenAIError(
                f"the {backend} backend cannot honour {param} ({capability} is off)",
                status=400,
                code="invalid_parameter",
                param=param,
            )


def summary(resolved: ResolvedSteering | None, result: Any) -> dict[str, Any]:
    """The index line's record of what ran, as a /v1 response's ``millm`` says it:
    ``steering`` (mode, description, profile, intensity, entries, hash; None: unsteered),
    ``steering_apply_count`` and, when a conditional control fired, ``steering_fired``."""
    out: dict[str, Any] = {
        "steering": resolved.summary() if resolved is not None else None,
        "steering_apply_count": to_builtins(list(result.steering_apply_count)),
    }
    if result.steering_fired:
        out["steering_fired"] = to_builtins(list(result.steering_fired))
    return out
