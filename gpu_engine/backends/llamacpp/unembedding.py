"""The unembedding of a GGUF model, read from the file with the ``gguf`` package.

llama.cpp keeps its weights in its own buffers (possibly quantized, possibly on a GPU);
a feature's logit effect needs ``W_U`` once, as float32, so it is read from the file the
model was loaded from: ``output.weight``, else ``token_embd.weight`` (a tied head),
dequantized by ``gguf.quants.dequantize`` whatever its type.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...api.errors import UnsupportedArchitecture

HEAD = "output.weight"
TIED = "token_embd.weight"


def gguf_unembedding(path: str | Path) -> torch.Tensor:
    """``W_U`` [vocab, d_model] float32 on the host."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    tensor = tensors.get(HEAD) or tensors.get(TIED)
    if tensor is None:
        raise UnsupportedArchitecture(
            f"{Path(path).name} holds neither {HEAD} nor {TIED}: it has no unembedding to read",
            details={"path": str(path)},
        )
    # GGUF shapes run innermost first: (d_model, vocab) is a [vocab, d_model] matrix
    d_model, vocab = (int(n) for n in tensor.shape[:2])
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(vocab, d_model)
    return torch.from_numpy(values.copy())


__all__ = ["gguf_unembedding"]
