"""The SAE configuration every layout normalises to (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..api.errors import SAEFormatError
from .hookpoints import DEFAULT_HOOK_POINT, HOOK_POINTS

ACTIVATIONS = ("relu", "jumprelu", "topk", "gated")
# SAELens's ``normalize_activations`` values we apply exactly (module.SAE): none;
# ``expected_average_only_in`` (a constant input scale, folded into the weights when the
# file gives ``norm_scaling_factor``); ``constant_norm_rescale`` (each input row scaled to
# norm sqrt(d_in) before encoding)
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale")


@dataclass(frozen=True)
class SAEConfig:
    """What we know about an SAE before (or without) loading its weights.

    ``layer`` and ``model_name`` are what the SAE was trained on, when its files say so;
    they feed compatibility *warnings*, never the layer we attach to.
    """

    d_in: int
    d_sae: int
    activation: str
    layout: str
    path: str = ""
    k: int | None = None
    model_name: str | None = None
    layer: int | None = None
    hook_name: str | None = None
    # the kind of point the SAE reads and writes (``hookpoints.HOOK_POINTS``)
    hook_point: str = DEFAULT_HOOK_POINT
    normalize_activations: str = "none"
    norm_scaling_factor: float | None = None
    # TopK SAEs trained with decoder-norm rescaling rank ``pre * |W_dec[i]|``
    rescale_acts_by_decoder_norm: bool = False
    apply_b_dec_to_input: bool = False
    dtype: str = "float32"
    weights_file: str = ""
    config_file: str | None = None
    # False for a raw steering vector (layout "vector"): decoder rows only, so nothing
    # can be encoded (no monitoring, clamp, scale or condition on it)
    has_encoder: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("d_in", "d_sae"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SAEFormatError(
                    f"SAE {name} must be a positive integer, got {value!r}", details={"path": self.path}
                )
        if not self.has_encoder:
            if self.activation != "none":
                raise SAEFormatError(
                    f"an SAE without an encoder has activation 'none', got {self.activation!r}",
                    details={"path": self.path},
                )
        elif self.activation not in ACTIVATIONS:
            raise SAEFormatError(
                f"Unsupported SAE activation {self.activation!r}; supported: {', '.join(ACTIVATIONS)}",
                details={"path": self.path, "activation": self.activation},
            )
        bad_k = isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 < self.k <= self.d_sae
        if self.activation == "topk" and bad_k:
            raise SAEFormatError(
                f"TopK SAE needs 0 < k <= d_sae ({self.d_sae}), got k={self.k!r}",
                details={"path": self.path, "k": self.k},
            )
        if self.hook_point not in HOOK_POINTS:
            raise SAEFormatError(
                f"Unknown SAE hook point {self.hook_point!r}; known: {', '.join(HOOK_POINTS)}",
                details={"path": self.path, "hook_point": self.hook_point},
            )
        if self.normalize_activations not in NORMALIZATIONS:
            raise SAEFormatError(
                f"SAE activation normalisation {self.normalize_activations!r} is not supported; "
                f"supported: {', '.join(NORMALIZATIONS)}",
                details={"path": self.path, "normalize_activations": self.normalize_activations},
            )
        factor = self.norm_scaling_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            raise SAEFormatError(
                f"norm_scaling_factor must be a positive number, got {factor!r}", details={"path": self.path}
            )
        if self.layer is not None and (
            isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0
        ):
            raise SAEFormatError(
                f"SAE trained-on layer must be a non-negative integer, got {self.layer!r}", details={"path": self.path}
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SAEConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
