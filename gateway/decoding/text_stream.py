"""Turn the answer's growing byte string into text deltas: UTF-8 safe, stop strings held back."""

from __future__ import annotations

import codecs


class TextReleaser:
    """Feed answer bytes in order; get back the text that can safely be shown.

    Bytes of an unfinished UTF-8 character wait for the rest. Text that could be the start of a
    stop string waits until it can no longer become one. Once a stop string appears, the text
    is cut before it and nothing more is released.
    """

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stops if s)
        self.text = ""  # every complete character so far (up to a stop string, once found)
        self.released = 0  # characters of `text` already handed out
        self.stopped = False

    @property
    def mid_character(self) -> bool:
        """True while the bytes fed so far end inside a multi-byte character."""
        return bool(self._decoder.getstate()[0])

    def feed(self, data: bytes) -> str:
        if self.stopped:
            return ""
        self.text += self._decoder.decode(data)
        return self._release(final=False)

    def finish(self) -> str:
        """Release whatever is held back; call once when the answer ends."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not self.stopped:
            cut = self._first_stop()
            if cut is not None:
                self.text, self.stopped, end = self.text[:cut], True, cut
            elif not final:
                end -= self._held_back()
        delta = self.text[self.released:end]
        self.released = max(self.released, end)
        return delta

    def _first_stop(self) -> int | None:
        found = []
        for stop in self._stops:
            index = self.text.find(stop, max(0, self.released - len(stop) + 1))
            if index >= 0:
                found.append(index)
        return min(found) if found else None

    def _held_back(self) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
