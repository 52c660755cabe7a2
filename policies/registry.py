"""The routing policies a configuration or a request can name: a plain dict, name -> PolicyEntry.

Each policy's module declares its entries (policies.base.PolicyEntry: the name, the routing fields
it needs, its constructor) in ENTRIES. The settings accept exactly the names held here and check
each policy's needs, and build_policy builds from here; a test may register one of its own.
"""

from __future__ import annotations

from policies import learned, target_fraction, thresholds
from policies.base import PolicyEntry

POLICIES: dict[str, PolicyEntry] = {
    entry.name: entry for module in (thresholds, target_fraction, learned) for entry in module.ENTRIES
}
