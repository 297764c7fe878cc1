"""Incremental XTML parser (openk3.chat.parse): well-formed completions, streaming deltas under any
chunking, malformed / leaked / truncated output (never raises, text kept, problems recorded), token
mode, the render -> parse round trip (hypothesis), and `openk3 parse`."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from openk3.chat import PROBLEM_CODES, StreamParser, parse_completion, parse_tokens, render_text
from openk3.chat.parse import MARKER_IDS
from openk3.chat.xtml import MARKERS

WEATHER_CALL = (
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
    "<|close|>tools<|sep|>")
COMPLETION = ("Plan.<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>" + WEATHER_CALL
              + "<|close|>message<|sep|>")


def codes(message: dict) -> list[str]:
    return [p["code"] for p in message["problems"]]


def stream(text: str, cuts: list[int], thinking: bool = True) -> tuple[dict, list[dict]]:
    parser = StreamParser(thinking)
    deltas: list[dict] = []
    prev = 0
    for cut in sorted(cuts) + [len(text)]:
        deltas += parser.feed(text[prev:cut])
        prev = cut
    deltas += parser.finish()
    return parser.message(), deltas


def replay(deltas: list[dict]) -> dict:
    """Accumulate OpenAI deltas the way a client does."""
    out = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for d in deltas:
        for key in ("reasoning_content", "content"):
            out[key] += d.get(key, "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in out["tool_calls"] and tc["type"] == "function"
                out["tool_calls"][tc["index"]] = {"id": tc["id"], "type": "function",
                                                  "function": {"name": tc["function"]["name"], "arguments": ""}}
            out["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"].get("arguments", "")
    return out


def assert_deltas_match(message: dict, deltas: list[dict]) -> None:
    r = replay(deltas)
    assert r["reasoning_content"] == (message["reasoning_content"] or "")
    assert r["content"] == (message["content"] or "")
    assert [r["tool_calls"][i] for i in sorted(r["tool_calls"])] == (message["tool_calls"] or [])


# ------------------------------------------------------------------------------------------- well-formed


def test_full_completion():
    assert parse_completion(COMPLETION) == {
        "role": "assistant", "reasoning_content": "Plan.", "content": "Sure.", "problems": [],
        "tool_calls": [{"id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}
    # the stop token, when the server leaves it in, is expected
    assert parse_completion(COMPLETION + "<|end_of_msg|>") == parse_completion(COMPLETION)


def test_deltas_exact():
    parser = StreamParser()
    deltas = parser.feed(COMPLETION) + parser.finish()
    assert deltas == [
        {"reasoning_content": "Plan."},
        {"content": "Sure."},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris", "days": 3}'}}]}]
    # a marker split across chunks is held back, never emitted as text
    parser = StreamParser()
    assert parser.feed("Plan.<|clo") == [{"reasoning_content": "Plan."}]
    assert parser.feed("se|>thi") == []
    assert parser.feed("nk<|sep|><|open|>response<|sep|>Hi <") == [{"content": "Hi "}]
    assert parser.feed("3<|close|>response<|sep|>") == [{"content": "<3"}]


def test_every_two_way_split_and_single_characters():
    whole = parse_completion(COMPLETION)
    for cut in range(len(COMPLETION) + 1):
        message, deltas = stream(COMPLETION, [cut])
        assert message == whole, cut
        assert_deltas_match(message, deltas)
    message, deltas = stream(COMPLETION, list(range(len(COMPLETION))))
    assert message == whole
    assert_deltas_match(message, deltas)


def test_every_argument_type_and_raw_json_call():
    text = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="f" index="1"<|sep|>'
            '<|open|>argument key="s" type="string"<|sep|>say "hi"\n\\ é<|close|>argument<|sep|>'
            '<|open|>argument key="n" type="number"<|sep|>-0.5<|close|>argument<|sep|>'
            '<|open|>argument key="b" type="boolean"<|sep|>false<|close|>argument<|sep|>'
            '<|open|>argument key="z" type="null"<|sep|>null<|close|>argument<|sep|>'
            '<|open|>argument key="o" type="object"<|sep|>{"k": [1, {"x": null}]}<|close|>argument<|sep|>'
            '<|open|>argument key="a&quot;&amp;" type="array"<|sep|>[]<|close|>argument<|sep|>'
            '<|close|>call<|sep|>'
            '<|open|>call tool="g&amp;h" index="2"<|sep|><|open|>json type="object"<|sep|>{"city": Paris'
            '<|close|>json<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="noargs" index="3"<|sep|><|close|>call<|sep|>'
            '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    m = parse_completion(text)
    assert m["problems"] == [] and m["reasoning_content"] is None and m["content"] is None
    f, g, h = (c["function"] for c in m["tool_calls"])
    assert json.loads(f["arguments"]) == {"s": 'say "hi"\n\\ é', "n": -0.5, "b": False, "z": None,
                                          "o": {"k": [1, {"x": None}]}, 'a"&': []}
    assert f["arguments"] == json.dumps(json.loads(f["arguments"]), ensure_ascii=False)
    assert g == {"name": "g&h", "arguments": '{"city": Paris'}
    assert h == {"name": "noargs", "arguments": "{}"}
    assert [c["id"] for c in m["tool_calls"]] == ["call_0", "call_1", "call_2"]


def test_non_thinking_mode_and_prompt_echo():
    text = "Hello.<|close|>response<|sep|><|close|>message<|sep|>"
    assert parse_completion(text, thinking=False) == {
        "role": "assistant", "reasoning_content": None, "content": "Hello.", "tool_calls": None, "problems": []}
    # the completion may carry the generation prompt's own tags
    echoed = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>' + text
    assert parse_completion(echoed, thinking=False) == parse_completion(text, thinking=False)
    echoed = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>' + COMPLETION
    assert parse_completion(echoed) == parse_completion(COMPLETION)


def test_custom_call_ids():
    m = parse_completion(COMPLETION, call_id=lambda i, name: f"{name}-{i}")
    assert m["tool_calls"][0]["id"] == "get_weather-0"


# ------------------------------------------------------------------------------------------- robustness


def test_truncated_in_think_keeps_everything_as_reasoning():
    m = parse_completion("I was thinking about")
    assert m["reasoning_content"] == "I was thinking about" and m["content"] == ""
    assert codes(m) == ["truncated"]


def test_truncated_inside_a_string_argument_still_gives_valid_json():
    m = parse_completion('r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                         '<|open|>argument key="q" type="string"<|sep|>ab"c')
    assert m["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"q": "ab\\"c"}'}
    assert m["content"] is None and codes(m) == ["truncated"]


def test_truncated_mid_tag_is_not_leaked():
    for tail in ("<|close|>resp", "<|close|>", "<|clo", '<|open|>call tool="f'):
        m = parse_completion("r<|close|>think<|sep|><|open|>response<|sep|>Hi" + tail)
        assert m["content"].startswith("Hi")
        assert "truncated" in codes(m)
        if tail != "<|clo":  # a bare partial marker could be text; a started tag is not
            assert m["content"] == "Hi"


def test_tools_right_after_think_without_response():
    """The forced-tool-choice shape: the model closes think and goes straight to tools."""
    m = parse_completion("Need weather.<|close|>think<|sep|>" + WEATHER_CALL + "<|close|>message<|sep|>")
    assert m["reasoning_content"] == "Need weather." and m["content"] is None
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert m["problems"] == []


def test_unclosed_channels_are_closed_implicitly():
    m = parse_completion("r<|open|>response<|sep|>a" + WEATHER_CALL + "<|end_of_msg|>")
    assert (m["reasoning_content"], m["content"], len(m["tool_calls"])) == ("r", "a", 1)
    assert codes(m) == ["unclosed", "unclosed", "unclosed"]  # think, response, message
    m = parse_completion('r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                         '<|open|>argument key="a" type="number"<|sep|>1<|open|>argument key="b" type="string"<|sep|>x'
                         "<|close|>tools<|sep|><|close|>message<|sep|>")
    assert m["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": "x"}'
    assert codes(m) == ["unclosed", "unclosed", "unclosed"]  # argument a; argument b and call at </tools>


def test_text_outside_channels_goes_to_content():
    m = parse_completion("r<|close|>think<|sep|>\n\nHello there<|close|>message<|sep|>")
    assert (m["reasoning_content"], m["content"]) == ("r", "\n\nHello there")
    assert codes(m) == ["text_outside_channel"]
    m = parse_completion("r<|close|>think<|sep|>\n<|open|>response<|sep|>x<|close|>response<|sep|>\n"
                         "<|close|>message<|sep|>")
    assert (m["content"], m["problems"]) == ("x", [])  # whitespace between channels is dropped silently


def test_leaked_and_malformed_tags_are_dropped_with_their_text_in_problems():
    m = parse_completion("r<|close|>think<|sep|><|open|>response<|sep|>a<|open|>foo<|sep|>b<|close|>think<|sep|>c"
                         "<|open|>message role=\"user\"<|sep|>d<|sep|>e<|close|>response<|sep|><|close|>message<|sep|>")
    assert m["content"] == "abcde"
    assert [(p["code"], p["text"]) for p in m["problems"]] == [
        ("malformed_tag", "<|open|>foo<|sep|>"), ("unexpected_tag", "<|close|>think<|sep|>"),
        ("unexpected_tag", '<|open|>message role="user"<|sep|>'), ("stray_sep", "<|sep|>")]


# Protocol debris in both channels: a lone <|sep|>, a close tag of an unknown element, a close tag of
# an element that is not open, an open tag the grammar does not allow there, a marker followed by
# prose (the marker goes, the prose stays), an unknown tag with attributes, a tag cut by a marker.
DEBRIS = ('a<|sep|>b<|close|>X<|sep|>c<|close|>argument<|sep|>d<|open|>call tool="f"<|sep|>e<|close|>X and f'
          '<|open|>foo k="v"<|sep|>g<|open|>bar<|close|> h')
DEBRIS_TEXT = "abcdeX and fg h"


def _tokens(text: str) -> list[tuple[int, str]]:
    """The completion as a tokenizer would give it: each marker as its control id, text as ordinary pieces."""
    ids = {m: i for i, m in MARKER_IDS.items() if i != 163585}
    out: list[tuple[int, str]] = []
    rest = text
    while rest:
        hit = min(((rest.find(m), m) for m in MARKERS if m in rest), default=None)
        if hit is None:
            out.append((0, rest))
            break
        p, marker = hit
        if p:
            out.append((0, rest[:p]))
        out.append((ids[marker], ""))
        rest = rest[p + len(marker):]
    return out


@pytest.mark.parametrize("thinking", [True, False])
def test_protocol_text_never_reaches_content_or_reasoning(thinking):
    """Issue 15 A1: stray markers and tags are dropped (problems record them), whole text, streamed and by id."""
    text = DEBRIS + ("<|close|>think<|sep|><|open|>response<|sep|>" + DEBRIS if thinking else "")
    text += "<|close|>response<|sep|><|close|>message<|sep|>"
    m = _every_split_agrees(text, thinking)  # streaming: every split in two (markers cut anywhere), single chars
    if thinking:
        assert (m["reasoning_content"], m["content"]) == (DEBRIS_TEXT, DEBRIS_TEXT)
    else:
        assert (m["reasoning_content"], m["content"]) == (None, DEBRIS_TEXT)
    dropped = [p["text"] for p in m["problems"] if p["code"] in ("stray_sep", "malformed_tag", "unexpected_tag")]
    assert dropped[:8] == ["<|sep|>", "<|close|>X<|sep|>", "<|close|>argument<|sep|>", '<|open|>call tool="f"<|sep|>',
                           "<|close|>X ", '<|open|>foo k="v"<|sep|>', "<|open|>bar", "<|close|> "]
    # token path: the same message (offsets count marker text, as in text mode)
    assert parse_tokens(_tokens(text), thinking) == m


def test_cli_parse_drops_a_stray_sep(monkeypatch, capsys):
    """The reproduction from issue 15: `printf 'a<|sep|>b' | openk3 parse` used to print `a<|sep|>b`."""
    from openk3.commands import parse as cmd

    monkeypatch.setattr("sys.stdin", io.StringIO("a<|sep|>b"))
    assert cmd.main(argparse.Namespace(thinking=False, deltas=False, chunk=1, input=None)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["content"] == "ab" and [p["code"] for p in out["problems"]] == ["stray_sep", "truncated"]


def test_close_without_sep_is_accepted():
    m = parse_completion("r<|close|>think<|sep|><|open|>response<|sep|>done<|close|>response<|close|>message<|sep|>")
    assert m["content"] == "done" and codes(m) == ["missing_sep"]
    m = parse_completion("r<|close|>think<|sep|><|open|>response<|sep|>done<|close|>response")
    assert m["content"] == "done" and codes(m) == ["missing_sep", "truncated"]


@pytest.mark.parametrize("body, arguments, problem", [
    ('<|open|>argument key="n" type="number"<|sep|>abc<|close|>argument<|sep|>', '{"n": "abc"}',
     "invalid_argument_json"),
    ('<|open|>argument key="n" type="number"<|sep|>NaN<|close|>argument<|sep|>', '{"n": "NaN"}',
     "invalid_argument_json"),
    ('<|open|>argument key="n" type="number"<|sep|>"7"<|close|>argument<|sep|>', '{"n": "7"}',
     "argument_type_mismatch"),
    ('<|open|>argument key="n" type="boolean"<|sep|>1<|close|>argument<|sep|>', '{"n": 1}', "argument_type_mismatch"),
    ('<|open|>argument key="n" type="integer"<|sep|>1<|close|>argument<|sep|>', '{"n": 1}', "unknown_argument_type"),
    ('<|open|>argument key="k" type="string"<|sep|>1<|close|>argument<|sep|>'
     '<|open|>argument key="k" type="string"<|sep|>2<|close|>argument<|sep|>', '{"k": "1", "k": "2"}',
     "duplicate_argument"),
    ('<|open|>argument type="string"<|sep|>v<|close|>argument<|sep|>'
     '<|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|>', '{"a": 1}', "argument_missing_key"),
    ('<|open|>json type="object"<|sep|>raw<|close|>json<|sep|>'
     '<|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>', "raw", "mixed_call_body"),
])
def test_argument_problems(body, arguments, problem):
    m = parse_completion('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>' + body
                         + "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")
    assert m["tool_calls"][0]["function"]["arguments"] == arguments
    assert problem in codes(m)


def test_call_attribute_problems():
    text = ('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call index="1"<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="g" index="7"<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="h" index=3<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
            "<|close|>message<|sep|>")
    m = parse_completion(text)
    assert [(c["id"], c["function"]["name"]) for c in m["tool_calls"]] == [("call_0", "g"), ("call_1", "h")]
    assert codes(m) == ["call_missing_tool", "call_index_mismatch", "bad_attributes"]
    assert parse_tokens(_tokens(text)) == m


def test_call_without_tool_and_argument_without_key_are_dropped():
    """Issue 15 A1: no call named "" and no argument keyed "" reach the client, streamed or not."""
    text = ('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call index="1"<|sep|>'
            '<|open|>argument key="a" type="string"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="f" index="2"<|sep|><|open|>argument type="number"<|sep|>1<|close|>argument<|sep|>'
            '<|open|>argument key="b" type="boolean"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|>'
            '<|open|>call index="3"<|sep|><|open|>json type="object"<|sep|>{}<|close|>json<|sep|><|close|>call<|sep|>'
            "<|close|>tools<|sep|><|close|>message<|sep|>")
    m = parse_completion(text)
    assert m["tool_calls"] == [{"id": "call_0", "type": "function",
                                "function": {"name": "f", "arguments": '{"b": true}'}}]
    assert [(p["code"], p["text"]) for p in m["problems"]] == [
        ("call_missing_tool", '<|open|>call index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>x'),
        ("argument_missing_key", '<|open|>argument type="number"<|sep|>1'),
        ("call_missing_tool", '<|open|>call index="3"<|sep|><|open|>json type="object"<|sep|>{}')]
    for cut in range(len(text) + 1):
        streamed, deltas = stream(text, [cut])
        assert streamed == m
        assert_deltas_match(m, deltas)
    assert parse_tokens(_tokens(text)) == m


# The reviewer's reproduction: a call named "" holding an argument keyed "".
BLANK_CALL = ('<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="" index="1"<|sep|>'
              '<|open|>argument key="" type="string"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|>'
              "<|close|>tools<|sep|><|close|>message<|sep|>")


def test_cli_parse_drops_a_call_with_an_empty_tool_name(monkeypatch, capsys):
    """Follow-up on issue 15 A1: `tool=""` used to reach the client as a call named "" with arguments {"": "x"}."""
    out = json.loads(_parse_cli(monkeypatch, capsys, BLANK_CALL, "--no-thinking"))
    assert (out["content"], out["tool_calls"]) == ("", None)
    assert [(p["code"], p["text"]) for p in out["problems"]] == [
        ("call_missing_tool", '<|open|>call tool="" index="1"<|sep|><|open|>argument key="" type="string"<|sep|>x')]
    lines = _parse_cli(monkeypatch, capsys, BLANK_CALL, "--no-thinking", "--deltas").split("\n")
    assert not any(line.startswith('{"tool_calls"') for line in lines)


@pytest.mark.parametrize("blank", ["", " ", "\t\n "])
def test_blank_tool_names_and_argument_keys_are_dropped(blank):
    """An empty or whitespace-only tool= / key= is treated like a missing one, in every path."""
    text = ('<|close|>think<|sep|><|open|>tools<|sep|>'
            f'<|open|>call tool="{blank}" index="1"<|sep|><|open|>json type="object"<|sep|>{{}}<|close|>json<|sep|>'
            '<|close|>call<|sep|><|open|>call tool="f" index="2"<|sep|>'
            f'<|open|>argument key="{blank}" type="number"<|sep|>1<|close|>argument<|sep|>'
            '<|open|>argument key=" b" type="string"<|sep|>y<|close|>argument<|sep|><|close|>call<|sep|>'
            "<|close|>tools<|sep|><|close|>message<|sep|>")
    m = parse_completion(text)
    # names and keys are not stripped: only a blank one is dropped
    assert m["tool_calls"] == [{"id": "call_0", "type": "function",
                                "function": {"name": "f", "arguments": '{" b": "y"}'}}]
    assert [(p["code"], p["text"]) for p in m["problems"]] == [
        ("call_missing_tool", f'<|open|>call tool="{blank}" index="1"<|sep|><|open|>json type="object"<|sep|>{{}}'),
        ("argument_missing_key", f'<|open|>argument key="{blank}" type="number"<|sep|>1')]
    assert all(repr(blank) in p["detail"] for p in m["problems"])
    for cut in range(len(text) + 1):
        streamed, deltas = stream(text, [cut])
        assert streamed == m, cut
        assert_deltas_match(m, deltas)
        assert all(tc["function"]["name"] == "f" for d in deltas for tc in d.get("tool_calls", []) if "id" in tc)
    assert parse_tokens(_tokens(text)) == m


def _every_split_agrees(text: str, thinking: bool) -> dict:
    m = parse_completion(text, thinking)
    for cut in range(len(text) + 1):
        streamed, deltas = stream(text, [cut], thinking)
        assert streamed == m, cut
        assert_deltas_match(m, deltas)
    streamed, deltas = stream(text, list(range(len(text))), thinking)
    assert streamed == m
    assert_deltas_match(m, deltas)
    return m


def _no_marker_in(message: dict) -> bool:
    texts = [message["reasoning_content"] or "", message["content"] or ""]
    texts += [c["function"]["arguments"] for c in message["tool_calls"] or []]
    return not any(marker in t for t in texts for marker in MARKERS)


TOOLS = '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
END_TOOLS = "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"


@pytest.mark.parametrize("text, field, value, dropped", [
    # the reviewer's case: both <|close|> are dropped and "x<|sep" + "|>y" would read x<|sep|>y
    ("x<|sep<|close|><|close|>|>y", "content", "x<|sepy", ["|>"]),
    ("x<|se<|sep|>p|>y<|close|>response<|sep|><|close|>message<|sep|>", "content", "x<|sey", ["p|>"]),
    # the part after the join may complete a marker more than once
    ("x<|se<|sep|>p|>p|>y", "content", "x<|sey", ["p|>", "p|>"]),
    # text that only continues the marker's beginning is held until the tag is decided, then kept
    ("x<|se<|sep|>p<|sep|>|>y", "content", "x<|sepy", ["|>"]),
    ("x<|se<|sep|>p", "content", "x<|sep", []),
    ("x<|<|close|>X<|sep|>end_of_msg|>y", "content", "x<|y", ["end_of_msg|>"]),
    # content resumed after its channel closed (text outside a channel, appended to content)
    ("x<|o<|close|>response<|sep|>pen|>y<|close|>message<|sep|>", "content", "x<|oy", ["pen|>"]),
    # inside a string argument, a json block and a non-string argument
    ('<|close|>response<|sep|>' + TOOLS + '<|open|>argument key="s" type="string"<|sep|>a<|clo<|sep|>se|>b'
     "<|close|>argument<|sep|>" + END_TOOLS, "arguments", '{"s": "a<|clob"}', ["se|>"]),
    ('<|close|>response<|sep|>' + TOOLS + '<|open|>json type="object"<|sep|>{<|<|sep|>sep|>}<|close|>json<|sep|>'
     + END_TOOLS, "arguments", "{<|}", ["sep|>"]),
    ('<|close|>response<|sep|>' + TOOLS + '<|open|>argument key="n" type="number"<|sep|>"<|s<|sep|>ep|>"'
     "<|close|>argument<|sep|>" + END_TOOLS, "arguments", '{"n": "<|s"}', ["ep|>"]),
])
def test_text_mode_never_joins_text_into_a_marker(text, field, value, dropped):
    """Follow-up on issue 15 A1: dropping protocol text between two pieces of text used to splice them into
    a marker string (`x<|sep` + `|>y`). The part after the join that would complete it is dropped too."""
    m = _every_split_agrees(text, thinking=False)
    got = m["tool_calls"][0]["function"]["arguments"] if field == "arguments" else m[field]
    assert got == value
    assert [p["text"] for p in m["problems"] if p["code"] == "joined_marker"] == dropped
    assert _no_marker_in(m)


# Where a marker split in two can be rejoined: (thinking, text before, text after) for each kind of sink.
_JOIN_PLACES = [
    (True, "r", ""),
    (False, "c", ""),
    (False, "<|close|>response<|sep|>" + TOOLS + '<|open|>argument key="s" type="string"<|sep|>',
     "<|close|>argument<|sep|>" + END_TOOLS),
    (False, "<|close|>response<|sep|>" + TOOLS + '<|open|>argument key="n" type="number"<|sep|>"',
     '"<|close|>argument<|sep|>' + END_TOOLS),
    (False, "<|close|>response<|sep|>" + TOOLS + '<|open|>json type="object"<|sep|>',
     "<|close|>json<|sep|>" + END_TOOLS),
]
# Protocol dropped (or consumed) between the two halves without moving the text elsewhere.
_JOIN_DEBRIS = ["<|sep|>", "<|close|>X<|sep|>", "<|close|><|close|>", "<|open|>foo<|sep|>", "<|close|>think<|sep|>",
                "<|close|>response<|sep|>", "<|open|>bar<|close|>"]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(MARKERS), st.integers(1, 13), st.sampled_from(_JOIN_PLACES),
       st.lists(st.sampled_from(_JOIN_DEBRIS), min_size=1, max_size=3), st.integers(1, 2),
       st.lists(st.integers(0, 300), max_size=5))
def test_a_marker_split_by_debris_never_comes_back_together(marker, k, place, debris, repeats, cuts):
    thinking, before, after = place
    assume(not (thinking and "<|close|>think<|sep|>" in debris))  # a real close there: the text moves to content
    k = min(k, len(marker) - 1)
    text = before + marker[:k] + "".join(debris) + marker[k:] * repeats + "z" + after
    message, deltas = stream(text, [c for c in cuts if c <= len(text)], thinking)
    assert message == parse_completion(text, thinking)
    assert_deltas_match(message, deltas)
    assert _no_marker_in(message)
    assert "joined_marker" in codes(message)


def test_joined_marker_problem_records_where_the_dropped_text_was():
    text = "x<|sep<|close|><|close|>|>y"
    m = parse_completion(text, thinking=False)
    (p,) = [p for p in m["problems"] if p["code"] == "joined_marker"]
    assert text[p["offset"]:].startswith(p["text"]) and p["offset"] == text.index("|>y")
    assert "<|sep|>" in p["detail"]


def test_token_mode_keeps_text_that_spells_a_marker_across_a_dropped_marker():
    """By id, `<|se` and `p|>` are plain text either side of a real (dropped) marker: their join is text the
    model wrote, not protocol, so nothing is dropped."""
    m = parse_tokens(_tokens("x<|sep<|close|><|close|>|>y"), thinking=False)
    assert m["content"] == "x<|sep|>y" and "joined_marker" not in codes(m)


def test_text_after_end_and_feed_after_finish():
    parser = StreamParser(thinking=False)
    parser.feed("a<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>message role=\"user\"")
    parser.finish()
    parser.feed("more")
    m = parser.message()
    assert m["content"] == "a"
    assert [(p["code"], p.get("text")) for p in m["problems"]] == [
        ("text_after_end", '<|open|>message role="user"'), ("feed_after_finish", "more")]
    assert set(codes(m)) <= set(PROBLEM_CODES)


def test_token_mode_only_control_ids_are_structure():
    o, c, s, e = (next(i for i, m in MARKER_IDS.items() if m == want) for want in ("<|open|>", "<|close|>",
                                                                                   "<|sep|>", "<|end_of_msg|>"))
    tokens = [(0, "Quote: "), (0, "<|close|>"), (0, "think"), (0, "<|sep|>"), (c, ""), (0, "think"), (s, ""),
              (o, ""), (0, "response"), (s, ""), (0, "literal <|open|>x<|sep|>"), (c, ""), (0, "response"), (s, ""),
              (c, ""), (0, "message"), (s, ""), (e, "")]
    m = parse_tokens(tokens)
    assert m == {"role": "assistant", "reasoning_content": "Quote: <|close|>think<|sep|>",
                 "content": "literal <|open|>x<|sep|>", "tool_calls": None, "problems": []}


_FRAGMENTS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response", "tools", "message",
              'call tool="f" index="1"', 'argument key="k" type="string"', 'argument key="n" type="number"',
              'json type="object"', "call", "argument", "json", "x", " ", '"', "<|", "|>", "{", "1", "é", "\n",
              'call index="1"', 'argument type="string"', "X", "<|se", "p|>", "<|clo", "se|>", "<|o"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=40), st.lists(st.integers(0, 400), max_size=6),
       st.booleans())
def test_never_raises_and_deltas_are_consistent(fragments, cuts, thinking):
    text = "".join(fragments)
    message, deltas = stream(text, [c for c in cuts if c <= len(text)], thinking)
    assert message == parse_completion(text, thinking)
    assert_deltas_match(message, deltas)
    assert set(codes(message)) <= set(PROBLEM_CODES)
    assert _no_marker_in(message)  # no protocol text, not even spliced together from the pieces around debris
    if "joined_marker" not in codes(message):  # by id, such a splice is text the model wrote (and kept)
        assert message == parse_tokens(_tokens(text), thinking)  # the token-id path parses the same grammar
    if "json" not in text:
        for call in message["tool_calls"] or []:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


# ------------------------------------------------------------------------------------------- round trip

_CHARS = st.sampled_from(list("ab Z09<|>&\"'\\{}[]:,\n\t") + ["é", "中", "😀", "<|", "|>", "&amp;", "&quot;"])


def _safe(s: str) -> bool:
    return not any(m in s for m in MARKERS)


safe_text = st.lists(_CHARS, max_size=12).map("".join).filter(_safe)
# no subnormals: something in the test process runs with flush-to-zero, which hypothesis refuses
finite = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | finite | safe_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(safe_text, inner, max_size=3), max_leaves=8)


def _not_json(s: str) -> bool:
    if not s.strip():
        return False
    try:
        json.loads(s)
    except ValueError:
        return True
    return False


# tool names and argument keys are never blank: the renderer refuses them (the parser would drop them)
name_text = safe_text.filter(str.strip)
arguments = st.one_of(st.dictionaries(name_text, json_value, max_size=4).map(lambda d: ("obj", d)),
                      safe_text.filter(_not_json).map(lambda s: ("raw", s)),
                      st.sampled_from([("obj", {}), ("empty", ""), ("none", None)]))
content = st.one_of(st.none(), safe_text, st.lists(safe_text, max_size=3))
calls = st.lists(st.tuples(name_text, arguments), max_size=3)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(reasoning=st.one_of(st.none(), safe_text), content=content, calls=calls, thinking=st.booleans(),
       effort=st.sampled_from([None, "low", "max"]), with_tools=st.booleans(), cuts=st.lists(st.integers(0, 600)))
def test_render_then_parse_recovers_the_assistant_turn(reasoning, content, calls, thinking, effort, with_tools, cuts):
    tool_calls = []
    for k, (name, (kind, args)) in enumerate(calls):
        wire = json.dumps(args, ensure_ascii=False) if kind == "obj" else args
        tool_calls.append({"id": f"id{k}", "type": "function", "function": {"name": name, "arguments": wire}})
    parts = [{"type": "text", "text": t} for t in content] if isinstance(content, list) else content
    assistant = {"role": "assistant", "reasoning_content": reasoning, "content": parts}
    if tool_calls:
        assistant["tool_calls"] = tool_calls
    base = {"messages": [{"role": "user", "content": "q"}], "thinking": thinking, "thinking_effort": effort}
    if with_tools:
        base["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    prompt = render_text(base)
    full = render_text({**base, "messages": base["messages"] + [assistant], "add_generation_prompt": False})
    assert full.startswith(prompt)
    completion = full[len(prompt):]

    message, deltas = stream(completion, [c for c in cuts if c <= len(completion)], thinking)
    assert message["problems"] == []
    assert_deltas_match(message, deltas)
    expect_reasoning = reasoning if thinking and reasoning and reasoning.strip() else None
    assert message["reasoning_content"] == expect_reasoning
    text = "".join(content) if isinstance(content, list) else (content or "")
    assert (message["content"] or "") == text
    assert len(message["tool_calls"] or []) == len(calls)
    for got, (name, (kind, args)) in zip(message["tool_calls"] or [], calls):
        assert got["function"]["name"] == name
        if kind == "raw":
            assert got["function"]["arguments"] == args
        else:
            assert json.loads(got["function"]["arguments"]) == (args or {})
    # and the parsed message renders back to the same completion
    again = render_text({**base, "messages": base["messages"] + [message], "add_generation_prompt": False})
    assert again == full


# ------------------------------------------------------------------------------------------- CLI


def _parse_cli(monkeypatch, capsys, stdin: str, *argv: str) -> str:
    from openk3.commands import parse

    p = argparse.ArgumentParser()
    parse.add_arguments(p)
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert parse.main(p.parse_args(list(argv))) == 0
    return capsys.readouterr().out


def test_cli_parse(monkeypatch, capsys):
    out = json.loads(_parse_cli(monkeypatch, capsys, COMPLETION + "\n"))
    assert out == parse_completion(COMPLETION)
    out = json.loads(_parse_cli(monkeypatch, capsys, "Hi<|close|>response<|sep|><|close|>message<|sep|>",
                                "--no-thinking"))
    assert (out["reasoning_content"], out["content"], out["tool_calls"], out["problems"]) == (None, "Hi", None, [])


def test_cli_parse_deltas(monkeypatch, capsys):
    lines = _parse_cli(monkeypatch, capsys, COMPLETION, "--deltas", "--chunk", "5").split("\n")
    k = next(i for i, line in enumerate(lines) if line == "{")
    deltas = [json.loads(line) for line in lines[:k]]
    message = json.loads("\n".join(lines[k:]))
    assert message == parse_completion(COMPLETION)
    assert_deltas_match(message, deltas)


def test_token_mode_with_a_real_tokenizer_if_available():
    tk = pytest.importorskip("openk3.tokenizer")
    from openk3.chat import encode_segments, marker_ids_of, render

    try:
        tok = tk.Tokenizer({bytes([b]): b for b in range(256)}, backend="python")
        marker_ids = marker_ids_of(tok)
    except Exception as e:  # the tokenizer is being written concurrently; its construction API may move
        pytest.skip(f"openk3.tokenizer not usable here: {e}")
    assert sorted(marker_ids.values()) == sorted(["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>",
                                                  "<|end_of_msg|>"])
    assistant = {"role": "assistant", "reasoning_content": "r <|close|>think<|sep|>", "content": "<|open|>x",
                 "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a": "<|close|>argument"}'}}]}
    base = {"messages": [{"role": "user", "content": "q"}], "thinking_effort": None}
    prompt_ids = encode_segments(render(base), tok).ids
    full_ids = encode_segments(render({**base, "messages": base["messages"] + [assistant],
                                       "add_generation_prompt": False}), tok).ids
    assert full_ids[:len(prompt_ids)] == prompt_ids
    tokens = [(i, tok.decode([i])) for i in full_ids[len(prompt_ids):]]
    m = parse_tokens(tokens, marker_ids=marker_ids)
    assert (m["reasoning_content"], m["content"], m["problems"]) == ("r <|close|>think<|sep|>", "<|open|>x", [])
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"a": "<|close|>argument"}
