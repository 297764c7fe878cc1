"""Reasoning effort: OpenAI's `reasoning_effort` values -> K3's thinking efforts, and the server's default.

K3 was trained at three efforts, low, high and max (spec §11); clients send OpenAI's scale. Each value maps
to the K3 level at or above it, so that no request thinks less than it asked for:

    minimal -> low    low -> low    medium -> high    high -> high    xhigh -> max    max -> max
    none -> thinking off             null -> thinking off

`null` is thinking off, as `none` is: clients that let the user switch thinking off send it (Moonshot's
kimi-cli maps its "off" to `reasoning_effort: null`). The same values are read from `thinking_effort` and
from `reasoning: {"effort": ...}` (OpenRouter's object); the fields must agree after mapping. A request
that names no effort gets the server's default (`--default-effort`; none given: K3's own default, max).
`chat_template_kwargs` is the chat template's own: its `thinking_effort` goes to the renderer unmapped
(low/high/max; null there omits the effort message, as in the release's template).

The effort actually used is answered in the `openk3-reasoning-effort` header: low, high or max, `none`
(thinking off), or `unspecified` (thinking on without an effort message: chat_template_kwargs said null).
"""

from __future__ import annotations

from typing import Any

from openk3.chat import DEFAULT_THINKING_EFFORT, resolve_thinking
from openk3.serve.errors import bad_request

OFF = "none"
#: OpenAI's values (and K3's own) -> the K3 effort rendered; OFF turns thinking off.
LEVELS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max",
          "none": OFF}
HEADER = "openk3-reasoning-effort"
_SWITCHES = ("thinking", "enable_thinking")


def level(value: Any, param: str) -> str:
    """The K3 effort (low/high/max, or OFF) for one field's value; anything unknown is a 400 naming `param`."""
    if value is None:
        return OFF
    if isinstance(value, str) and value.strip().lower() in LEVELS:
        return LEVELS[value.strip().lower()]
    raise bad_request(f"{param} must be one of {', '.join(LEVELS)} or null (K3 thinks at low, high or max: "
                      f"docs/serving.md maps the others), got {value!r}", param=param)


def default_level(value: str | None) -> str | None:
    """A server's default effort (`create_app(default_effort=...)`): a value of LEVELS, mapped; None keeps K3's."""
    if value is None:
        return None
    if not (isinstance(value, str) and value.strip().lower() in LEVELS):
        raise ValueError(f"default_effort must be one of {', '.join(LEVELS)} or None, got {value!r}")
    return LEVELS[value.strip().lower()]


def requested(body: dict) -> tuple[str, str] | None:
    """(field, K3 effort) of the effort the request names at its top level, or None when it names none."""
    named = [(name, body[name]) for name in ("reasoning_effort", "thinking_effort") if name in body]
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad_request(f"reasoning must be an object such as {{\"effort\": \"high\"}}, got {reasoning!r}",
                          param="reasoning")
    if reasoning and "effort" in reasoning:
        named.append(("reasoning.effort", reasoning["effort"]))
    levels = [(name, level(value, name)) for name, value in named]
    for name, lv in levels[1:]:
        if lv != levels[0][1]:
            raise bad_request(f"conflicting efforts: {levels[0][0]} means {levels[0][1]} but {name} means {lv}",
                              param=name)
    return levels[0] if levels else None


def render_keys(body: dict, default: str | None) -> dict:
    """The thinking keys of the request the renderer gets: the switches and template kwargs as sent, and the
    effort mapped (or the server's default, when the request names none)."""
    keys = {k: body[k] for k in (*_SWITCHES, "chat_template_kwargs") if body.get(k) is not None}
    kwargs = keys.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request(f"chat_template_kwargs must be an object, got {kwargs!r}", param="chat_template_kwargs")
    asked = requested(body)
    if asked is not None:
        keys["thinking_effort"] = asked[1]
    elif default is not None and not any(k in (kwargs or {}) for k in ("thinking_effort", "reasoning_effort")):
        switched = any(k in keys or k in (kwargs or {}) for k in _SWITCHES)
        # A default of "none" is thinking off unless the request switches thinking on: then K3's own effort.
        keys["thinking_effort"] = DEFAULT_THINKING_EFFORT if default == OFF and switched else default
    try:
        resolve_thinking(keys)
    except ValueError as e:  # a switch that is not a boolean, efforts that disagree with a switch or the kwargs
        where = asked[0] if asked else next((k for k in ("chat_template_kwargs", *_SWITCHES) if k in keys), None)
        raise bad_request(str(e), param=where) from None
    return keys


def used(keys: dict) -> str:
    """What the `openk3-reasoning-effort` header reports for these render keys."""
    thinking, effort = resolve_thinking(keys)
    return effort or "unspecified" if thinking else OFF
