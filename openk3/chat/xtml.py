"""Render an OpenAI-style chat request in K3's XTML chat format (spec §7.2-7.3).

K3 has no Jinja template: the release renders prompts in Python as a list of *segments*, and every
segment is tokenised on its own (no BPE merge crosses a segment boundary). Structural segments are
the four markers `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>` (plus resolved image prompts)
and are encoded with special tokens allowed; everything else -- tag names, attribute keys, the `="`
and `"` around attribute values, message bodies -- is ordinary text encoded with special-token
recognition off, so a user who types `<|open|>` gets ordinary BPE ids, never a control id.

    render(request)            -> list[Segment(text, structural, train)]
    render_text(segments)      -> the prompt as one string
    encode_segments(segs, tok) -> Encoded(ids, mask), each segment encoded separately

`train` is the supervised-fine-tuning loss mask: true for every segment of a historical assistant
message from its first channel tag (`<|open|>think` / `<|open|>response`) through the closing
`<|close|>message<|sep|><|end_of_msg|>`; false for its `<|open|>message role="assistant"<|sep|>`
header and for everything else (system, user, tool, internal messages, the generation prompt).

Behaviour follows the release's own renderer (`encoding_k3.py`) byte for byte wherever it is
defined; where it is silent or merely crashes, this module raises `ValueError` with a clear message
instead. See docs/chat-format.md for the format, the decisions and their sources.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple

from openk3.fsutil import check_depth

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

#: What the release's renderer accepts. Its own prompt text also names `medium`, but it rejects
#: `medium` (an assert); the policies were trained at low/high/max only (spec §11, landscape §0).
THINKING_EFFORTS = ("low", "high", "max")
#: The HF tokenizer's apply_chat_template does `kwargs.setdefault("thinking_effort", "max")`.
DEFAULT_THINKING_EFFORT = "max"
ROLES = ("system", "user", "assistant", "tool")
#: Roles OpenAI clients send that K3 has no tag for, and the role they render as. OpenAI's `developer`
#: is its newer name for the system prompt; rendering it as `system` is what the model was trained on.
ROLE_ALIASES = {"developer": "system"}

_THINKING_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
_TOOL_DECLARE_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
_DYNAMIC_TOOL_DECLARE_BODY = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
    "```json\n{tools}\n```"
)
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
_JSON_OBJECT_BODY = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
_JSON_SCHEMA_BODY = (
    "The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON
    + "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"
)


class Segment(NamedTuple):
    """One separately tokenised run of prompt text.

    structural: encode with special tokens allowed (only the four XTML markers and image prompts).
    train: part of the assistant's own output in a training example (the loss mask).
    """

    text: str
    structural: bool = False
    train: bool = False


class Encoded(NamedTuple):
    ids: list[int]
    mask: list[bool]  # per token: Segment.train of the segment the token came from


# --------------------------------------------------------------------------------------------------
# small pieces


def compact_json(value: Any) -> str:
    """The JSON the renderer inlines into prompts: no spaces, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sort_keys_deep(value: Any) -> Any:
    """Every dict's keys sorted, at every depth (lists keep their order)."""
    if isinstance(value, dict):
        return {k: sort_keys_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


def escape_attr(value: Any) -> str:
    """Attribute-value escaping: `&` and `"` only (in that order)."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def argument_type(value: Any) -> str:
    """The `type=` of a tool-call argument."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def argument_text(value: Any) -> str:
    """An argument's body: strings raw, anything else JSON with the default `, ` / `: ` separators."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class _Out:
    """Segment builder; drops empty texts exactly as the release does."""

    def __init__(self, image_prompts: list[str] | None):
        self.segments: list[Segment] = []
        self.train = False
        self.image_prompts = image_prompts
        self.images_used = 0

    def add(self, text: Any, structural: bool = False) -> None:
        text = str(text)
        if text:
            self.segments.append(Segment(text, structural, self.train))

    def marker(self, marker: str) -> None:
        self.add(marker, structural=True)

    def open_tag(self, tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
        self.marker(OPEN)
        self.add(tag)
        for key, value in attrs:  # four segments per attribute: ' key', '="', value, '"'
            self.add(f" {key}")
            self.add('="')
            self.add(escape_attr(value))
            self.add('"')
        self.marker(SEP)

    def close_tag(self, tag: str) -> None:
        self.marker(CLOSE)
        self.add(tag)
        self.marker(SEP)

    def end_message(self) -> None:
        self.close_tag("message")
        self.marker(END_OF_MSG)

    def image(self) -> None:
        if self.image_prompts is None:
            self.marker(IMAGE_PLACEHOLDER)
            return
        if self.images_used >= len(self.image_prompts):
            raise ValueError("more images in the messages than entries in image_prompts")
        self.marker(self.image_prompts[self.images_used])
        self.images_used += 1

    def text(self, text: Any) -> None:
        """Caller text, always plain: only image *parts* become images. A user who types the image
        placeholder must not conjure an image slot (nor shift which image prompt goes where)."""
        self.add(str(text))

    def content(self, content: Any, where: str) -> None:
        if content is None:
            return
        if isinstance(content, str):
            self.text(content)
            return
        if not isinstance(content, list):
            raise ValueError(f"{where}: content must be a string, null or a list of parts, "
                             f"not {type(content).__name__}")
        for j, part in enumerate(content):
            if isinstance(part, str):
                self.text(part)
            elif isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                self.image()
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                self.text(part["text"])
            else:
                raise ValueError(f"{where}: content part {j} has no text (and is not an image part)")

    def internal_system(self, kind: str, body: str) -> None:
        self.open_tag("message", [("role", "system"), ("type", kind)])
        self.add(body.strip())
        self.end_message()


# --------------------------------------------------------------------------------------------------
# request options


_UNSET = object()


def _pick(request: dict, names: tuple[str, ...], what: str) -> Any:
    """One option that may be spelled several ways, top level or in chat_template_kwargs.

    Returns _UNSET when absent everywhere; raises when two spellings disagree.
    """
    kwargs = request.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    found: list[tuple[str, Any]] = []
    for source in (request, kwargs):
        for name in names:
            if name in source:
                found.append((name, source[name]))
    if not found:
        return _UNSET
    first = found[0][1]
    for name, value in found[1:]:
        if value != first:
            raise ValueError(f"conflicting {what}: {found[0][0]}={first!r} but {name}={value!r}")
    return first


def _as_thinking(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, dict) and value.get("type") in ("enabled", "disabled"):  # Anthropic-style object
        return value["type"] == "enabled"
    raise ValueError(f"thinking must be true or false, not {value!r}")


def resolve_thinking(request: dict) -> tuple[bool, str | None]:
    """(thinking, effort) of a request: `effort` is None when no thinking-effort message is rendered.

    thinking: `thinking` / `enable_thinking` (top level or in chat_template_kwargs); default on.
    effort: `thinking_effort` / `reasoning_effort` / `reasoning: {effort}`; absent -> "max" (the HF
    default); explicit null -> no thinking-effort message; "none" -> thinking off. Only low/high/max
    are accepted while thinking is on -- "medium" is rejected like the release's renderer does. With
    thinking off the effort is ignored (nothing is rendered for it), as in the release.
    """
    raw_thinking = _pick(request, ("thinking", "enable_thinking"), "thinking switches")
    effort = _pick(request, ("thinking_effort", "reasoning_effort"), "thinking efforts")
    reasoning = request.get("reasoning")
    if isinstance(reasoning, dict) and "effort" in reasoning:
        if effort is not _UNSET and reasoning["effort"] != effort:
            raise ValueError(f"conflicting thinking efforts: {effort!r} and reasoning.effort={reasoning['effort']!r}")
        effort = reasoning["effort"]
    thinking = True if raw_thinking is _UNSET else _as_thinking(raw_thinking)
    if isinstance(effort, str):
        effort = effort.strip().lower()
        if effort == "none":
            if raw_thinking is not _UNSET and thinking:
                raise ValueError("thinking is on but the effort is 'none'")
            return False, None
    if not thinking:
        return False, None
    if effort is _UNSET:
        return True, DEFAULT_THINKING_EFFORT
    if effort is None:
        return True, None
    if effort not in THINKING_EFFORTS:
        hint = (" K3's own renderer rejects 'medium' (its prompt text names it, but the model was trained at "
                "low/high/max); pick 'high' or 'low'." if effort == "medium" else "")
        raise ValueError(f"unsupported thinking effort {effort!r}; supported: low, high, max "
                         f"(or null to omit the effort message, 'none' to turn thinking off).{hint}")
    return True, effort


def response_schema(request: dict) -> Any:
    """The schema a `json_schema` response_format asks for (as the release extracts it)."""
    explicit = _pick(request, ("response_schema",), "response schemas")
    if explicit is not _UNSET and explicit is not None:
        return explicit
    rf = request.get("response_format")
    json_schema = rf.get("json_schema") if isinstance(rf, dict) else None
    if isinstance(json_schema, dict):
        return json_schema.get("schema", json_schema.get("json_schema", json_schema))
    return json_schema


# --------------------------------------------------------------------------------------------------
# messages


def parse_arguments(arguments: Any, where: str = "tool call") -> tuple[dict | None, str | None]:
    """A call's arguments as (mapping, None) or, for a string that is not JSON, (None, raw text)."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            parsed = json.loads(arguments)
            check_depth(parsed)  # too deep to render as arguments (their values are dumped again)
        except (json.JSONDecodeError, RecursionError, ValueError):  # kept as the raw string, as the model wrote it
            return None, arguments
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: arguments must be a JSON object, got {type(parsed).__name__}")
        return parsed, None
    raise ValueError(f"{where}: arguments must be a JSON object string or an object")


def _function(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: a tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or fn.get("name") is None:
        raise ValueError(f"{where}: a tool call needs function.name")
    if not isinstance(fn["name"], str):
        raise ValueError(f"{where}.function.name must be a string, got {fn['name']!r:.40}")
    return fn


def _check_shape(request: dict) -> None:
    """ValueError naming the field (`messages[1].tool_calls`, `tools`) where the request's shape is not what
    rendering walks: messages objects with a known role, tool_calls a list of calls with a string
    function.name, tools a list, and nothing nested deeper than `fsutil.MAX_JSON_DEPTH` (a 600-level tool
    schema parses, then overflows the recursion of sorting its keys and dumping it)."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        raise ValueError("the request needs a 'messages' list")
    if not isinstance(request.get("tools") or [], list):
        raise ValueError(f"tools must be a list of tool schemas, got {type(request['tools']).__name__}")
    for k, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{k}] must be an object")
        role = msg.get("role")
        if not (isinstance(role, str) and (role in ROLES or role in ROLE_ALIASES)):
            raise ValueError(f"messages[{k}]: unsupported role {msg.get('role')!r} (K3 knows {', '.join(ROLES)}; "
                             f"{', '.join(f'{a} renders as {r}' for a, r in ROLE_ALIASES.items())})")
        calls = msg.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"messages[{k}].tool_calls must be a list of tool calls, got {type(calls).__name__}")
        for i, call in enumerate(calls or []):
            _function(call, f"messages[{k}].tool_calls[{i}]")
        if not isinstance(msg.get("tools") or [], list):
            raise ValueError(f"messages[{k}].tools must be a list of tool schemas, got {type(msg['tools']).__name__}")
    check_depth(request)


def order_tool_results(messages: list) -> list:
    """Re-sort each run of consecutive tool messages into the calling assistant's `tool_calls` order.

    A run is matched by `tool_call_id` (or `id`) against the `id`s of the most recent assistant
    message's tool calls; if every message of the run matches, the run is sorted by call position
    (stable) and each message's `tool` (and `name`, if present) becomes the matched call's function
    name. A run with any unmatched message is left as it came. Inputs are not mutated.
    """
    out: list = []
    positions: dict[str, tuple[int, Any]] = {}
    i = 0
    while i < len(messages):
        msg = messages[i]
        if not isinstance(msg, dict) or msg.get("role") != "tool":
            if isinstance(msg, dict) and msg.get("role") == "assistant":
                positions = {}
                for pos, call in enumerate(msg.get("tool_calls") or [], start=1):
                    if isinstance(call, dict) and call.get("id") is not None and str(call["id"]) not in positions:
                        fn = call.get("function")
                        name = fn.get("name") if isinstance(fn, dict) else call.get("name")
                        positions[str(call["id"])] = (pos, name)
            out.append(msg)
            i += 1
            continue
        run = []
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            run.append(messages[i])
            i += 1
        matches = []
        for msg in run:
            call_id = msg.get("tool_call_id", msg.get("id"))
            matches.append(positions.get(str(call_id)) if call_id is not None else None)
        if any(m is None for m in matches):
            out.extend(run)
            continue
        order = sorted(range(len(run)), key=lambda k: (matches[k][0], k))
        for k in order:
            msg, name = run[k], matches[k][1]
            if name is not None:
                msg = dict(msg, tool=name)
                if "name" in msg:
                    msg["name"] = name
            out.append(msg)
    return out


def _render_assistant(out: _Out, msg: dict, thinking: bool, where: str) -> None:
    attrs = [("role", "assistant")]
    if msg.get("name"):
        attrs.append(("name", msg["name"]))
    out.open_tag("message", attrs)
    out.train = True
    if thinking:
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        out.open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            out.text(reasoning)
        out.close_tag("think")
    out.open_tag("response")
    out.content(msg.get("content"), where)
    out.close_tag("response")
    calls = msg.get("tool_calls")
    if calls:  # a list of calls (`_check_shape`)
        out.open_tag("tools")
        for index, call in enumerate(calls, start=1):
            cwhere = f"{where}.tool_calls[{index - 1}]"
            fn = _function(call, cwhere)
            args, raw = parse_arguments(fn.get("arguments"), cwhere)
            # The parser drops a call whose tool name is blank and an argument whose key is blank (nothing
            # can dispatch them), so a history holding one would teach / prompt what is never returned.
            if not str(fn["name"]).strip():
                raise ValueError(f"{cwhere}: function.name {fn['name']!r} is blank; a tool call needs a tool name")
            blank = next((key for key in args or {} if not str(key).strip()), None)
            if blank is not None:
                raise ValueError(f"{cwhere}: function.arguments has the key {blank!r}; every argument needs a "
                                 "non-blank name")
            out.open_tag("call", [("tool", fn["name"]), ("index", index)])
            if raw is not None:
                out.open_tag("json", [("type", "object")])
                out.text(raw)
                out.close_tag("json")
            else:
                for key, value in args.items():
                    out.open_tag("argument", [("key", key), ("type", argument_type(value))])
                    out.text(argument_text(value))
                    out.close_tag("argument")
            out.close_tag("call")
        out.close_tag("tools")
    out.end_message()
    out.train = False


def render(request: dict) -> list[Segment]:
    """Render an OpenAI-style chat request into ordered segments.

    Keys read: messages (required), tools, thinking / enable_thinking, thinking_effort /
    reasoning_effort / reasoning.effort, tool_choice, response_format, response_schema,
    add_generation_prompt (default true), image_prompts; the options may also sit in
    chat_template_kwargs. Raises ValueError for requests that cannot be rendered.
    """
    if not isinstance(request, dict):
        raise ValueError("the request must be a JSON object")
    _check_shape(request)
    messages = request["messages"]
    thinking, effort = resolve_thinking(request)
    add_generation_prompt = _pick(request, ("add_generation_prompt",), "add_generation_prompt values")
    add_generation_prompt = True if add_generation_prompt is _UNSET else bool(add_generation_prompt)
    tools = request.get("tools")
    image_prompts = request.get("image_prompts")
    if image_prompts is not None and not (isinstance(image_prompts, list)
                                          and all(isinstance(p, str) for p in image_prompts)):
        raise ValueError("image_prompts must be a list of strings")
    out = _Out(image_prompts)

    if tools:
        out.open_tag("message", [("role", "system"), ("type", "tool-declare")])
        out.add(_TOOL_DECLARE_BODY.format(tools=compact_json(sort_keys_deep(tools))))
        out.end_message()
    if effort is not None:
        out.internal_system("thinking-effort", _THINKING_EFFORT_BODY.format(effort=effort))

    last_calls: list | None = None
    tool_index = 0
    for k, msg in enumerate(order_tool_results(messages)):
        role, where = ROLE_ALIASES.get(msg["role"], msg["role"]), f"messages[{k}]"
        if role in ("user", "system"):
            if role == "system" and msg.get("tools"):  # dynamic (lazy-loaded) tools; content is not rendered
                out.open_tag("message", [("role", "system"), ("type", "tool-declare")])
                out.add(_DYNAMIC_TOOL_DECLARE_BODY.format(tools=compact_json(sort_keys_deep(msg["tools"]))))
                out.end_message()
                continue
            attrs = [("role", role)]
            if msg.get("name"):
                attrs.append(("name", msg["name"]))
            out.open_tag("message", attrs)
            out.content(msg.get("content"), where)
            out.end_message()
        elif role == "assistant":
            last_calls = msg.get("tool_calls")
            tool_index = 0
            _render_assistant(out, msg, thinking, where)
        else:  # tool
            tool_index += 1
            name = msg.get("tool", msg.get("name"))
            if name is None and last_calls and tool_index <= len(last_calls):
                name = _function(last_calls[tool_index - 1], where).get("name")
            if name is None:
                raise ValueError(f"{where}: a tool message needs a tool name: give `name`, a `tool_call_id` that "
                                 "matches the assistant's call, or send results in call order")
            out.open_tag("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
            out.content(msg.get("content"), where)
            out.end_message()

    tool_choice = request.get("tool_choice")
    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE_BODY:
        out.internal_system("tool-choice", _TOOL_CHOICE_BODY[tool_choice])
    rf = request.get("response_format")
    rf_type = rf.get("type", rf) if isinstance(rf, dict) else rf
    if rf_type == "json_object":
        out.internal_system("response-format", _JSON_OBJECT_BODY)
    elif rf_type == "json_schema":
        out.internal_system("response-format",
                            _JSON_SCHEMA_BODY.format(schema=compact_json(sort_keys_deep(response_schema(request)))))

    if add_generation_prompt:
        out.open_tag("message", [("role", "assistant")])
        out.open_tag("think" if thinking else "response")
    if image_prompts is not None and out.images_used != len(image_prompts):
        raise ValueError(f"{len(image_prompts)} image_prompts given but {out.images_used} images in the messages")
    return out.segments


def generation_prompt(thinking: bool = True) -> str:
    """The text a prompt ends with; the model's completion continues from inside this channel."""
    return f'{OPEN}message role="assistant"{SEP}{OPEN}{"think" if thinking else "response"}{SEP}'


def render_text(segments: Iterable[Segment] | dict) -> str:
    """The prompt as one string (accepts segments or a request)."""
    if isinstance(segments, dict):
        segments = render(segments)
    return "".join(s.text for s in segments)


def encode_segments(segments: Iterable[Segment], tok: Any) -> Encoded:
    """Token ids and per-token loss mask; each segment is encoded on its own.

    `tok.encode(text, allow_special=...)`: structural segments with special tokens allowed, all
    other text with them disabled (so caller text can never produce a control id).
    """
    ids: list[int] = []
    mask: list[bool] = []
    for seg in segments:
        piece = list(tok.encode(seg.text, allow_special=seg.structural))
        ids.extend(piece)
        mask.extend([seg.train] * len(piece))
    return Encoded(ids, mask)
