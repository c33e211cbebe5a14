"""Jobs, specs, results and events exchanged with the engine, in one import: typed msgspec
structs whose serialisation is msgspec's own.

The same objects travel in-process (embedded) or as JSON over Redis Streams. Each value
range is declared once as a msgspec constraint (``fields``), which decoding applies and
construction applies through ``check_fields``; a refused value is ``InvalidParameter``
naming the parameter. Checks that need the loaded model (vocab, context window, d_sae)
happen in the engine. Nothing here imports torch.

The code lives by concern: ``fields`` (ranges, shared values), ``codec`` (JSON),
``sampling``, ``steering`` (with the canonical hash), ``monitoring``, ``capture``, ``jobs``
and ``results`` (results and events).
"""

from . import capabilities as _capabilities
from . import capture as _capture
from . import jobs as _jobs
from . import monitoring as _monitoring
from . import results as _results
from . import sampling as _sampling
from . import steering as _steering
from .capabilities import *  # noqa: F403
from .capture import *  # noqa: F403
from .codec import from_builtins, from_json, to_builtins, to_json
from .fields import (
    CONDITION_THRESHOLD,
    LOGIT_BIAS,
    MAX_BATCH_ROWS,
    MAX_LOGIT_BIAS,
    MAX_MONITOR_TOP_K,
    MAX_STEERING_STRENGTH,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    MONITOR_TOP_K,
    PENALTY,
    PRIORITIES,
    REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
    STEERING_STRENGTH,
    TEMPERATURE,
    TOP_K,
    TOP_LOGPROBS,
    TOP_P,
    AttachmentKey,
    PositionRange,
    Range,
)
from .jobs import *  # noqa: F403
from .monitoring import *  # noqa: F403
from .results import *  # noqa: F403
from .sampling import *  # noqa: F403
from .steering import *  # noqa: F403

__all__ = sorted(
    {
        "CONDITION_THRESHOLD",
        "LOGIT_BIAS",
        "MAX_BATCH_ROWS",
        "MAX_LOGIT_BIAS",
        "MAX_MONITOR_TOP_K",
        "MAX_STEERING_STRENGTH",
        "MAX_STOP_SEQUENCES",
        "MAX_TOP_LOGPROBS",
        "MONITOR_TOP_K",
        "PENALTY",
        "PRIORITIES",
        "REPETITION_PENALTY",
        "SEED_MAX",
        "SEED_MIN",
        "STEERING_STRENGTH",
        "TEMPERATURE",
        "TOP_K",
        "TOP_LOGPROBS",
        "TOP_P",
        "AttachmentKey",
        "PositionRange",
        "Range",
        "from_builtins",
        "from_json",
        "to_builtins",
        "to_json",
        *_capabilities.__all__,
        *_capture.__all__,
        *_jobs.__all__,
        *_monitoring.__all__,
        *_results.__all__,
        *_sampling.__all__,
        *_steering.__all__,
    }
)
