"""Parse K3's generated XTML back into an OpenAI assistant message, incrementally.

The prompt ends inside a channel (`<|open|>think<|sep|>` with thinking on, `<|open|>response<|sep|>`
with it off), so a completion looks like

    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>   (or one <|open|>json ...)
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>[<|end_of_msg|>]

`StreamParser.feed(text)` takes the output in chunks split anywhere (a marker or a tag may straddle
chunks: the unfinished tail is held back) and returns OpenAI `chat.completion.chunk`-style deltas;
`finish()` flushes; `message()` is the assistant message so far. `feed_token(id, piece)` is the
exact path: a marker counts only when it arrived as its control token id, so text that merely
spells `<|open|>` stays text. Fed plain text, markers are found by scanning, which cannot tell a
real marker from one the model wrote out as ordinary characters.

Nothing here raises on model output, and no protocol text ever reaches `content` or
`reasoning_content`: a marker, tag or tool call the grammar does not allow where it appears is
dropped and recorded in `problems` (with its text; see PROBLEM_CODES). Ordinary text that is not
structure stays in the channel it appeared in. Fed plain text, no channel or argument ever holds a
complete marker string, not even one spliced from the text either side of something dropped
(`x<|sep` + dropped + `|>y`): the part that would complete it is dropped too (`joined_marker`). By
token id such a splice is text the model wrote, and is kept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from openk3.chat.lexer import Lexer, Sink
from openk3.chat.xtml import CLOSE, END_OF_MSG, MARKERS, OPEN, SEP

#: Control-token ids of the markers (spec §7.1); 163585 `[EOS]` also ends a message.
MARKER_IDS = {163585: END_OF_MSG, 163586: END_OF_MSG, 163587: OPEN, 163588: CLOSE, 163589: SEP}

PROBLEM_CODES = {
    "unclosed": "an element was closed implicitly (by a later tag, the message close or <|end_of_msg|>)",
    "truncated": "the output ended before the message was closed (open elements are closed for you)",
    "unexpected_tag": "a well-formed tag where the grammar does not allow it; dropped (text in problem)",
    "malformed_tag": "<|open|>/<|close|> not followed by a known tag name and <|sep|>; the marker (and a "
                     "tag-shaped header) dropped, text that cannot be a tag header kept (text in problem)",
    "missing_sep": "a close tag without its <|sep|>; accepted as the close",
    "stray_sep": "a <|sep|> outside a tag; dropped",
    "text_outside_channel": "non-whitespace text between channels; appended to content",
    "channel_order": "think/response/tools out of order or repeated; parsed anyway",
    "bad_attributes": "a tag whose attributes do not follow key=\"value\"; read leniently",
    "call_missing_tool": "a call without a tool name (no tool=, or an empty or whitespace-only one); the call is "
                         "dropped (text in problem)",
    "call_index_mismatch": "a call's index= differs from its position",
    "argument_missing_key": "an argument without a key (no key=, or an empty or whitespace-only one); the argument "
                            "is dropped (text in problem)",
    "unknown_argument_type": "type= is not string/number/boolean/null/object/array; parsed as JSON if it is",
    "invalid_argument_json": "a non-string argument whose text is not JSON; kept as a string",
    "argument_type_mismatch": "an argument's JSON value does not match its type=; value kept",
    "duplicate_argument": "the same key twice in one call (the JSON object repeats it)",
    "mixed_call_body": "a call mixing argument and json children; the later ones are dropped (text in problem)",
    "joined_marker": "(text mode) text that would complete a marker string with the text before it in the same "
                     "channel or argument, once protocol between them is dropped or consumed; dropped (text in "
                     "problem)",
    "text_after_end": "output after the message ended; not part of the message (text in problem)",
    "feed_after_finish": "feed() after finish(); ignored (text in problem)",
}

_CHILDREN = {"message": ("think", "response", "tools"), "tools": ("call",), "call": ("argument", "json")}
_TAGS = ("message", "think", "response", "tools", "call", "argument", "json")
_CHANNEL_RANK = {"think": 0, "response": 1, "tools": 2}
_ARG_TYPES = {"string": (str,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
              "object": (dict,), "array": (list,)}
_MAX_HEADER = 4096
_ATTR = re.compile(r'\s*([^\s="]+)="([^"]*)"')
# What can still become a tag header, used to tell tag-shaped debris (dropped whole) from text that
# merely follows a stray marker (kept): a name, then (open tags) key="value" attributes.
_NAME_PREFIX = re.compile(r"(?:[A-Za-z_][\w.:-]{0,63})?")
_ATTRS_PREFIX = re.compile(r'(?:\s*[^\s="]+="[^"]*")*\s*(?:[^\s="]+(?:=(?:"[^"]*)?)?)?')
_ENTITY = re.compile(r"&(amp|quot);")


def unescape_attr(value: str) -> str:
    return _ENTITY.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _loads(text: str) -> Any:
    """Strict JSON (no NaN/Infinity); raises ValueError."""
    return json.loads(text, parse_constant=_reject_constant)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_string_body(text: str) -> str:
    """JSON escaping of a piece of a string value (escaping is per character, so pieces concatenate)."""
    return _dumps(text)[1:-1]


class StreamParser:
    """Incremental parser of one assistant completion (the text after the generation prompt).

    thinking: the prompt ended with `<|open|>think<|sep|>` (True) or `<|open|>response<|sep|>`.
    call_id: makes a tool call's id from (0-based position, function name); default `call_<position>`
        (XTML carries no call ids; servers that need globally unique ids pass their own).
    """

    def __init__(self, thinking: bool = True, *, call_id: Callable[[int, str], str] | None = None,
                 marker_ids: dict[int, str] | None = None):
        self.thinking = thinking
        self._call_id = call_id or (lambda i, name: f"call_{i}")
        self._marker_ids = MARKER_IDS if marker_ids is None else marker_ids
        self._lexer = Lexer()
        self._stack = ["message", "think" if thinking else "response"]
        self._channels = [self._stack[-1]]
        self._started = False  # anything but an echo of the prompt's own tags seen yet
        self._ended = False
        self._eom_seen = False
        self._finished = False
        self._tag: dict | None = None  # a tag being assembled: kind, header text
        self._stray = ""  # whitespace-only text between channels, held until it proves to be more
        self._stray_live = False  # inside a run of stray text already reported and emitted as content
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict] = []  # the calls of the message (dropped ones are not here)
        self._call: dict | None = None  # the call being parsed, dropped or not
        self._call_tags = 0  # call tags seen, for the index= check
        self._arg: dict | None = None
        self._trailing: dict | None = None
        self._sinks = {key: Sink(lambda text, key=key: self._emit(key, text), self._problem)
                       for key in ("reasoning_content", "content")}
        self._held: Sink | None = None  # the sink holding the start of a run of text, if any
        self._exact = False  # the text being parsed came by token id (feed_token)
        self.problems: list[dict] = []
        self._pos = 0
        self._out: list[dict] = []

    # ---------------------------------------------------------------------------------- public

    def feed(self, text: str) -> list[dict]:
        """Parse a chunk of generated text; returns the deltas it completes."""
        if self._finished:
            self._problem("feed_after_finish", "feed() after finish()", text)
            return []
        for kind, value in self._lexer.feed(text):
            self._atom(kind, value)
        return self._take()

    def feed_token(self, token_id: int, piece: str) -> list[dict]:
        """Parse one generated token: a marker only if token_id is a marker's control id."""
        if self._finished:
            self._problem("feed_after_finish", "feed_token() after finish()", piece)
            return []
        for kind, value in self._lexer.flush():
            self._atom(kind, value)
        marker = self._marker_ids.get(token_id)
        self._exact = True
        try:
            if marker is not None:
                self._atom("marker", marker)
            elif piece:
                self._atom("text", piece)
        finally:
            self._exact = False
        return self._take()

    def finish(self) -> list[dict]:
        """End of output: flush what was held back, close what is open, report truncation."""
        if self._finished:
            return []
        for kind, value in self._lexer.flush():
            self._atom(kind, value)
        self._release()
        if self._tag is not None:
            tag, self._tag = self._tag, None
            if tag["kind"] == "close" and tag["text"] in _TAGS:
                self._problem("missing_sep", f"{tag['text']} closed without <|sep|> at the end of the output")
                self._close(tag["text"], tag["raw"] + tag["text"])
            else:
                self._problem("truncated", "the output ended inside a tag", tag["raw"] + tag["text"])
        self._flush_stray()
        if not self._ended:
            open_elements = self._stack[1:]
            self._problem("truncated", "the output ended before the message was closed"
                          + (f" (open: {', '.join(open_elements)})" if open_elements else ""))
            while len(self._stack) > 1:
                self._pop()
            self._ended = True
        self._finished = True
        return self._take()

    def message(self) -> dict:
        """The assistant message parsed so far (OpenAI shape plus `problems`)."""
        reasoning = "".join(self._reasoning)
        content = "".join(self._content)
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self._calls]
        return {
            "role": "assistant",
            "reasoning_content": reasoning or None,
            "content": content if content or not calls else None,
            "tool_calls": calls or None,
            "problems": [dict(p) for p in self.problems],
        }

    # ---------------------------------------------------------------------------------- output

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _emit(self, key: str, text: str) -> None:
        if not text:
            return
        (self._reasoning if key == "reasoning_content" else self._content).append(text)
        last = self._out[-1] if self._out else None
        if last is not None and list(last) == [key]:
            last[key] += text
        else:
            self._out.append({key: text})

    def _emit_args(self, call: dict, text: str) -> None:
        if not text:
            return
        call["arguments"] += text
        last = self._out[-1] if self._out else None
        if last is not None and list(last) == ["tool_calls"]:
            entry = last["tool_calls"][-1]
            if entry["index"] == call["n"] and "id" not in entry:
                entry["function"]["arguments"] += text
                return
        self._out.append({"tool_calls": [{"index": call["n"], "function": {"arguments": text}}]})

    def _problem(self, code: str, detail: str, text: str | None = None, offset: int | None = None) -> dict:
        p = {"code": code, "detail": detail, "offset": self._pos if offset is None else offset}
        if text is not None:
            p["text"] = text
        self.problems.append(p)
        return p

    # ---------------------------------------------------------------------------------- atoms

    def _atom(self, kind: str, value: str) -> None:
        start = self._pos
        self._pos += len(value)
        if kind == "marker":  # a run of text ends: what it held back is decided
            self._release()
        if self._tag is not None:
            tag = self._tag
            if kind == "text":
                header = tag["text"] + value
                bad = self._first_bad(tag["kind"], header)
                if bad is None:
                    tag["text"] = header
                    return
                # Not a tag after all: the marker is protocol debris and goes; what follows it is text
                # the model wrote, so it stays in the channel.
                self._tag = None
                self._problem("malformed_tag", f"{tag['raw']} not followed by a tag; marker dropped",
                              tag["raw"] + header[:bad + 1], offset=tag["start"])
                self._text(header)
                return
            self._tag = None
            if value == SEP:
                self._tag_done(tag)
                return
            if tag["kind"] == "close" and tag["text"] in _TAGS:
                self._problem("missing_sep", f"{tag['text']} closed without <|sep|>", offset=tag["start"])
                self._close(tag["text"], tag["raw"] + tag["text"])
            else:
                self._problem("malformed_tag", f"{tag['kind']} tag interrupted by {value}; dropped",
                              tag["raw"] + tag["text"], offset=tag["start"])
        if self._ended:
            if value == END_OF_MSG and kind == "marker" and not self._eom_seen and self._trailing is None:
                self._eom_seen = True
            else:
                self._after_end(value, start)
        elif kind == "text":
            self._text(value)
        elif value in (OPEN, CLOSE):
            self._tag = {"kind": "open" if value == OPEN else "close", "raw": value, "text": "", "start": start}
        elif value == END_OF_MSG:
            self._end_of_message()
        else:
            self._problem("stray_sep", "<|sep|> outside a tag; dropped", value, offset=start)

    @staticmethod
    def _first_bad(kind: str, header: str) -> int | None:
        """Index of the first character that stops `header` from beginning a tag (None: still can).

        A tag is a name (`_NAME_PREFIX`), for open tags followed by attributes: read leniently after a
        known name, required to be key="value" after an unknown one (so that a marker followed by
        prose is told apart quickly, while `<|close|>X<|sep|>` is still recognised as a tag to drop).
        Once a header is bad every extension of it is bad, so chunking never changes the outcome.
        """
        name, space, rest = header.partition(" ")
        end = _NAME_PREFIX.match(name).end()
        if end < len(name):
            return end
        if not space:
            return None
        if kind == "close" or not name:
            return len(name)
        if name not in _TAGS:
            end = _ATTRS_PREFIX.match(rest).end()
            if end < len(rest):
                return len(name) + 1 + end
        return _MAX_HEADER if len(header) > _MAX_HEADER else None

    def _tag_done(self, tag: dict) -> None:
        raw = tag["raw"] + tag["text"] + SEP
        if tag["kind"] == "close":
            if tag["text"] in _TAGS:
                self._close(tag["text"], raw)
            else:
                self._problem("malformed_tag", "not a known close tag; dropped", raw, offset=tag["start"])
            return
        name, _, rest = tag["text"].partition(" ")
        if name not in _TAGS:
            self._problem("malformed_tag", "not a known open tag; dropped", raw, offset=tag["start"])
            return
        attrs: dict[str, str] = {}
        pos = 0
        rest = " " + rest if rest else ""
        for m in _ATTR.finditer(rest):
            if m.start() != pos:
                break
            attrs.setdefault(m.group(1), unescape_attr(m.group(2)))
            pos = m.end()
        if pos != len(rest):
            self._problem("bad_attributes", f"attributes of {name} not of the form key=\"value\"", raw)
            for m in _ATTR.finditer(rest[pos:]):
                attrs.setdefault(m.group(1), unescape_attr(m.group(2)))
        self._open(name, attrs, raw)

    # ---------------------------------------------------------------------------------- text

    def _put(self, sink: Sink, text: str) -> None:
        # text passed to _text always ends at the current position
        if sink.put(text, self._pos - len(text), self._exact):
            assert self._held in (None, sink), "a run of text goes to one sink"
            self._held = sink

    def _release(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def _text(self, text: str) -> None:
        top = self._stack[-1]
        if top == "think":
            self._started = self._started or bool(text)
            self._put(self._sinks["reasoning_content"], text)
        elif top == "response":
            self._started = self._started or bool(text)
            self._put(self._sinks["content"], text)
        elif top == "argument":
            arg = self._arg
            if arg["discard"]:
                arg["buf"].append(text)
            else:
                self._put(arg["sink"], text)
        elif top == "json":
            call = self._call
            if call.get("discard_json"):
                call["discarded"].append(text)
            else:
                self._put(call["json_sink"], text)
        else:  # between channels / calls / arguments
            if self._stray_live:
                self._put(self._sinks["content"], text)
                return
            self._stray += text
            if self._stray.strip():
                self._started = True
                first = len(self._stray) - len(self._stray.lstrip())
                self._problem("text_outside_channel", f"text inside {top} outside any channel; kept as content",
                              offset=self._pos - len(self._stray) + first)
                self._stray_live = True
                stray, self._stray = self._stray, ""
                self._put(self._sinks["content"], stray)

    def _flush_stray(self) -> None:
        self._stray = ""  # only whitespace is ever held
        self._stray_live = False

    def _after_end(self, text: str, start: int) -> None:
        if self._trailing is None:
            self._trailing = self._problem("text_after_end", "output after the end of the message", "", offset=start)
        self._trailing["text"] += text

    # ---------------------------------------------------------------------------------- structure

    def _open(self, name: str, attrs: dict[str, str], raw: str) -> None:
        self._flush_stray()
        top = self._stack[-1]
        if not self._started:  # the prompt's own tags echoed at the start of the completion
            if name == "message" and attrs.get("role") == "assistant" and self._stack == ["message", top]:
                return
            if name == top and not self._calls:
                return
        self._started = True
        level = next((k for k in range(len(self._stack) - 1, -1, -1) if name in _CHILDREN.get(self._stack[k], ())),
                     None)
        if level is None:
            self._problem("unexpected_tag", f"<|open|>{name} is not allowed inside {top}; dropped", raw)
            return
        while len(self._stack) > level + 1:
            self._problem("unclosed", f"{self._stack[-1]} closed implicitly by <|open|>{name}")
            self._pop()
        parent = self._stack[-1]
        self._stack.append(name)
        if parent == "message":
            if self._channels and _CHANNEL_RANK[name] <= _CHANNEL_RANK[self._channels[-1]]:
                self._problem("channel_order", f"{name} after {self._channels[-1]}")
            self._channels.append(name)
        elif name == "call":
            self._start_call(attrs, raw)
        elif name == "argument":
            self._start_argument(attrs, raw)
        elif name == "json":
            call = self._call
            if call["mode"] is None and not call["dropped"]:
                call["mode"] = "raw"
                call["json_sink"] = Sink(lambda text: self._emit_args(call, text), self._problem)
            else:
                if not call["dropped"]:  # a dropped call was reported as a whole
                    self._problem("mixed_call_body", f"json block in a call that already has {call['mode']} children")
                call["discard_json"] = True
                call["discarded"] = [raw]

    def _close(self, name: str, raw: str) -> None:
        self._flush_stray()
        self._started = True
        if name == "message":
            while len(self._stack) > 1:
                self._problem("unclosed", f"{self._stack[-1]} closed implicitly by <|close|>message")
                self._pop()
            self._ended = True
            return
        if name not in self._stack[1:]:
            self._problem("unexpected_tag", f"<|close|>{name} with no open {name}; dropped", raw)
            return
        while self._stack[-1] != name:
            self._problem("unclosed", f"{self._stack[-1]} closed implicitly by <|close|>{name}")
            self._pop()
        self._pop()

    def _end_of_message(self) -> None:
        self._flush_stray()
        for element in reversed(self._stack):
            self._problem("unclosed", f"{element} closed implicitly by <|end_of_msg|>")
        while len(self._stack) > 1:
            self._pop()
        self._ended = self._eom_seen = True

    def _pop(self) -> None:
        name = self._stack.pop()
        if name == "argument":
            self._end_argument()
        elif name == "call":
            self._end_call()
        elif name == "json":
            call = self._call
            if call.pop("discard_json", False):
                discarded = "".join(call.pop("discarded"))
                if call["dropped"]:
                    call["dropped"]["text"] += discarded
                else:
                    self._problem("mixed_call_body", "dropped json block", discarded)

    # ---------------------------------------------------------------------------------- tool calls

    def _start_call(self, attrs: dict[str, str], raw: str) -> None:
        self._call_tags += 1
        n = len(self._calls)
        name = attrs.get("tool")
        call = {"n": n, "name": name, "arguments": "", "mode": None, "keys": set(), "dropped": None}
        self._call = call
        if name is None or not name.strip():
            # A call nobody can dispatch: emitting it with name "" would hand clients a call to an empty
            # tool (no tool can be named by whitespace alone either; the renderer refuses both). Its body
            # is swallowed into the problem's text instead.
            what = "no tool attribute" if name is None else f"a blank tool name {name!r}"
            call["dropped"] = self._problem("call_missing_tool", f"call tag {self._call_tags} has {what}; "
                                            "dropped", raw)
            return
        if attrs.get("index") not in (None, str(self._call_tags)):
            self._problem("call_index_mismatch", f"call {n} has index={attrs['index']!r}, "
                          f"expected {self._call_tags}")
        call["id"] = self._call_id(n, name)
        self._calls.append(call)
        self._out.append({"tool_calls": [{"index": n, "id": call["id"], "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})

    def _start_argument(self, attrs: dict[str, str], raw: str) -> None:
        call = self._call
        key = attrs.get("key")
        kind = attrs.get("type", "string")
        # report: for a dropped argument, the problem whose text collects it, or "mixed" (reported at its end)
        arg = {"call": call, "key": key, "type": kind, "string": kind == "string", "buf": [], "discard": False,
               "report": call["dropped"]}
        self._arg = arg
        if call["dropped"]:
            arg["discard"] = True
            arg["buf"].append(raw)
            return
        if key is None or not key.strip():
            what = "no key" if key is None else f"a blank key {key!r}"
            arg["report"] = self._problem("argument_missing_key", f"argument of call {call['n']} has {what}; "
                                          "dropped", "")
            arg["discard"] = True
            arg["buf"].append(raw)
            return
        if kind not in _ARG_TYPES:
            self._problem("unknown_argument_type", f"argument {key!r} has type={kind!r}")
        if call["mode"] == "raw":
            self._problem("mixed_call_body", "argument in a call that already has a json block")
            arg["discard"] = True
            arg["report"] = "mixed"
            arg["buf"].append(raw)
            return
        if key in call["keys"]:
            self._problem("duplicate_argument", f"argument {key!r} repeated in call {call['n']}")
        call["keys"].add(key)
        write = (lambda text: self._emit_args(call, _json_string_body(text))) if arg["string"] else arg["buf"].append
        arg["sink"] = Sink(write, self._problem)
        prefix = "{" if call["mode"] is None else ", "
        call["mode"] = "args"
        self._emit_args(call, prefix + _dumps(key) + ": " + ('"' if arg["string"] else ""))

    def _end_argument(self) -> None:
        arg, self._arg = self._arg, None
        call = arg["call"]
        if arg["discard"]:
            if arg["report"] == "mixed":
                self._problem("mixed_call_body", "dropped argument", "".join(arg["buf"]))
            else:
                arg["report"]["text"] += "".join(arg["buf"])
            return
        if arg["string"]:
            self._emit_args(call, '"')
            return
        raw = "".join(arg["buf"])
        try:
            value = _loads(raw)
        except (ValueError, RecursionError):
            self._problem("invalid_argument_json", f"argument {arg['key']!r} (type={arg['type']}) is not JSON; "
                          "kept as a string", raw)
            value = raw
        else:
            expected = _ARG_TYPES.get(arg["type"])
            ok = expected is None or (isinstance(value, expected) and (arg["type"] == "boolean"
                                                                      or not isinstance(value, bool)))
            if not ok:
                self._problem("argument_type_mismatch", f"argument {arg['key']!r} has type={arg['type']} but its "
                              f"value is {type(value).__name__}", raw)
        self._emit_args(call, _dumps(value))

    def _end_call(self) -> None:
        call, self._call = self._call, None
        if call["dropped"]:
            return
        if call["mode"] == "args":
            self._emit_args(call, "}")
        elif call["mode"] is None:
            self._emit_args(call, "{}")


def marker_ids_of(tok: Any) -> dict[int, str]:
    """Marker control ids from a tokenizer's `special_ids` (name -> id), for StreamParser(marker_ids=...)."""
    ids = {tok.special_ids[m]: m for m in MARKERS if m in tok.special_ids}
    if "[EOS]" in tok.special_ids:
        ids[tok.special_ids["[EOS]"]] = END_OF_MSG
    return ids


def parse_completion(text: str, thinking: bool = True, **kwargs: Any) -> dict:
    """Parse a whole completion (the text after the generation prompt) into an assistant message."""
    parser = StreamParser(thinking, **kwargs)
    parser.feed(text)
    parser.finish()
    return parser.message()


def parse_tokens(tokens: Iterable[tuple[int, str]], thinking: bool = True, **kwargs: Any) -> dict:
    """Parse a completion given as (token id, decoded piece) pairs (markers recognised by id only)."""
    parser = StreamParser(thinking, **kwargs)
    for token_id, piece in tokens:
        parser.feed_token(token_id, piece)
    parser.finish()
    return parser.message()
