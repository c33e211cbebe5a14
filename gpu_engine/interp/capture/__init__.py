"""Hidden-state capture per request, inside batches: the plan, the hook, the drain.

What is captured: the output of decoder block ``L`` after every steering applied to it
(a ``resid_post`` attachment at ``L`` and a ``resid_pre`` one at ``L + 1`` both hook that
output), i.e. exactly what block ``L + 1`` reads.  Steering inside the block (``attn_out``,
``mlp_out``) is part of it too.  HF's ``output_hidden_states[L + 1]`` is the same tensor
for every layer but the last, which HF reports after the final norm.

How (the "aperture"):

- a request's ``CapturePlan`` owns one buffer allocated when it starts, sized for every
  row it may take (``rows_for``; checked against ``CaptureSpec.max_bytes`` before
  anything runs): (layers, rows, hidden_size) in the model's dtype.  A row's place is its
  position minus the first position captured (``last``: always row 0), so there is no
  per-token Python object, only a high-water mark;
- the capture hook (``CaptureHook``) sits on block ``L`` only while some running request
  captures ``L`` (``HookManager.arm_capture``, reference-counted) and is kept the last
  hook on its module, so it reads the steered stream.  With no capture armed there is no
  hook at all: the unarmed path is the code that ran before;
- prefill (and the serial path) write straight into the plan's buffer; a batched decode
  step writes every row into the batch's stage with one ``index_copy_`` per captured
  layer (``BatchContext.capture_stage``: (num_layers, slots, hidden_size)), then each
  capturing request copies its slot's column into its buffer (``CapturePlan.take``);
- when the request ends (finished, stopped or cancelled) ``finish`` drains the rows it has
  to the host (``artifact``: the one device-to-host copy, on the engine's thread) and the
  ``Artifact`` is packed (``gpu_engine.api.artifacts``): inline when small, else streamed
  to a file under the spec's directory.  The engine packs on its capture writer's thread
  (``gpu_engine.runtime.capture_writer``; the plan is ``deferred``), so a large artifact
  never holds the batch; ``result`` drains and packs at once, on the caller's thread.
"""

from .hook import CaptureHook, armed, is_pair, route_qk
from .plan import Artifact, CaptureDiskFull, CapturePlan, CaptureWriteFailed, RowBuffer
from .shards import CapturePart, HeadShard, for_shard
from .sizing import AttentionGeometry, estimate_bytes, rows_for

__all__ = [
    "Artifact",
    "AttentionGeometry",
    "CaptureDiskFull",
    "CaptureHook",
    "CapturePart",
    "CapturePlan",
    "CaptureWriteFailed",
    "HeadShard",
    "RowBuffer",
    "armed",
    "estimate_bytes",
    "for_shard",
    "is_pair",
    "route_qk",
    "rows_for",
]
