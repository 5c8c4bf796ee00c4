"""Incremental detokenization with stop strings: token ids in, text deltas out, never a partial stop string."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Feeds tokens, returns the new text that is safe to emit; ``stopped`` once a stop string appeared."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False
        self.text = ""

    def feed(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.text = text
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                self.stopped = True
                self.text = text[:at]
                return self._delta(self.text)
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._delta(text[: max(self.emitted, len(text) - hold)])

    def flush(self) -> str:
        return "" if self.stopped else self._delta(self.text)

    def _delta(self, upto: str) -> str:
        delta = upto[self.emitted:]
        self.emitted = len(upto)
        return delta
