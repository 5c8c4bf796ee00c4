"""Incremental detokenization with stop strings: token ids in, text deltas out, never a partial stop string.

A tokenizer backed by the ``tokenizers`` library (every built-in model's) is decoded with its ``DecodeStream``: a
constant cost a token, where decoding every id so far again grew with the output (half a millisecond a token at
2,048 tokens on SmolLM2's tokenizer); its text is the same as one ``decode`` of all the ids. Any other tokenizer, or
one that cleans up spaces after decoding, is decoded whole each token. Stop strings are looked for only where the new
text could complete one.
"""

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
        self._backend, self._stream = _decode_stream(tokenizer)

    def feed(self, token: int) -> str:
        before = len(self.text)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token)
            if piece is None:
                return ""  # an incomplete UTF-8 sequence: wait for the next token
            text = self.text + piece
        else:
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                return ""
        self.text = text
        for stop in self.stop:
            # a streamed text only grows, and no stop string ended before this token; a whole decode may redo its start
            at = text.find(stop, max(0, before - len(stop) + 1) if self._stream is not None else 0)
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


def _decode_stream(tokenizer: Any) -> tuple[Any, Any]:
    """(the ``tokenizers.Tokenizer`` behind ``tokenizer``, a fresh ``DecodeStream`` over it), or (None, None)
    where decoding must go through ``tokenizer.decode``."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None, None
    return backend, DecodeStream(skip_special_tokens=True)
