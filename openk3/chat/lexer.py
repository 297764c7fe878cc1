"""Text mode of the XTML parser (`openk3.chat.parse`): a lexer that cuts control markers out of plain text
fed in arbitrary chunks, and the sinks (reasoning, content, argument values) that never let text joined
across dropped protocol spell a marker again. For token ids, `token_pieces` does the lexer's work: markers
by id, the text between them decoded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from openk3.chat.xtml import MARKERS


class Lexer:
    """Text -> atoms ('text', s) / ('marker', m), holding back a tail that may begin a marker."""

    def __init__(self) -> None:
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        buf = self.buf + text
        atoms: list[tuple[str, str]] = []
        start = i = 0
        while True:
            p = buf.find("<|", i)
            if p < 0:
                hold = 1 if buf.endswith("<") else 0
                break
            marker = next((m for m in MARKERS if buf.startswith(m, p)), None)
            if marker is not None:
                if p > start:
                    atoms.append(("text", buf[start:p]))
                atoms.append(("marker", marker))
                start = i = p + len(marker)
                continue
            tail = buf[p:]
            if any(m.startswith(tail) for m in MARKERS):  # an unfinished marker at the end
                hold = len(tail)
                break
            i = p + 2
        end = len(buf) - hold
        if end > start:
            atoms.append(("text", buf[start:end]))
        self.buf = buf[end:]
        return atoms

    def flush(self) -> list[tuple[str, str]]:
        rest, self.buf = self.buf, ""
        return [("text", rest)] if rest else []


_MARKER_PREFIXES = frozenset(m[:k] for m in MARKERS for k in range(1, len(m)))
_TAIL = max(map(len, MARKERS)) - 1


def _open_marker(tail: str) -> str:
    """The end of `tail` that a marker could continue ('' if none): from its last `<`, as markers hold
    one `<` only, at their start."""
    k = tail.rfind("<")
    return tail[k:] if k >= 0 and tail[k:] in _MARKER_PREFIXES else ""


class Sink:
    """One place text goes (reasoning, content, an argument's value, a json block) that, in text mode,
    never receives a complete marker string.

    The lexer cuts every marker out of the text, so a marker string can only arise where text is joined
    across something removed between: a dropped marker or tag, or a channel closed and later resumed
    (`x<|sep` + `<|close|><|close|>` dropped + `|>y`). What came before the join may already have been
    streamed, so the text after it that would complete the marker is dropped (`joined_marker`). Text that
    only continues a marker's beginning (`<|se` + `p`) is held until more text decides it or the run of
    text ends at the next marker (`release`), so the outcome is the same for any chunking.
    """

    def __init__(self, write: Callable[[str], None], problem: Callable[..., Any]):
        self._write, self._problem = write, problem
        self.tail = ""  # the last characters written, enough to hold a marker's beginning
        self.held = ""
        self.held_at = 0

    def put(self, text: str, at: int, exact: bool) -> bool:
        """Write `text` (input offset `at`); exact: it came by token id, so it is text whatever it spells.
        Returns whether something is now held (to be released at the end of the run)."""
        if self.held:
            text, at, self.held = self.held + text, self.held_at, ""
        start = "" if exact else _open_marker(self.tail)
        while start and text:
            joined = start + text
            marker = next((m for m in MARKERS if joined.startswith(m)), None)
            if marker is None:
                if joined in _MARKER_PREFIXES:
                    self.held, self.held_at = text, at
                    return True
                break
            cut = len(marker) - len(start)
            self._problem("joined_marker", f"text joined across removed protocol would complete {marker} with "
                          f"the {start!r} before it; dropped", text[:cut], offset=at)
            text, at = text[cut:], at + cut
        self._put(text)
        return False

    def release(self) -> None:
        held, self.held = self.held, ""
        self._put(held)

    def _put(self, text: str) -> None:
        if text:
            self.tail = (self.tail + text)[-_TAIL:]
            self._write(text)


def token_pieces(ids: Sequence[int], tokenizer: Any, markers: dict[int, str]) -> list[tuple[int, str]]:
    """(id, text) pairs for `parse_tokens`: each marker id alone, runs of other ids decoded together (a byte-level
    tokenizer splits multi-byte characters across ids, so decoding them one by one would garble them)."""
    out: list[tuple[int, str]] = []
    run: list[int] = []
    for token_id in [*ids, None]:
        if token_id is not None and token_id not in markers:
            run.append(token_id)
            continue
        if run:
            out.append((run[0], tokenizer.decode(run)))
            run = []
        if token_id is not None:
            out.append((token_id, markers[token_id]))
    return out
