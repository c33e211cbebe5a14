"""Where an SAE was trained, from its ``hook_name`` (no torch).

SAELens and the transcoder releases name hook points in TransformerLens's vocabulary
(``blocks.L.hook_resid_pre``); a transcoder also names where it writes
(``metadata.hook_name_out``).  We keep only the *kind* of point: the layer an SAE is
attached at is the one the attach request names (the ``L`` in ``hook_name`` feeds a
compatibility warning, as before), so an SAE can still be moved to another layer on
purpose and lands on the same kind of point there.

Kinds, for attach layer L:

=================  ==============================================================
``resid_post``     the residual stream after block L (also when no name is known)
``resid_pre``      the residual stream entering block L: block L-1's output, the
                   embeddings' output for L = 0
``attn_out``       block L's attention contribution to the residual stream
``mlp_out``        block L's MLP contribution to the residual stream
``mlp_transcoder`` reads block L's MLP input, writes into its MLP output
=================  ==============================================================

Any other point (``hook_z``, ``hook_q``, ``hook_resid_mid``, per-head names…) is refused
by name (``sae_format_error``) rather than hooked somewhere near it.
"""

from __future__ import annotations

import re

from ..api.errors import SAEFormatError

HOOK_POINTS = ("resid_post", "resid_pre", "attn_out", "mlp_out", "mlp_transcoder")
DEFAULT_HOOK_POINT = "resid_post"

_TL_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")
_SUFFIXES = {
    "hook_resid_post": "resid_post",
    "hook_resid_pre": "resid_pre",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
}
# where a transcoder reads: the MLP's input (SAELens names it ``hook_mlp_in`` for Gemma
# Scope transcoders, ``ln2.hook_normalized`` for the GPT-2 ones)
_TRANSCODER_IN = ("hook_mlp_in", "ln2.hook_normalized")


def _suffix(name: str) -> str:
    match = _TL_NAME.match(name.strip())
    return match.group(2) if match else name.strip()


def parse_hook_point(hook_name: str | None, hook_name_out: str | None = None, *, source: str = "") -> str:
    """The hook-point kind of an SAE trained at ``hook_name`` (and, for a transcoder,
    writing at ``hook_name_out``); refuses a point we cannot hook exactly."""
    if not hook_name:
        return DEFAULT_HOOK_POINT
    read = _suffix(hook_name)
    if hook_name_out:
        write = _suffix(hook_name_out)
        if read in _TRANSCODER_IN and write == "hook_mlp_out":
            return "mlp_transcoder"
        raise SAEFormatError(
            f"Unsupported transcoder hook points {hook_name!r} -> {hook_name_out!r}: only a transcoder "
            "reading the MLP input (hook_mlp_in / ln2.hook_normalized) and writing hook_mlp_out can be attached",
            details={"path": source, "hook_name": hook_name, "hook_name_out": hook_name_out},
        )
    if read in _SUFFIXES:
        return _SUFFIXES[read]
    if read in _TRANSCODER_IN:
        raise SAEFormatError(
            f"SAE hook point {hook_name!r} is a transcoder input, but the SAE names no output "
            "(hook_name_out = blocks.L.hook_mlp_out)",
            details={"path": source, "hook_name": hook_name},
        )
    raise SAEFormatError(
        f"Unsupported SAE hook point {hook_name!r}: supported are blocks.L.hook_resid_pre, hook_resid_post, "
        "hook_attn_out, hook_mlp_out, and transcoders from hook_mlp_in / ln2.hook_normalized to hook_mlp_out",
        details={"path": source, "hook_name": hook_name},
    )


__all__ = ["DEFAULT_HOOK_POINT", "HOOK_POINTS", "parse_hook_point"]
