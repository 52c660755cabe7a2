"""Recent values of a routing signal, shared by the requests whose threshold is calibrated on them."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field


class RecentValues:
    """The most recent `size` values of one signal (step entropies, a router's scores), kept sorted
    as well, so that a quantile costs a lookup rather than a sort on every decoding step."""

    def __init__(self, size: int = 256) -> None:
        self._arrived: deque[float] = deque()
        self._sorted: list[float] = []
        self.size = size

    def add(self, value: float) -> None:
        self._arrived.append(value)
        bisect.insort(self._sorted, value)
        if len(self._arrived) > self.size:
            del self._sorted[bisect.bisect_left(self._sorted, self._arrived.popleft())]

    def __len__(self) -> int:
        return len(self._arrived)

    def quantile(self, q: float) -> float:
        """The q-quantile of the values held, interpolated linearly (numpy's default); the window
        must not be empty."""
        position = q * (len(self._sorted) - 1)
        below = int(position)
        above = min(below + 1, len(self._sorted) - 1)
        return self._sorted[below] + (position - below) * (self._sorted[above] - self._sorted[below])

    def mean_excess(self, over: float) -> float | None:
        """How far the values held above `over` exceed it, on average; None when none is above."""
        above = self._sorted[bisect.bisect_right(self._sorted, over):]
        return sum(above) / len(above) - over if above else None


@dataclass
class SharedWindows:
    """What the policies of one tenant on one alias calibrate their thresholds on, together: recent
    step entropies (target_fraction), recent router scores (learned with its threshold taken
    from traffic), and recent answers' lengths (how much of an answer a priced decision expects is
    still to come). A tenant's requests share them whatever their target (the values do not depend
    on it); two tenants never do, or one tenant's traffic would move the other's thresholds."""

    entropies: RecentValues = field(default_factory=lambda: RecentValues(256))
    # a router's scores are rarely high (the share routed is small): a longer memory keeps the
    # upper quantile steady, and spans several long answers
    scores: RecentValues = field(default_factory=lambda: RecentValues(2048))
    answer_lengths: RecentValues = field(default_factory=lambda: RecentValues(64))  # answer tokens
