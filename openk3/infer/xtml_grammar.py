"""The grammar of a constrained chat turn in K3's XTML (structured outputs for `LLM.chat` and the server).

A chat completion continues from inside a channel (`<|open|>think<|sep|>` or `<|open|>response<|sep|>`), so
the grammar of a turn covers the rest of the assistant message, token for token what `openk3.chat`'s
parser reads (docs/chat-format.md):

    [think<|sep|><|open|>response<|sep|>]   after the reasoning's <|close|>, when the request thinks
    CONTENT<|close|>response<|sep|>
    [<|open|>tools<|sep|> CALL... <|close|>tools<|sep|>]
    <|close|>message<|sep|>                 then only the stop ids: <|end_of_msg|> ends the request

CONTENT is the response format's JSON (`response_format` json_object / json_schema, or `structured=`), free
text, or nothing (a required or named tool call). A CALL is
`<|open|>call tool="NAME" index="K"<|sep|> ARGS <|close|>call<|sep|>`, K counting from 1 as the parser
checks. ARGS follow the tool's JSON schema in the form the model was trained on, one element per argument,
`<|open|>argument key="KEY" type="T"<|sep|>VALUE<|close|>argument<|sep|>` (strings raw, other values JSON),
the properties in the schema's order, the required ones always, the optional ones or not. A schema that
form cannot express exactly (combinators other than anyOf of plain types, string formats, keys that must
appear but are not in `properties`, objects with no properties) is written as the one JSON block the parser
also reads, `<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>`, under the whole schema.

Which calls are constrained: a named `tool_choice` (one call of that tool), `required` (one or more calls,
one unless parallel tool calls), and with `auto` the tools marked `"strict": true` (their arguments follow
their schema; other tools' arguments are free, and the model may answer in text instead).
"""

from __future__ import annotations

from typing import Any

from openk3.chat.xtml import argument_type, escape_attr
from openk3.infer.structured import (
    Grammars,
    Structured,
    StructuredError,
    assemble,
    fragment,
    grammars_for,
    json_fragment,
    literal,
    llg,
    response_format_fragment,
)

MAX_PARALLEL_CALLS = 16  # the grammar numbers each call's index="K": it spells out this many positions
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
               "readOnly", "writeOnly", "x-guidance"}
_DEFS = ("$defs", "definitions")
_OBJECT_TOP = {"type", "properties", "required", "additionalProperties", *_DEFS}
_STRING_KEYS = {"minLength", "maxLength", "pattern"}
_COMBINATORS = {"allOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef"}
_JSON_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
               "null": "null", "object": "object", "array": "array"}

_FREE = "\n".join([
    'free_arg: <|open|> "argument key=\\"" FREE_KEY "\\" type=\\"" free_value <|close|> "argument" <|sep|>',
    'free_value: "string\\"" <|sep|> FREE_TEXT | "null\\"" <|sep|> "null"',
    *(f'    | "{t}\\"" <|sep|> {json_fragment({"type": t}, "free")}' for t in ("number", "boolean", "object", "array")),
    r'FREE_KEY: /([^"&\s]|&amp;|&quot;)([^"&]|&amp;|&quot;)*/',
    "FREE_TEXT: /(?s:.*)/",
])


