"""Computing a steering vector on the resident model from contrastive prompt pairs
(docs/steering.md, "Raw steering vectors"): the engine returns the unsteered residual
after block L for every prompt (``hidden_states``), and the vector is

    v = mean_i h_L(positive_i) - mean_i h_L(negative_i)

with ``h_L`` pooled at the last token (default) or over every token of the prompt.  The
result is stored by ``registry.vectors.vector_create`` as our own file."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Sequence

import numpy as np
import structlog

from audit.services import audited
from core.engines import several_engines
from core.errors import ModelNotLoaded, from_engine_error
from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from gpu_engine.api.protocol import HiddenStatesJob
from registry.errors import VectorInvalid
from registry.engines import addressing_model
from registry.models import SAE, Model
from registry.selectors import model_loaded
from registry.vectors import check_layers, check_name_free, vector_create

log = structlog.get_logger(__name__)


@audited(
    "vector.compute",
    lambda kw, r: ("vector", getattr(r, "id", ""), kw.get("name", "")),
    params=lambda kw: {"layer": kw.get("layer"), "pairs": len(kw.get("pairs") or ()), "pooling": kw.get("pooling")},
)
def vector_compute(
    *, name: str, layer: int, pairs: Sequence[tuple[str, str]], model_name: str | None = None, pooling: str = "last"
) -> SAE:
    """The mean difference of positive and negative prompts' residuals after block
    ``layer`` of the resident model, stored as a steering vector for that model. With
    several engines, on the engine holding ``model_name`` (which is then required)."""
    if several_engines():
        if not model_name:
            raise VectorInvalid(
                "several engines (ENGINE_MODELS): name the model whose residuals to read",
                details={"field": "model"},
            )
        row = Model.objects.filter(name=model_name).first()
        if row is None and str(model_name).isdigit():
            row = Model.objects.filter(pk=int(model_name)).first()
        with addressing_model(row.name if row is not None else model_name):
            return _vector_compute(name=name, layer=layer, pairs=pairs, model_name=model_name, pooling=pooling)
    return _vector_compute(name=name, layer=layer, pairs=pairs, model_name=model_name, pooling=pooling)


def _vector_compute(
    *, name: str, layer: int, pairs: Sequence[tuple[str, str]], model_name: str | None, pooling: str
) -> SAE:
    model = model_loaded()
    if model is None:
        raise ModelNotLoaded("No model is loaded; computing a steering vector runs prompts through the resident model")
    if model_name and model_name not in (model.name, str(model.id)):
        raise VectorInvalid(
            f"model {model_name!r} is not the resident model ({model.name!r})",
            details={"field": "model", "resident": model.name},
        )
    pairs = [(str(p), str(n)) for p, n in pairs]
    if not pairs or any(not p or not n for p, n in pairs):
        raise VectorInvalid(
            "give at least one pair, each with a non-empty positive and negative prompt", details={"field": "pairs"}
        )
    check_layers(model, [layer])
    check_name_free(name)  # before the prompts run
    job = HiddenStatesJob(
        request_id=f"vec-{secrets.token_hex(6)}",
        inputs=[p for p, _ in pairs] + [n for _, n in pairs],
        layers=[layer],
        pooling=pooling,
    )
    try:
        result = runtime().engine.hidden_states(job)
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    states = np.asarray(result.states, dtype=np.float64)[:, 0, :]  # (2n, d)
    n = len(pairs)
    vector = states[:n].mean(axis=0) - states[n:].mean(axis=0)
    digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
    recipe = {
        "method": "mean_difference",
        "pairs": n,
        "pooling": pooling,
        "layer": layer,
        "hook_point": "resid_post",
        "add_special_tokens": True,
        "pairs_sha256": digest,
    }
    sae = vector_create(
        name=name, model=model, vectors={layer: vector}, source=SAE.VectorSource.COMPUTED, recipe=recipe
    )
    log.info("vector_computed", sae_id=sae.id, layer=layer, pairs=n, pooling=pooling)
    return sae
