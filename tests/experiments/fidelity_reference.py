"""The SAE fidelity tests' own reference, in float64: the tiny model loaded from its files
by transformers (not the engine's copy), a forward hook of the test's own on the SAE's
block, and the SAE's encode/decode read straight from its weight file
(``tests.engine.helpers.RefSAE``). Nothing here calls miLLM's code."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import numpy as np
import torch

from tests.engine.helpers import RefSAE


@cache
def _model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


class FidelityReference:
    """One SAE on the tiny model, in float64."""

    def __init__(self, tiny_assets: Any, sae_name: str) -> None:
        asset = tiny_assets.saes[sae_name]
        model_asset = tiny_assets.models[asset.model_name]
        self.model = _model(str(model_asset.path))
        self.block = self.model.get_submodule(model_asset.layer_module_path(asset.layer))
        self.sae = RefSAE(asset)
        self.d_in = int(asset.d_in)

    def decode(self, f: np.ndarray) -> np.ndarray:
        return f @ self.sae.W_dec + self.sae.b_dec

    @contextmanager
    def _hooked(self, replace: Callable[[np.ndarray], np.ndarray] | None, seen: list[np.ndarray]):
        def hook(mod, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            seen.append(hidden[0].detach().double().numpy().copy())
            if replace is None:
                return None
            new = torch.tensor(replace(seen[-1]), dtype=hidden.dtype)[None]
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handle = self.block.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def forward(self, ids: Sequence[int], replace: Callable[[np.ndarray], np.ndarray] | None = None):
        """(the block's output rows, the log-softmax rows) of one forward over ``ids``."""
        seen: list[np.ndarray] = []
        with torch.no_grad(), self._hooked(replace, seen):
            logits = self.model(torch.tensor([list(ids)])).logits[0]
        return seen[0], torch.log_softmax(logits, dim=-1).numpy()

    def residual(self, ids: Sequence[int]) -> np.ndarray:
        return self.forward(ids)[0]

    def stats(self, x: np.ndarray) -> dict[str, Any]:
        """Per-row L0, squared error and squared norm of the SAE on rows ``x``."""
        f = self.sae.encode(x)
        x_hat = self.decode(f)
        return {
            "l0": (f != 0).sum(axis=1),
            "sq_err": ((x - x_hat) ** 2).sum(axis=1),
            "sq_norm": (x**2).sum(axis=1),
            "x_sum": x.sum(axis=0),
            "active": f != 0,
        }

    def figures(self, x: np.ndarray) -> dict[str, float]:
        """L0, MSE and explained variance over rows ``x``, straight from their definitions."""
        s = self.stats(x)
        centred = ((x - x.mean(axis=0)) ** 2).sum()
        return {
            "rows": x.shape[0],
            "l0": float(s["l0"].mean()),
            "mse": float(s["sq_err"].sum() / (x.shape[0] * self.d_in)),
            "explained_variance": float(1 - s["sq_err"].sum() / centred),
        }

    def nll(self, ids: Sequence[int], splice: str | None = None) -> tuple[float, int]:
        """The summed next-token loss over tokens 1..N-1 and their count: clean, with the
        block's output replaced by the SAE's reconstruction, or by zeros."""
        replace = None
        if splice == "reconstruction":
            replace = lambda x: self.decode(self.sae.encode(x))  # noqa: E731
        elif splice == "zero":
            replace = np.zeros_like
        _, lsm = self.forward(ids, replace)
        ids = list(ids)
        return -math.fsum(float(lsm[j - 1, ids[j]]) for j in range(1, len(ids))), len(ids) - 1

    def losses(self, sequences: Sequence[Sequence[int]]) -> dict[str, float]:
        """Mean clean, spliced and zero-ablated losses over the sequences' tokens, and
        loss recovered."""
        out = {}
        for name, splice in (("clean", None), ("spliced", "reconstruction"), ("zero", "zero")):
            sums = [self.nll(ids, splice) for ids in sequences]
            out[name] = math.fsum(s for s, _ in sums) / sum(n for _, n in sums)
        out["recovered"] = (out["zero"] - out["spliced"]) / (out["zero"] - out["clean"])
        out["tokens"] = sum(len(s) - 1 for s in sequences)
        return out
