"""An SAE attached to the resident model (``Attachment``), how one is prepared from its
files (``prepare_attachment``: read, checked against the model, loaded onto its device),
and telling an out-of-memory failure from others (``is_out_of_memory``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import ModelBackend
from ..api.errors import InsufficientMemory
from ..interp.hooks import AttachmentStats
from ..api.protocol import AttachmentKey, AttachmentStatus, AttachSpec
from ..sae import check_compatibility
from ..sae.layouts import config_at_layer, resolve_layout
from ..sae.module import SAE


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@dataclass
class Attachment:
    sae_id: str
    layer: int
    layer_module_path: str
    sae: SAE
    stats: AttachmentStats = field(default_factory=AttachmentStats)

    @property
    def hook_point(self) -> str:
        return self.sae.cfg.hook_point

    @property
    def key(self) -> AttachmentKey:
        return (self.sae_id, self.layer)

    def status(self) -> AttachmentStatus:
        cfg = self.sae.cfg
        return AttachmentStatus(
            sae_id=self.sae_id,
            layer=self.layer,
            layer_module_path=self.layer_module_path,
            d_in=cfg.d_in,
            d_sae=cfg.d_sae,
            activation=cfg.activation,
            layout=cfg.layout,
            path=cfg.path,
            steering_apply_count=self.stats.steering_apply_count,
            hook_point=cfg.hook_point,
        )


def prepare_attachment(backend: ModelBackend, spec: AttachSpec, model_id: str | None) -> tuple[Attachment, list[str]]:
    """``spec``'s SAE read, checked against the loaded model and loaded onto its device,
    with the compatibility warnings; nothing is installed yet."""
    layout, found = resolve_layout(spec.path, spec.layout)
    # a file of one vector per layer (layout "vector") gives the layer's own
    cfg = config_at_layer(layout, layout.read_metadata(found), spec.layer)
    report = check_compatibility(
        cfg, hidden_size=backend.hidden_size, num_layers=backend.num_layers, layer=spec.layer, model_name=model_id
    )
    report.raise_for_errors(spec.sae_id)
    # the layer is the one attached at; the hook point's kind comes from the SAE (a backend
    # that cannot hook it exactly refuses here, before anything is loaded or installed)
    path = backend.layer_module_path(spec.layer, cfg.hook_point)
    try:
        # a backend whose model lives in other processes keeps its own copy there and the
        # engine's on the host (``sae_device``)
        sae = SAE(cfg, layout.load_tensors(cfg), device=backend.sae_device)
    except Exception as exc:
        if is_out_of_memory(exc):
            raise InsufficientMemory(f"not enough memory for SAE {spec.sae_id!r}: {exc}") from exc
        raise
    return Attachment(spec.sae_id, spec.layer, path, sae), list(report.warnings)


__all__ = ["Attachment", "is_out_of_memory", "prepare_attachment"]
