"""Streaming detokenisation with stop strings.

Token ids arrive one at a time; their bytes may split a UTF-8 character, and a stop string may span
several tokens. `TextStream` keeps the exact text so far and releases only what is final: bytes of
an incomplete character and the tail that could still be the start of a stop string are held back.
When a stop string appears, the text is cut just before it (the stop string is not part of the
output, as in vLLM and the OpenAI API).
"""

from __future__ import annotations

import codecs


class TextStream:
    """Incremental text of generated token ids for one request.

    Args:
        tokenizer: an `openk3.tokenizer.Tokenizer` (uses `decode_bytes`, `is_special`, `special_flags`,
            `id_to_piece`).
        stop: stop strings; the first one to appear ends the text.
        skip_special: leave out special tokens whose HF `special` flag is set (as `Tokenizer.decode`).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, skip_special: bool = True) -> None:
        self.tok = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # everything decoded so far (complete characters only)
        self._sent = 0  # characters already released
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped: str | None = None  # the stop string that ended the text

    def _skipped(self, token_id: int) -> bool:
        if not self.skip_special or not self.tok.is_special(token_id):
            return False
        piece = self.tok.id_to_piece(token_id)
        return self.tok.special_flags.get(piece, True) if isinstance(piece, str) else False

    def add(self, token_id: int) -> str:
        """Feed one token; returns the newly final text (maybe empty). After a stop string, nothing."""
        if self.stopped is not None:
            return ""
        if not self._skipped(token_id):
            self._text += self._decoder.decode(self.tok.decode_bytes([token_id]))
        if self.stop:
            # A new match can only start within the last (longest stop + new chars) characters.
            start = max(0, self._sent - self._hold)
            hits = [(i, s) for s in self.stop if (i := self._text.find(s, start)) >= 0]
            if hits:
                cut, self.stopped = min(hits)
                self._text = self._text[:cut]
                return self._release(len(self._text))
        return self._release(len(self._text) - self._hold)

    def finish(self) -> str:
        """End of generation: flush held text (and any incomplete UTF-8 as U+FFFD)."""
        if self.stopped is None:
            self._text += self._decoder.decode(b"", final=True)
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self._text[self._sent:upto]
        self._sent = upto
        return out

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._text[:self._sent]
