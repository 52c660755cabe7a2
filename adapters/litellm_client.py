"""litellm, configured once for the gateway: the one place that imports and sets it up.

Importing litellm reads `LITELLM_LOCAL_MODEL_COST_MAP` (unset, it fetches the price map from the
network at import, which a closed network turns into seconds of retries), and its globals and
loggers are process-wide. So nothing imports litellm at module import time: `litellm()` does it
on first use (the gateway calls it at start-up) and returns the configured module.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType


@functools.cache
def litellm() -> ModuleType:
    """The litellm module, configured: the bundled price map (never fetched), httpx transport (its
    aiohttp sessions leak on failed calls), and its loggers at WARNING (it logs every call at INFO)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm as module

    module.suppress_debug_info = True
    module.disable_aiohttp_transport = True
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return module
