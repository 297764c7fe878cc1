"""Structured outputs in the server: `response_format`, `tool_choice` and strict tools -> the request's grammar.

Chat: `response_format` json_object / json_schema (strict or not), a named or `required` `tool_choice` and
tools marked `"strict": true` are decoded under the grammar of the turn in XTML
(`openk3.infer.xtml_grammar.chat_constraint`). Completions: `response_format` json_object / json_schema
constrains the raw text. The grammar travels to the engine in `SamplingParams.structured`.

A schema or grammar llguidance refuses is a 400 naming the field (`response_format.json_schema.schema`,
`tools[i].function.parameters`, `tool_choice`) with llguidance's reason. A grammar that cannot go on during
generation (a limit llguidance meets mid-way) ends that choice with the engine's finish reason "error": the
answer is a 400 `structured_output_failed` naming the same field (an error event once a stream has begun).
"""

from __future__ import annotations

from typing import Any

from openk3.infer.engine import RequestOutput
from openk3.infer.structured import Structured, StructuredError, grammars_for, response_format_fragment
from openk3.infer.xtml_grammar import chat_constraint
from openk3.serve.errors import APIError, bad_request
from openk3.serve.outputs import sse


def shown_tool_choice(tool_choice: Any) -> Any:
    """What the prompt says: a named choice is rendered as "required" (K3's renderer has no text for a name;
    the grammar makes it that one function)."""
    return "required" if isinstance(tool_choice, dict) else tool_choice


def chat(state, body: dict, thinking: bool, parallel: bool) -> Structured | None:
    """The grammar of a chat request's turn, or None when nothing constrains it."""
    try:
        return chat_constraint(state.tok, thinking=thinking, tools=body.get("tools"),
                               tool_choice=body.get("tool_choice"), response_format=body.get("response_format"),
                               parallel=parallel)
    except StructuredError as e:
        raise bad_request(str(e), param=e.field) from None


def completion(state, body: dict) -> Structured | None:
    """The grammar of a completions request's raw text (`response_format`), or None."""
    try:
        found = response_format_fragment(body.get("response_format"))
        if found is None:
            return None
        s = Structured(f"start: {found[0]}", field=found[1])
        grammars_for(state.tok).check(s)
    except StructuredError as e:
        raise bad_request(str(e), param=e.field) from None
    return s


def failure(out: RequestOutput, constraint: Structured | None) -> APIError | None:
    """The error of a choice whose grammar could not go on (engine finish reason "error"), else None."""
    if out.finish_reason != "error":
        return None
    field = constraint.field if constraint is not None else None
    return APIError(400, f"{field}: decoding under its grammar could not go on: {out.stop_reason}", param=field,
                    code="structured_output_failed")


def error_event(error: APIError) -> str:
    """The SSE error event of a failure after the stream began (the openai SDK raises APIError on it)."""
    return sse({"error": error.body()["error"]})
