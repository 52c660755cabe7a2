"""The `fitting` extra: what the fitting tools need beyond the gateway's own dependencies.

`pip install 'routing-gateway[fitting]'` (pyproject.toml) installs them; the container image does
not carry matplotlib (about 100 MB with its dependencies), so `steer report --no-heatmap` is how a
report is made there. A command checks what it needs before it loads a model, and fails with one
line naming the extra.
"""

from __future__ import annotations

import importlib.util

EXTRA = "routing-gateway[fitting]"


class MissingExtra(RuntimeError):
    """A package of the `fitting` extra is not installed; the message is one line naming the extra."""


def require(module: str, needed_for: str, instead: str = "") -> None:
    """Raise MissingExtra unless `module` can be imported; `needed_for` says what needs it, `instead`
    what else the user can do."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"{needed_for} needs {module}, which is not installed: pip install '{EXTRA}'"
                           + (f" (or {instead})" if instead else ""))
