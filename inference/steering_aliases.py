"""Steering shapes from other tools, rewritten into miLLM's own before a /v1 request
validates (docs/api-v1.md, "Steering shapes from other tools").

``rewrite`` runs first in ``_GenerationRequest``'s validation: it takes the alias keys out
of the body, writes the native ``steering`` (and ``capture``, ``profile``, … for
``vllm_xargs``) they mean, decodes every packed vector (``gpu_engine.api.vectors``), and
leaves an ``AliasRecord`` saying which keys it consumed, so that ``inference.policy`` does
not name them as ignored, and which parts it could not read (named as ignored). What
cannot be mapped, and two steering shapes in one request, are 400 ``invalid_parameter``
naming the field; nothing runs.

- ``vllm_xargs`` (vLLM's extra args; vllm-lens and miLLM's own keys): JSON-string values
  are parsed; ``steering``, ``profile``, ``steering_intensity``,
  ``return_sae_activations``, ``capture``, ``analyze`` and ``probes`` are miLLM's fields;
  vllm-lens's ``apply_steering_vectors`` become inline vectors and its
  ``output_residual_stream`` a capture; ``apply_hooks`` (pickled code) is refused.
- The RhizoNymph vLLM steering fork: ``steering_vectors`` (phase all),
  ``prefill_steering_vectors`` (prompt), ``decode_steering_vectors`` (completion), each
  ``{hook: packed {dtype, shape, layer_indices, data, scales?} | {layer: list | {vector,
  scale}}}``; hook ``post_block`` is resid_post, ``pre_attn`` resid_pre. Its clamps
  (``steering_clamps`` and the ``prefill_`` / ``decode_`` tiers, ``{hook: {layer:
  [{vector, min?, max?, value?, strength?}]}}``) are clamp vectors (``mode: clamp``), in
  order, base tier first; its named modules are refused.
- EasySteer's ``steering: {vectors: [{data, algorithm, scale, layers, apply, …}]}``
  (``steering: false``: unsteered). miLLM's own ``steering`` has ``features``; a
  ``steering`` object whose vectors carry EasySteer's keys is EasySteer's.
- Neuronpedia's ``features: [{model, source, index, strength}]`` with ``steer_method``
  and ``strength_multiplier``: ``source`` "<layer>-…" picks the attachment at that layer,
  any other ``source`` the attachment of that ``sae_id``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict

from core.openai_errors import OpenAIError
from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.fields import MAX_STEERING_STRENGTH
from gpu_engine.api.steering import MAX_CLAMP_BOUND
from gpu_engine.api.vectors import ITEMSIZE, MAX_PACKED_ROWS, as_float32, unpack
from inference.protocol_extensions import PackedVector

RECORD = "steering_alias"
RHIZO_TIERS = (
    ("steering_vectors", "all"),
    ("prefill_steering_vectors", "prompt"),
    ("decode_steering_vectors", "completion"),
)
# its clamps: {hook: {layer: [{vector, min?, max?, value?, strength?}, ...]}}, native clamp vectors
RHIZO_CLAMP_TIERS = (
    ("steering_clamps", "all"),
    ("prefill_steering_clamps", "prompt"),
    ("decode_steering_clamps", "completion"),
)
RHIZO_CLAMP_KEYS = frozenset({"vector", "min", "max", "value", "strength"})
RHIZO_REFUSED = {
    "steering_name": "named steering modules are miLLM profiles here: send profile",
}
# the fork's hook points with an exact miLLM equivalent
RHIZO_HOOKS = {"post_block": "resid_post", "pre_attn": "resid_pre"}
NATIVE_XARGS = ("steering", "profile", "steering_intensity", "return_sae_activations", "capture", "analyze", "probes")
EASYSTEER_KEYS = frozenset({"source", "algorithm", "scale", "layers", "apply", "normalize", "params", "name"})
NEURONPEDIA_KEYS = ("steer_method", "strength_multiplier", "normalize_steering")
_LAYER_SOURCE = re.compile(r"^(\d{1,6})-")


class AliasRecord(BaseModel):
    """What ``rewrite`` did: the body keys it consumed, the locations nothing reads, and
    the body location of each inline vector (``vector_params``: its layer's and its
    data's) and of the attachment pick (``sae_param``), for the resolver's errors."""

    model_config = ConfigDict(frozen=True)

    shape: str | None = None
    keys: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    vector_params: tuple[tuple[str, str], ...] = ()
    sae_param: str | None = None


def _refuse(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, status=400, code="invalid_parameter", param=param)


def _strength(value: Any, param: str, default: float = 1.0) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(f"{param} must be a number", param)
    if not abs(value) <= MAX_STEERING_STRENGTH:
        raise _refuse(f"{param} must lie in [-{MAX_STEERING_STRENGTH:g}, {MAX_STEERING_STRENGTH:g}]", param)
    return float(value)


def _layer(value: Any, param: str) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100_000:
        raise _refuse(f"{param}: a layer is a non-negative integer (got {value!r})", param)
    return value


def _rows(value: Any, param: str, n_rows: int) -> list[PackedVector]:
    """A packed value (or JSON list) as ``n_rows`` vectors: one row repeated, or one row
    per layer."""
    try:
        dtype, rows, raw = unpack(value, param, max_rows=MAX_PACKED_ROWS)
    except InvalidParameter as exc:
        raise _refuse(str(exc), exc.param or param) from None
    count, width = rows.shape
    if count not in (1, n_rows):
        raise _refuse(f"{param}: {count} rows for {n_rows} layers (send one row, or one per layer)", param)
    size = width * ITEMSIZE[dtype]
    parts = [PackedVector(dtype, raw[r * size : (r + 1) * size], width) for r in range(count)]
    return parts if count == n_rows else parts * n_rows


def _native_vectors(steering: dict[str, Any], where: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """miLLM's own ``steering`` with each ``vectors[i].data`` decoded (a copy)."""
    vectors = steering.get("vectors")
    if not isinstance(vectors, list):
        return steering, []
    out, params = [], []
    for i, v in enumerate(vectors):
        param = f"{where}.vectors[{i}]"
        if isinstance(v, dict) and "data" in v and not isinstance(v["data"], PackedVector):
            v = {**v, "data": _rows(v["data"], f"{param}.data", 1)[0]}
        out.append(v)
        params.append((f"{param}.layer", f"{param}.data"))
    return {**steering, "vectors": out}, params


def _rhizo_sites(tiers: dict[str, Any], table: Any) -> Iterator[tuple[str, str, Any, str]]:
    """``(phase, hook, its entry, its location)`` of each hook point of the fork's tiers in
    ``table`` (``(field, phase)`` pairs) that the request sent, hook points checked."""
    for name, phase in table:
        spec = tiers.get(name)
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise _refuse(f"{name} is an object keyed by hook point", name)
        for hook, entry in spec.items():
            where = f"{name}.{hook}"
            if hook not in RHIZO_HOOKS:
                raise _refuse(
                    f"{where}: hook point {hook!r} has no miLLM equivalent (post_block is resid_post, "
                    "pre_attn is resid_pre)",
                    where,
                )
            yield phase, hook, entry, where


def _rhizo(tiers: dict[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    vectors: list[dict[str, Any]] = []
    params: list[tuple[str, str]] = []
    for phase, hook, entry, where in _rhizo_sites(tiers, RHIZO_TIERS):
        if isinstance(entry, dict) and "data" in entry:
            layers = entry.get("layer_indices")
            if not isinstance(layers, list) or not layers or len(layers) > MAX_PACKED_ROWS:
                raise _refuse(f"{where}.layer_indices must list the rows' layers", f"{where}.layer_indices")
            layers = [_layer(x, f"{where}.layer_indices") for x in layers]
            scales = entry.get("scales")
            if scales is not None and (not isinstance(scales, list) or len(scales) != len(layers)):
                raise _refuse(f"{where}.scales must hold one scale per layer", f"{where}.scales")
            unknown = sorted(set(entry) - {"dtype", "shape", "data", "layer_indices", "scales"})
            if unknown:
                raise _refuse(f"{where}: unknown key {unknown[0]!r}", f"{where}.{unknown[0]}")
            packed = {k: entry.get(k) for k in ("dtype", "shape", "data")}
            shape = packed["shape"]
            if isinstance(shape, list) and len(shape) == 2 and shape[0] != len(layers):
                raise _refuse(f"{where}: {shape[0]} rows for {len(layers)} layer_indices", f"{where}.shape")
            rows = _rows(packed, where, len(layers))
            for r, layer in enumerate(layers):
                strength = _strength(scales[r] if scales else None, f"{where}.scales")
                vectors.append(
                    {
                        "data": rows[r],
                        "layer": layer,
                        "hook": RHIZO_HOOKS[hook],
                        "strength": strength,
                        "phase": phase,
                    }
                )
                params.append((f"{where}.layer_indices", f"{where}.data"))
        elif isinstance(entry, dict):
            for key, v in entry.items():
                at = f"{where}.{key}"
                layer = _layer(key, at)
                scale = None
                if isinstance(v, dict):
                    unknown = sorted(set(v) - {"vector", "scale"})
                    if unknown:
                        raise _refuse(f"{at}: unknown key {unknown[0]!r}", f"{at}.{unknown[0]}")
                    v, scale = v.get("vector"), v.get("scale")
                data = _rows(v, at, 1)[0]
                vectors.append(
                    {
                        "data": data,
                        "layer": layer,
                        "hook": RHIZO_HOOKS[hook],
                        "strength": _strength(scale, f"{at}.scale"),
                        "phase": phase,
                    }
                )
                params.append((at, at))
        else:
            raise _refuse(f"{where} is a packed {{dtype, shape, layer_indices, data}} or {{layer: vector}}", where)
    return vectors, params


def _is_easysteer(steering: Any) -> bool:
    if not isinstance(steering, dict) or "features" in steering:
        return False
    vectors = steering.get("vectors")
    return "conflict" in steering or (
        isinstance(vectors, list) and any(isinstance(v, dict) and EASYSTEER_KEYS & v.keys() for v in vectors)
    )


_APPLY = {("all", "all"): "all", ("all", "none"): "prompt", ("none", "all"): "completion"}


def _layered(
    items: Any, where: str, *, vector_key: str, layers_key: str, scale_key: str
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """EasySteer's and vllm-lens's ``[{<vector>, <layers>, <scale>, …}]``: one vector (or
    one per layer) added at each layer. Keys that would change the output otherwise are
    refused by the callers before this."""
    if not isinstance(items, list) or len(items) > MAX_PACKED_ROWS:
        raise _refuse(f"{where} must be a list", where)
    vectors, params = [], []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _refuse(f"{at} must be an object", at)
        layers = item.get(layers_key)
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if not isinstance(layers, list) or not layers or len(layers) > MAX_PACKED_ROWS:
            raise _refuse(f"{at}.{layers_key} must list the layers to steer", f"{at}.{layers_key}")
        layers = [_layer(x, f"{at}.{layers_key}") for x in layers]
        if item.get(vector_key) is None:
            raise _refuse(f"{at}.{vector_key}: the vector is required", f"{at}.{vector_key}")
        rows = _rows(item[vector_key], f"{at}.{vector_key}", len(layers))
        strength = _strength(item.get(scale_key), f"{at}.{scale_key}")
        phase = item.get("_phase", "all")
        for layer, row in zip(layers, rows, strict=True):
            vectors.append({"data": row, "layer": layer, "strength": strength, "phase": phase})
            params.append((f"{at}.{layers_key}", f"{at}.{vector_key}"))
    return vectors, params


def _easysteer(steering: dict[str, Any], where: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    items = steering.get("vectors") or []
    unknown = sorted(set(steering) - {"vectors", "conflict"})
    if unknown:
        raise _refuse(f"{where}: unknown key {unknown[0]!r}", f"{where}.{unknown[0]}")
    if steering.get("conflict") is not None and len(items) > 1:
        raise _refuse(f"{where}.conflict: vectors at one layer are summed here; no other policy", f"{where}.conflict")
    kept = []
    for i, v in enumerate(items if isinstance(items, list) else []):
        at = f"{where}.vectors[{i}]"
        if not isinstance(v, dict):
            raise _refuse(f"{at} must be an object", at)
        if v.get("source") is not None:
            raise _refuse(f"{at}.source: files on the server are not read; send the vector as data", f"{at}.source")
        if v.get("algorithm", "direct") != "direct":
            raise _refuse(f"{at}.algorithm: only direct (adding the vector) maps onto miLLM", f"{at}.algorithm")
        if v.get("normalize"):
            raise _refuse(
                f"{at}.normalize: normalised vectors are not available; send it normalised", f"{at}.normalize"
            )
        if v.get("params"):
            raise _refuse(f"{at}.params: algorithm parameters are not available", f"{at}.params")
        apply = v.get("apply") or {}
        when = (apply.get("prompt", "all"), apply.get("generation", "all")) if isinstance(apply, dict) else None
        if when == ("none", "none"):
            continue
        if when not in _APPLY or (isinstance(apply, dict) and set(apply) - {"prompt", "generation"}):
            raise _refuse(f'{at}.apply: prompt and generation are "all" or "none"', f"{at}.apply")
        kept.append({**v, "_phase": _APPLY[when]})
    vectors, params = _layered(kept, f"{where}.vectors", vector_key="data", layers_key="layers", scale_key="scale")
    return {"features": [], "vectors": vectors}, params


def _neuronpedia(data: dict[str, Any], features: Any, record: dict[str, Any]) -> dict[str, Any]:
    method = data.pop("steer_method", None) or "SIMPLE_ADDITIVE"
    multiplier = _strength(data.pop("strength_multiplier", None), "strength_multiplier")
    normalize = data.pop("normalize_steering", None)
    record["keys"] += ["features", *NEURONPEDIA_KEYS]
    if method != "SIMPLE_ADDITIVE":
        raise _refuse(f"steer_method {method!r} has no miLLM equivalent; SIMPLE_ADDITIVE is an add", "steer_method")
    if normalize:
        raise _refuse("normalize_steering is not available: strengths are added as given", "normalize_steering")
    if not isinstance(features, list) or len(features) > 4096:
        raise _refuse("features must be a list of {source, index, strength}", "features")
    out, source = [], None
    for i, f in enumerate(features):
        at = f"features[{i}]"
        if not isinstance(f, dict):
            raise _refuse(f"{at} must be an object", at)
        if f.get("steering_vector") is not None or f.get("steeringVector") is not None:
            raise _refuse(f"{at}: a custom vector is sent as steering.vectors here", f"{at}.steering_vector")
        if not isinstance(f.get("source"), str) or not f["source"]:
            raise _refuse(f"{at}.source names the SAE (e.g. 12-res-jb)", f"{at}.source")
        if source is not None and f["source"] != source:
            raise _refuse(
                f"{at}.source: one request steers one SAE here (features[0] names {source!r})", f"{at}.source"
            )
        source = f["source"]
        index = f.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise _refuse(f"{at}.index must be a non-negative integer", f"{at}.index")
        strength = _strength(f.get("strength"), f"{at}.strength", default=0.0) * multiplier
        if abs(strength) > MAX_STEERING_STRENGTH:
            raise _refuse(
                f"{at}.strength × strength_multiplier must lie in ±{MAX_STEERING_STRENGTH:g}", f"{at}.strength"
            )
        out.append({"index": index, "strength": strength})
        record["ignored"] += [f"{at}.{_k}" for _k in f if _k not in ("source", "index", "strength")]
    steering: dict[str, Any] = {"features": out}
    if source is not None:
        match = _LAYER_SOURCE.match(source)
        if match is None and len(source) > 200:
            raise _refuse("features[0].source names no attached SAE", "features[0].source")
        steering.update({"layer": int(match.group(1))} if match else {"sae_id": source})
        record["sae_param"] = "features[0].source"
    return steering


def _xarg(value: Any, param: str) -> Any:
    # vLLM's HTTP schema types extra args as str | int | float (| list): objects arrive as JSON text
    if isinstance(value, str) and (value[:1] in ("{", "[") or value in ("true", "false", "null")):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            raise _refuse(f"{param} is not valid JSON (or is nested too deeply)", param) from None
    if isinstance(value, str):
        try:
            number = json.loads(value)
        except ValueError:
            return value
        return number if isinstance(number, (int, float)) else value
    return value


def _xargs(
    data: dict[str, Any], xargs: Any, record: dict[str, Any], shapes: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    if not isinstance(xargs, dict):
        raise _refuse("vllm_xargs must be an object", "vllm_xargs")
    record["keys"].append("vllm_xargs")
    vectors: list[dict[str, Any]] = []
    for key, raw in xargs.items():
        at = f"vllm_xargs.{key}"
        value = _xarg(raw, at)
        if key in NATIVE_XARGS:
            if data.get(key) is not None:
                raise _refuse(f"{at} and {key} both given; send one", at)
            data[key] = value
            if key == "steering":
                record["steering_param"] = at
        elif key == "apply_steering_vectors":
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, dict) and item.get("norm_match"):
                    raise _refuse(
                        f"{at}[{i}].norm_match is not available: strengths are added as given", f"{at}[{i}].norm_match"
                    )
                if isinstance(item, dict) and item.get("position_indices") is not None:
                    raise _refuse(
                        f"{at}[{i}].position_indices: send steering.features windows instead",
                        f"{at}[{i}].position_indices",
                    )
            found, params = _layered(items, at, vector_key="activations", layers_key="layer_indices", scale_key="scale")
            vectors += found
            record["vector_params"] += params
            shapes.append(("vllm_xargs.apply_steering_vectors", at))
        elif key == "output_residual_stream":
            if data.get("capture") is not None:
                raise _refuse(f"{at} and capture both given; send one", at)
            layers = value if isinstance(value, list) else [value]
            data["capture"] = {"layers": [_layer(x, at) for x in layers], "positions": "all"}
        elif key == "apply_hooks":
            raise _refuse(f"{at}: code sent with a request is never run", at)
        else:
            record["ignored"].append(at)
    return vectors


def _bound(entry: dict[str, Any], key: str, param: str) -> float | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= MAX_CLAMP_BOUND:
        raise _refuse(f"{param} must be a number in [-{MAX_CLAMP_BOUND:g}, {MAX_CLAMP_BOUND:g}]", param)
    return float(value)


def _rhizo_clamps(tiers: dict[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The fork's clamps as clamp vectors: for each row, ``c = x · u`` (``u`` the vector
    normalised) becomes ``c + strength · (clip(c, min, max) − c)``."""
    vectors: list[dict[str, Any]] = []
    params: list[tuple[str, str]] = []
    for phase, hook, layers, where in _rhizo_sites(tiers, RHIZO_CLAMP_TIERS):
        if not isinstance(layers, dict):
            raise _refuse(f"{where} is an object keyed by layer", where)
        for key, entries in layers.items():
            at = f"{where}.{key}"
            layer = _layer(key, at)
            if not isinstance(entries, list):
                raise _refuse(f"{at} is a list of clamps [{{vector, min?, max?, value?, strength?}}]", at)
            for i, entry in enumerate(entries):
                here = f"{at}[{i}]"
                if not isinstance(entry, dict) or "vector" not in entry:
                    raise _refuse(f"{here} is {{vector, min?, max?, value?, strength?}}", here)
                unknown = sorted(set(entry) - RHIZO_CLAMP_KEYS)
                if unknown:
                    raise _refuse(f"{here}: unknown key {unknown[0]!r}", f"{here}.{unknown[0]}")
                lo, hi, value = (_bound(entry, k, f"{here}.{k}") for k in ("min", "max", "value"))
                if value is not None:
                    if lo is not None or hi is not None:
                        raise _refuse(f"{here}: value is min = max = value; send value or min/max", f"{here}.value")
                    lo = hi = value
                if lo is None and hi is None:
                    raise _refuse(f"{here}: a clamp needs min, max or value", here)
                if lo is not None and hi is not None and lo > hi:
                    raise _refuse(f"{here}.min ({lo:g}) is above max ({hi:g})", f"{here}.min")
                strength = entry.get("strength", 1.0)
                if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength <= 1:
                    raise _refuse(f"{here}.strength must be a number in [0, 1]", f"{here}.strength")
                data = _rows(entry["vector"], f"{here}.vector", 1)[0]
                if not as_float32(data.dtype, data.raw, f"{here}.vector").any():
                    raise _refuse(f"{here}.vector: a clamp's direction must be non-zero", f"{here}.vector")
                clamp = {"data": data, "layer": layer, "hook": RHIZO_HOOKS[hook], "phase": phase}
                vectors.append({**clamp, "mode": "clamp", "min": lo, "max": hi, "strength": float(strength)})
                params.append((at, f"{here}.vector"))
    return vectors, params


def rewrite(data: Any) -> Any:
    """The body with every alias rewritten into miLLM's fields (see the module)."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    data.pop(RECORD, None)  # ours to write, never the client's
    record: dict[str, Any] = {"keys": [], "ignored": [], "vector_params": [], "sae_param": None, "shape": None}
    shapes: list[tuple[str, str]] = []
    vectors: list[dict[str, Any]] = []
    if "vllm_xargs" in data:
        xargs = data.pop("vllm_xargs")
        if xargs is not None:
            vectors += _xargs(data, xargs, record, shapes)
        else:
            record["keys"].append("vllm_xargs")
    where = record.pop("steering_param", "steering")
    steering = data.get("steering")
    if steering is False or _is_easysteer(steering):
        data["steering"], params = _easysteer(steering or {}, where)
        record["vector_params"] += params
        shapes.append(("EasySteer steering", where))
        if where == "steering":
            record["keys"].append("steering")  # EasySteer's object: its keys are not miLLM's
    elif isinstance(steering, dict):
        data["steering"], params = _native_vectors(steering, where)
        record["vector_params"] += params
        shapes.append(("steering", where))
    for name in RHIZO_REFUSED:
        if data.get(name):
            raise _refuse(f"{name}: {RHIZO_REFUSED[name]}", name)
    tiers = {name: data.pop(name) for name, _ in (*RHIZO_TIERS, *RHIZO_CLAMP_TIERS) if name in data}
    record["keys"] += [*tiers, *(n for n in RHIZO_REFUSED if n in data)]
    for n in RHIZO_REFUSED:
        data.pop(n, None)
    if any(v for v in tiers.values()):
        for parse in (_rhizo, _rhizo_clamps):  # the adds, then the clamps (which read the row as steered)
            found, params = parse(tiers)
            vectors += found
            record["vector_params"] += params
        shapes.append((next(n for n, v in tiers.items() if v), next(n for n, v in tiers.items() if v)))
    if isinstance(data.get("features"), list):
        features = data.pop("features")
        shapes.append(("features", "features"))
        if len(shapes) == 1:
            data["steering"] = _neuronpedia(data, features, record)
    if len(shapes) > 1:
        (first, _), (second, param) = shapes[0], shapes[1]
        raise _refuse(f"{first} and {second} are two steering shapes in one request; send one", param)
    if vectors:
        data["steering"] = {"features": [], "vectors": vectors}
    if shapes or record["keys"]:
        record["shape"] = shapes[0][0] if shapes else None
        data[RECORD] = AliasRecord(
            shape=record["shape"],
            keys=tuple(record["keys"]),
            ignored=tuple(record["ignored"]),
            vector_params=tuple(record["vector_params"]),
            sae_param=record["sae_param"],
        )
    return data


__all__ = ["RECORD", "AliasRecord", "rewrite"]
