"""A request's inline raw vectors (``steering.vectors``) placed at the attachments whose
hooks add them (docs/steering.md, "Inline vectors").

A vector names a layer and a hook point (resid_post, or resid_pre: the same module as
resid_post one layer below); it is added at an attachment hooked on that module, whatever
SAE it holds: the SAE is only where the hook is, the vector is added as sent. No layer:
the attachment the steering object names (``sae_id`` / ``layer``, or the only one). The
width is checked here against the attachment's (the engine checks it again against the
SAE it holds)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from core.errors import SAENotAttached
from gpu_engine.api.steering import SteeringVector
from steering import rules
from steering.errors import SteeringInvalid
from steering.selectors import attachment_choices, attachment_pick


@dataclass(frozen=True)
class VectorAsk:
    """One inline vector as the request sent it, with the body locations its errors name."""

    vector: SteeringVector
    width: int
    layer: int | None
    hook: str
    layer_param: str
    data_param: str


def _module(hook: str, layer: int) -> int | None:
    """The decoder block whose output ``hook`` of ``layer`` is (-1: the embeddings)."""
    return {"resid_post": layer, "resid_pre": layer - 1}.get(hook)


def place_vectors(
    *,
    attachments: Sequence[Any],
    asks: Sequence[VectorAsk],
    sae_id: str | None,
    layer: int | None,
    sae_param: str,
    intensity: float | None,
) -> dict[tuple[str, int], list[SteeringVector]]:
    """Each vector at its attachment's key, its strength dialled by ``intensity``."""
    placed: dict[tuple[str, int], list[SteeringVector]] = {}
    for ask in asks:
        if ask.layer is None:
            att = attachment_pick(attachments=attachments, sae_id=sae_id, layer=layer, param=sae_param)
        else:
            target = _module(ask.hook, ask.layer)
            matches = sorted(
                (
                    a
                    for a in attachments
                    if (sae_id is None or a.sae_id == sae_id) and _module(a.hook_point, a.layer) == target
                ),
                key=lambda a: (a.sae_id, a.layer),
            )
            if not matches:
                raise SAENotAttached(
                    f"no SAE is attached at the {ask.hook} of layer {ask.layer}, where {ask.layer_param} adds "
                    f"its vector (an inline vector is added at an attachment's hook); attached: "
                    f"{', '.join(attachment_choices(attachments)) or 'none'}",
                    details={"param": ask.layer_param, "layer": ask.layer},
                )
            att = matches[0]  # several SAEs hooked on one module: the same place
        if ask.width != att.d_in:
            raise SteeringInvalid(
                f"{ask.data_param}: the vector is {ask.width} wide; the stream at {att.sae_id}@{att.layer} "
                f"is {att.d_in} wide",
                details={"param": ask.data_param, "width": ask.width, "expected": att.d_in},
            )
        vector = ask.vector
        if intensity is not None and not vector.projects:  # a clamp's strength is a blend in [0, 1]: not dialled
            vector = msgspec.structs.replace(vector, strength=rules.dial(vector.strength, intensity))
        placed.setdefault((att.sae_id, att.layer), []).append(vector)
    return placed


__all__ = ["VectorAsk", "place_vectors"]
