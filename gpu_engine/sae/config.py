"""The SAE configuration every layout normalises to (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import SAEFormatError

ACTIVATIONS = ("relu", "jumprelu", "topk")


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
    apply_b_dec_to_input: bool = False
    dtype: str = "float32"
    weights_file: str = ""
    config_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("d_in", "d_sae"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SAEFormatError(f"SAE {name} must be a positive integer, got {value!r}", details={"path": self.path})
        if self.activation not in ACTIVATIONS:
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
        if self.layer is not None and (isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0):
            raise SAEFormatError(f"SAE trained-on layer must be a non-negative integer, got {self.layer!r}", details={"path": self.path})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SAEConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
