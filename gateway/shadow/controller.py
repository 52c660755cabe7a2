"""The quality target's controller: after each window of shadow samples, move one routing knob a
bounded step toward the target agreement, or toward lower cost when agreement is comfortably above it.

Pure: the window's counts come in, a signed step goes out; the Store applies it (clamped to the
knob's floor and ceiling, shared by replicas) and the service logs and counts it. A dead band
around the target is the hysteresis: a window within `dead_band` of the target moves nothing, so
the knob does not hunt on sampling noise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from gateway.settings.shadow import KnobSettings


@dataclass(frozen=True)
class KnobController:
    """Holds `target` agreement by moving `knob`; `sign`: +1 if raising the knob buys agreement,
    -1 if lowering it does (KnobSettings.quality_sign)."""

    target: float
    knob: KnobSettings
    sign: int

    def delta(self, agreed: int, samples: int) -> float:
        """The knob's move after a window of `samples` shadow answers of which `agreed` agreed: one
        step toward agreement below target - dead_band, one step toward lower cost above
        target + dead_band, else 0."""
        if samples <= 0:
            return 0.0
        agreement = agreed / samples
        if agreement < self.target - self.knob.dead_band:
            want = 1
        elif agreement > self.target + self.knob.dead_band:
            want = -1
        else:
            return 0.0
        return want * self.sign * self.knob.step

    def initial(self, configured: float | None) -> float:
        """Where the knob starts: the alias's configured value, within floor..ceiling (floor if unset)."""
        if configured is None:
            return self.knob.floor
        return min(self.knob.ceiling, max(self.knob.floor, configured))

    def key(self, alias: str, policy: str, configured: float | None) -> str:
        """The knob's name in the Store: the alias and a digest of everything that defines it, so a
        changed configuration starts afresh instead of inheriting a value moved under other bounds."""
        defined = json.dumps([policy, configured, self.target, self.knob.model_dump()], sort_keys=True)
        return f"{alias}:{hashlib.sha256(defined.encode()).hexdigest()[:12]}"