class _Rules:
    """Lark rules being written: fresh rule and terminal names."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

    def add(self, body: str, terminal: bool = False) -> str:
        self.n += 1
        name = f"S{self.n}" if terminal else f"r{self.n}"
        self.lines.append(f"{name}: {body}")
        return name


def _element(head: str, value: str, tag: str) -> str:
    return f"<|open|> {literal(head)} <|sep|> {value} <|close|> {literal(tag)} <|sep|>"


# ---- one JSON schema -> XTML argument values -------------------------------------------------------------


def _deref(schema: Any, root: dict, depth: int = 0) -> Any:
    """A schema with a local `$ref` (`#/$defs/X`, `#/definitions/X`) followed; None when it cannot be."""
    if not isinstance(schema, dict) or "$ref" not in schema:
        return schema
    ref = schema["$ref"]
    if depth > 16 or set(schema) - ANNOTATIONS - {"$ref"} or not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return _deref(node, root, depth + 1) if node is not None else None


def _raw_string(schema: dict, rules: _Rules) -> str | None:
    """The terminal of a raw (unquoted) string argument under minLength/maxLength/pattern; None for
    constraints the raw form cannot check (a format, say)."""
    if set(schema) & {"format", "contentEncoding", "contentMediaType"}:
        return None
    parts = []
    if "pattern" in schema:
        if not isinstance(schema["pattern"], str):
            return None
        # JSON Schema patterns search; a whole match is one of the strings that search finds, so it is valid
        parts.append("/" + llg().regex_to_lark(schema["pattern"], "dw") + "/")
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if lo or hi is not None:
        if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)):
            return None
        parts.append(f"/(?s:.{{{lo},{'' if hi is None else hi}}})/")
    return rules.add(" & ".join(parts) or "/(?s:.*)/", terminal=True)


def _is_any(value: Any, types: list) -> bool:
    """Whether a JSON value is of one of the JSON schema types."""
    kind = argument_type(value)
    if kind == "number":
        return "number" in types or "integer" in types and (isinstance(value, int) or float(value).is_integer())
    return kind in types


def _values(schema: Any, root: dict, rules: _Rules) -> dict[str, list[str]] | None:
    """{argument type: [Lark value alternatives]} for the values a property schema admits, or None when the
    XTML argument form cannot express the schema exactly."""
    schema = _deref(schema, root)
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return None
    keys = set(schema) - ANNOTATIONS
    defs = {k: root[k] for k in _DEFS if k in root}
    out: dict[str, list[str]] = {}
    if "enum" in keys or "const" in keys:
        values = schema.get("enum") if "const" not in keys else [schema["const"]]
        if not isinstance(values, list) or keys - {"enum", "const", "type"}:
            return None
        types = schema.get("type", list(_JSON_TYPES))
        for v in (v for v in values if _is_any(v, [types] if isinstance(types, str) else types)):
            out.setdefault(argument_type(v), []).append(
                literal(v) if isinstance(v, str) else json_fragment({"const": v}, "enum"))
        return out
    if "anyOf" in keys:
        if keys != {"anyOf"} or not isinstance(schema["anyOf"], list):
            return None
        for alt in schema["anyOf"]:
            sub = _values(alt, root, rules)
            if sub is None:
                return None
            for t, alts in sub.items():
                out.setdefault(t, []).extend(alts)
        return out
    if keys & _COMBINATORS:
        return None
    types = schema.get("type", list(_JSON_TYPES))
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or any(t not in _JSON_TYPES for t in types):
        return None
    for t in types:
        if t == "string":
            value = _raw_string(schema, rules)
            if value is None:
                return None
        elif t == "null":
            value = '"null"'
        else:
            value = json_fragment({**schema, "type": t, **defs}, "schema")
        out.setdefault(_JSON_TYPES[t], []).append(value)
    return out


def _arguments(params: Any, rules: _Rules) -> str | None:
    """The Lark body of a call's arguments, one element per property; None when the schema needs a block."""
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict) or set(params) - ANNOTATIONS - _OBJECT_TOP:
        return None
    if params.get("type", "object") != "object":
        return None
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list) or not set(required) <= set(props):
        return None
    if not props and params.get("additionalProperties", True) is not False:
        return None  # any object: the model writes it as JSON
    elements = []
    for key, sub in props.items():
        values = _values(sub, params, rules)
        if values is None:
            return None
        head = f'argument key="{escape_attr(key)}" type="'
        alts = [_element(head + f'{t}"', "(" + " | ".join(vals) + ")", "argument") for t, vals in values.items()]
        if not alts:
            return None
        name = rules.add(" | ".join(alts))
        elements.append(name if key in required else f"{name}?")
    return " ".join(elements) or '""'


def _block(params: Any, field: str) -> str:
    return _element('json type="object"', json_fragment(params if params is not None else {}, field), "json")


def _tool_body(grammars: Grammars, params: Any, field: str, rules: _Rules) -> str:
    """A constrained tool's arguments: the argument form if llguidance takes it, else the JSON block; a
    schema llguidance refuses is a ValueError naming `field` with its reason."""
    plain = json_fragment(params if params is not None else {"type": "object"}, field)
    reason = grammars.error(f"start: {plain}")
    if reason:
        raise StructuredError(field, f"the schema was refused by llguidance: {reason}")
    trial = _Rules()
    trial.n = rules.n
    body = _arguments(params, trial)
    if body is not None and not grammars.error("\n".join([f"start: {body}", *trial.lines])):
        rules.lines += trial.lines
        rules.n = trial.n
        return body
    return _block(params, field)


