"""Raw steering vectors as registry rows: ``SAE`` rows with ``format="vector"``
(docs/steering.md, "Raw steering vectors").

A vector is created from a file (an upload, or ``manage.py vector import``) or from an
array computed on the resident model (``orchestration.vectors.vector_compute``).  Either
way miLLM writes its own copy, ``<SAE_CACHE_DIR>/vectors/<id>/vector.safetensors``, in the
one format the engine's ``vector`` layout reads, and records that it owns those files
(``files_owned``), so deleting the row removes that copy and nothing else: the file a
user imported from stays where it was.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from django.conf import settings
from django.db import transaction

from audit.services import audited
from gpu_engine.api.errors import EngineError
from gpu_engine.api.sae import read_vector_header, read_vectors, write_vector_file
from registry.errors import VectorAlreadyExists, VectorInvalid, VectorNotFound
from registry.models import SAE, Model

log = structlog.get_logger(__name__)

VECTOR_DIR = "vectors"
# an upload larger than this is refused before it is parsed (a 128-layer, 16k-wide float32
# file is 8 MiB)
MAX_VECTOR_FILE_BYTES = 256 * 2**20


def _invalid(message: str, field: str, **details: Any) -> VectorInvalid:
    return VectorInvalid(message, details={"field": field, **details})


def vector_dir(sae_id: str) -> Path:
    return Path(settings.SAE_CACHE_DIR) / VECTOR_DIR / sae_id


def vector_read_file(*, path: Path, model: Model, layer: int | None = None) -> dict[int, np.ndarray]:
    """The vectors of a file checked for ``model`` (every layer's, or ``layer``'s alone),
    or ``VectorInvalid`` naming the field: ``file`` (not a vector file, pickle, NaN, the
    wrong width) or ``layer`` (not in the file, past the model's blocks)."""
    try:
        info = read_vector_header(path)
        vectors = read_vectors(path)
    except EngineError as exc:
        raise _invalid(f"not a steering vector file: {exc.message}", "file") from exc
    except OSError as exc:
        raise _invalid(f"cannot read the file: {exc}", "file") from exc
    if model.hidden_size and info.d_model != model.hidden_size:
        raise _invalid(
            f"the vectors have {info.d_model} values; model {model.name!r} has hidden size {model.hidden_size}",
            "file",
            d_model=info.d_model,
            hidden_size=model.hidden_size,
        )
    if layer is not None:
        if layer not in vectors:
            raise _invalid(
                f"the file has no vector for layer {layer} (it has {list(info.layers)})",
                "layer",
                layer=layer,
                layers=list(info.layers),
            )
        vectors = {layer: vectors[layer]}
    check_layers(model, vectors)
    return vectors


def check_layers(model: Model, layers: Iterable[int]) -> None:
    for layer in layers:
        if layer < 0 or (model.num_layers is not None and layer >= model.num_layers):
            raise _invalid(
                f"layer {layer} is out of range: model {model.name!r} has {model.num_layers} decoder blocks",
                "layer",
                layer=layer,
                num_layers=model.num_layers,
            )


def check_name_free(name: str) -> str:
    name = (name or "").strip()
    if not name:
        raise _invalid("a steering vector needs a name", "name")
    existing = SAE.objects.filter(format=SAE.Format.VECTOR, name=name).first()
    if existing is not None:
        raise VectorAlreadyExists(
            f"a steering vector named {name!r} exists ({existing.id})", details={"sae_id": existing.id, "name": name}
        )
    return name


@audited(
    "vector.register",
    lambda kw, r: ("vector", getattr(r, "pk", ""), getattr(r, "name", "") or str(kw.get("name") or "")),
    params=lambda kw: {
        "model": getattr(kw.get("model"), "name", None),
        "layers": sorted(int(k) for k in (kw.get("vectors") or {})),
        "source": kw.get("source"),
    },
)
@transaction.atomic
def vector_create(
    *, name: str, model: Model, vectors: Mapping[int, Any], source: str, recipe: Mapping[str, Any] | None = None
) -> SAE:
    """Write ``vectors`` (layer -> 1-D array of the model's width) as our own vector file
    and record the row; the norms are recorded per layer."""
    name = check_name_free(name)
    arrays = {int(k): np.asarray(v, dtype=np.float32).reshape(-1) for k, v in vectors.items()}
    if not arrays:
        raise _invalid("no vector to store", "file")
    check_layers(model, arrays)
    widths = {a.shape[0] for a in arrays.values()}
    if model.hidden_size and widths != {model.hidden_size}:
        raise _invalid(
            f"the vectors have {sorted(widths)} values; model {model.name!r} has hidden size {model.hidden_size}",
            "file",
            hidden_size=model.hidden_size,
        )
    if not all(np.isfinite(a).all() for a in arrays.values()):
        raise _invalid("a vector contains NaN or Inf", "file")
    layers = sorted(arrays)
    sae = SAE(
        name=name,
        format=SAE.Format.VECTOR,
        d_in=widths.pop(),
        d_sae=1,
        width=1,
        activation=SAE.Activation.NONE,
        trained_on_model=model.name,
        trained_on_layer=layers[0] if len(layers) == 1 else None,
        hook_name=f"blocks.{layers[0]}.hook_resid_post" if len(layers) == 1 else "",
        status=SAE.Status.READY,
        vector_source=source,
        vector_layers=layers,
        vector_norms=[float(np.linalg.norm(arrays[k].astype(np.float64))) for k in layers],
        vector_recipe=dict(recipe or {}),
        files_owned=True,
    )
    folder = vector_dir(sae.id)
    sae.local_path = str(folder)
    write_vector_file(
        folder / "vector.safetensors",
        arrays,
        {"model_name": model.name, "hook_point": "resid_post", "name": name, "source": source},
    )
    try:
        sae.save(force_insert=True)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    log.info("vector_created", sae_id=sae.id, name=name, source=source, layers=layers)
    return sae


def vector_import(*, path: str | Path, name: str, model: Model, layer: int | None = None) -> SAE:
    """Register a vector file from the server's disk (``manage.py vector import``): checked,
    then copied into our own file; ``path`` is never written or removed."""
    p = Path(path)
    if not p.is_absolute() or not p.is_file():
        raise _invalid(f"{p} is not an absolute path to a file", "file", path=str(p))
    check_name_free(name)
    return vector_create(
        name=name,
        model=model,
        source=SAE.VectorSource.UPLOAD,
        vectors=vector_read_file(path=p, model=model, layer=layer),
    )


def vector_upload(
    *, chunks: Iterable[bytes], size: int | None, name: str, model: Model, layer: int | None = None
) -> SAE:
    """An uploaded file (its bytes), checked like an import: written to a temporary file
    first, read only as safetensors, never unpickled."""
    if size is not None and size > MAX_VECTOR_FILE_BYTES:
        raise _invalid(f"the file is {size} bytes; at most {MAX_VECTOR_FILE_BYTES} are accepted", "file", size=size)
    check_name_free(name)
    incoming = Path(settings.SAE_CACHE_DIR) / VECTOR_DIR
    incoming.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=incoming, prefix=".upload-", suffix=".safetensors") as tmp:
        for chunk in chunks:
            tmp.write(chunk)
        tmp.flush()
        vectors = vector_read_file(path=Path(tmp.name), model=model, layer=layer)
    return vector_create(name=name, model=model, vectors=vectors, source=SAE.VectorSource.UPLOAD)


def vector_list():
    return SAE.objects.filter(format=SAE.Format.VECTOR)


def vector_get(*, vector_id: str) -> SAE:
    try:
        return vector_list().get(pk=vector_id)
    except SAE.DoesNotExist:
        raise VectorNotFound(f"steering vector {vector_id!r} not found", details={"vector_id": vector_id}) from None


__all__ = [
    "check_layers",
    "check_name_free",
    "vector_create",
    "vector_dir",
    "vector_get",
    "vector_import",
    "vector_list",
    "vector_read_file",
    "vector_upload",
]
