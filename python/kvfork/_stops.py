"""Stop strings over generated text (shared by `Chat` and `kvfork serve`)."""

from __future__ import annotations


class StopStrings:
    """Generated text cut at the first stop string, handed out as it grows without a tail
    that may still become a stop string (a chat turn's reply, a server's completion)."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.content = ""
        self.given = 0  # characters of content handed out by take()
        self.stopped = False

    def add(self, piece: str) -> bool:
        """Append a token's text; True once a stop string has appeared."""
        start = max(0, len(self.text) - self.longest)  # only the new tail can hold a new stop
        self.text += piece
        cuts = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        self.content = self.text[: min(cuts)] if cuts else self.text
        self.stopped = self.stopped or bool(cuts)
        return bool(cuts)

    def take(self, *, final: bool = False) -> str:
        """The content not handed out yet, less a tail that may still become a stop string
        (unless ``final`` or a stop string has been found)."""
        end = len(self.content)
        if not (final or self.stopped):
            end -= self._pending_stop_prefix()
        piece = self.content[self.given : end]
        self.given = max(self.given, end)
        return piece

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