# ---- a chat turn ------------------------------------------------------------------------------------------


def _choice(tool_choice: Any, tools: list) -> tuple[str, str | None]:
    """(mode, named tool): mode is none / auto / required."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str) and tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise StructuredError("tool_choice", "'required' needs tools")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise StructuredError("tool_choice", "must be auto, none, required or {\"type\": \"function\", \"function\": "
                              f"{{\"name\": ...}}}}, got {tool_choice!r:.200}")
    if not any(t["function"]["name"] == name for t in tools):
        raise StructuredError("tool_choice", f"names the function {name!r}, which is not in tools")
    return "required", name


def _content(response_format: Any, structured: Any) -> tuple[str, list[dict], str] | None:
    """The constrained content (Lark body, side grammars, field), or None for free content."""
    if structured is not None:
        return (*fragment(structured, "structured"), "structured")
    found = response_format_fragment(response_format)
    return (found[0], [], found[1]) if found is not None else None


def _calls(grammars: Grammars, tools: list, named: str | None, constrain_all: bool, most: int, rules: _Rules) -> str:
    """Rules for 1..most calls of the tools (or of `named`); returns the rule of the whole tools element."""
    bodies = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if named is not None and fn["name"] != named:
            continue
        if constrain_all or fn.get("strict") is True:
            body = _tool_body(grammars, fn.get("parameters"), f"tools[{i}].function.parameters", rules)
        else:
            body = "free_arg*"
        bodies.append((escape_attr(fn["name"]), rules.add(body)))
    nxt = None
    for k in range(most, 0, -1):
        alts = " | ".join(literal(f'call tool="{name}" index="{k}"') + f" <|sep|> {body}" for name, body in bodies)
        call = rules.add(f"<|open|> ({alts}) <|close|> \"call\" <|sep|>")
        nxt = rules.add(f"{call} {nxt}?" if nxt else call)
    return rules.add(f"<|open|> \"tools\" <|sep|> {nxt} <|close|> \"tools\" <|sep|>")


def chat_constraint(tok, *, thinking: bool, tools: list | None = None, tool_choice: Any = None,
                    response_format: Any = None, structured: Any = None, parallel: bool = True) -> Structured | None:
    """The `Structured` of a chat turn for tokenizer `tok`, or None when nothing in the request constrains it
    (then llguidance is not even loaded). Raises `StructuredError` naming the field
    (`response_format.json_schema.schema`, `tools[i].function.parameters`, `tool_choice`, `structured`) and,
    for a refused schema, llguidance's reason."""
    tools = list(tools or [])
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise StructuredError(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ...}}')
    mode, named = _choice(tool_choice, tools)
    content = _content(response_format, structured)
    strict = any(t["function"].get("strict") is True for t in tools)
    if mode == "none" and content is None or mode == "auto" and content is None and not strict:
        return None
    grammars = grammars_for(tok)
    side: list[dict] = []
    if content is not None:
        body, side, field = content
        reason = grammars.error(assemble(f"start: {body}", side))
        if reason:
            raise StructuredError(field, f"the grammar was refused by llguidance: {reason}")
    rules = _Rules()
    end = '<|close|> "response" <|sep|>'
    if mode == "none":
        turn = f"{body} {end}"
    else:
        most = 1 if named is not None or not parallel else MAX_PARALLEL_CALLS
        block = _calls(grammars, tools, named, mode == "required", most, rules)
        if mode == "required":
            turn = f"{end} {block}"
        elif content is not None:
            turn = f"({body} {end} | {end} {block})"
        else:
            turn = f"FREE_TEXT {end} {block}?"
    head = '"think" <|sep|> <|open|> "response" <|sep|> ' if thinking else ""
    lark = "\n".join([f"start: {head}{turn} <|close|> \"message\" <|sep|>", *rules.lines, _FREE])
    s = Structured(assemble(lark, side), after_think=thinking, field=content[2] if content else "tools")
    grammars.check(s)
    return s
