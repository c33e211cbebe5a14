"""Independent references for engine tests: SAE math in float64 numpy, capture hooks.

Nothing here calls gpu_engine's SAE code: weights are read straight from the files and
encoded with our own formulas, so a bug in the engine's loaders or encoders shows up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file


class RefSAE:
    def __init__(self, asset) -> None:
        path = Path(asset.path)
        if asset.layout == "saelens":
            w = load_file(str(path / "sae_weights.safetensors"))
            cfg = json.loads((path / "cfg.json").read_text())
            self.apply_b_dec = bool(cfg["apply_b_dec_to_input"])
        else:
            with np.load(path / "params.npz", allow_pickle=False) as z:
                w = {k: z[k] for k in z.files}
            self.apply_b_dec = False
        self.W_enc = w["W_enc"].astype(np.float64)
        self.W_dec = w["W_dec"].astype(np.float64)
        self.b_enc = w["b_enc"].astype(np.float64)
        self.b_dec = w["b_dec"].astype(np.float64)
        self.threshold = w["threshold"].astype(np.float64) if "threshold" in w else None
        self.activation = asset.activation
        self.k = asset.k

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if self.apply_b_dec:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.activation == "relu":
            return np.maximum(pre, 0.0)
        if self.activation == "jumprelu":
            return np.where(pre > self.threshold, np.maximum(pre, 0.0), 0.0)
        out = np.zeros_like(pre)
        idx = np.argsort(-pre, axis=-1)[..., : self.k]
        np.put_along_axis(out, idx, np.maximum(np.take_along_axis(pre, idx, -1), 0.0), -1)
        return out

    def delta(self, features: dict[int, float]) -> np.ndarray:
        return sum(s * self.W_dec[i] for i, s in features.items())


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def capture(module: torch.nn.Module, *, before_engine: bool = False) -> Iterator[list[np.ndarray]]:
    """Record the block's output of every forward (before or after the engine's hook)."""
    seen: list[np.ndarray] = []

    def hook(mod, args, output):
        seen.append(_hidden(output)[0].detach().double().cpu().numpy().copy())

    handle = module.register_forward_hook(hook, prepend=before_engine)
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    n = [0]
    handle = model.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    try:
        yield n
    finally:
        handle.remove()


@contextmanager
def adding(module: torch.nn.Module, delta: torch.Tensor) -> Iterator[None]:
    """The test's own steering hook: the module's output + ``delta`` (a tensor in the
    reference's own dtype), for reference runs."""

    def hook(mod, args, output):
        if isinstance(output, tuple):
            return (output[0] + delta, *output[1:])
        return output + delta

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def add_delta(module: torch.nn.Module, delta: np.ndarray) -> AbstractContextManager[None]:
    """The test's own steering hook: output + delta (in float32), for reference runs."""
    return adding(module, torch.tensor(delta, dtype=torch.float32))


def block(engine, asset, layer: int) -> torch.nn.Module:
    return engine.backend.model.get_submodule(asset.layer_module_path(layer))


def prompt_log_softmax(
    engine, ids: list[int], *, steer: tuple[torch.nn.Module, np.ndarray] | None = None
) -> np.ndarray:
    """log_softmax of a plain float32 ``model(ids)`` forward over the whole prompt (row
    j - 1 predicts token j), with ``steer`` = (block, delta) adding the delta with the
    test's own hook: the reference for prompt log-probabilities and their alternatives."""
    import contextlib

    with torch.inference_mode(), add_delta(*steer) if steer is not None else contextlib.nullcontext():
        logits = engine.backend.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).double().numpy()


def assert_prompt_alternatives(got, lsm: np.ndarray, ids: list[int], k: int, atol: float) -> None:
    """A result's prompt logprobs and top-``k`` alternatives equal ``lsm``'s rows."""
    assert got.prompt_logprobs[0] is None and got.prompt_top_logprobs[0] is None
    assert len(got.prompt_top_logprobs) == len(got.prompt_logprobs) == len(ids)
    np.testing.assert_allclose(got.prompt_logprobs[1:], [lsm[j - 1][ids[j]] for j in range(1, len(ids))], atol=atol)
    for j in range(1, len(ids)):
        row = lsm[j - 1]
        top = np.argsort(-row, kind="stable")[:k]
        entries = got.prompt_top_logprobs[j]
        assert [e.token_id for e in entries] == top.tolist(), j
        np.testing.assert_allclose([e.logprob for e in entries], row[top], atol=atol)
