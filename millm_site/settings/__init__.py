"""Django settings, split by topic; every value comes from ``millm_site.config``.

A bad environment variable stops the process here, with one line naming it.
"""

from .core import *  # noqa: F401,F403
from .database import *  # noqa: F401,F403
from .engine import *  # noqa: F401,F403
from .http import *  # noqa: F401,F403
from .logs import *  # noqa: F401,F403
from .tasks import *  # noqa: F401,F403
