"""Request bodies of the OpenAI API -> checked values and `SamplingParams`.

Bodies are read as plain JSON objects and checked field by field here, so that every mistake is a 400 in
the error envelope naming the field and the value (`errors.APIError`). Fields are in three sets: those
honoured; those the API defines that this server does not implement yet (`NOT_YET`: refused by name when
set to anything but their "off" value, never dropped silently); and keys it does not know, which are
ignored and logged, as vLLM does: clients and agent frameworks send fields of newer API versions
(`store`, `metadata`, `service_tier`, ...) that must not make a request fail.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from openk3.infer.sample import MIN_REPETITION_PENALTY, SamplingParams
from openk3.serve.errors import bad_request

#: Fields both endpoints read; `common()` turns them into SamplingParams. `logprobs` differs by endpoint
#: (chat: a flag and `top_logprobs`; completions: an int), so each endpoint lists and reads its own.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "max_tokens", "n",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids", "ignore_eos",
                   "logit_bias", "stream", "stream_options", "model", "user")
#: Fields named in the API that this server does not implement yet: a 400 naming them when set to
#: anything but their "off" value.
NOT_YET = {"logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0)}
MAX_N = 8
#: The most top log probabilities a token may ask for (chat `top_logprobs`, completions `logprobs`): OpenAI's
#: chat bound; the legacy completions API says 5, vLLM allows 20 there too.
MAX_LOGPROBS = 20
log = logging.getLogger(__name__)
MAX_STOP = 4


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_fields(body: dict, allowed: tuple[str, ...]) -> list[str]:
    """Refuse a NOT_YET field that is switched on; return (and log) the keys this server does not know."""
    unknown = sorted(set(body) - set(allowed) - set(NOT_YET))
    if unknown:
        log.info("ignored request field(s) this server does not know: %s", ", ".join(unknown))
    for name, off in NOT_YET.items():
        if body.get(name) not in off:
            raise bad_request(f"{name} is not supported yet (got {body[name]!r})", param=name,
                              code="unsupported_field")
    return unknown


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise bad_request(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}", param=name)
    return float(value)


def integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", param=name)
    if value < lo or (hi is not None and value > hi):
        rule = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"{name} must be {rule}, got {value!r}", param=name)
    return value


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", param=name)
    return value


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad_request(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got {stop!r}",
                          param="stop")
    return tuple(stops)


def token_ids(body: dict, name: str, vocab_size: int) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
                                              for i in value):
        raise bad_request(f"{name} must be a list of token ids in 0..{vocab_size - 1}", param=name)
    return value


def chat_logprobs(body: dict) -> int | None:
    """Chat: `logprobs: true` asks for the sampled tokens' log probabilities, `top_logprobs` (0..20) for that
    many alternatives each; a non-zero `top_logprobs` without `logprobs: true` is a 400, as in OpenAI's API."""
    on = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not on:
        raise bad_request(f"top_logprobs ({top}) needs logprobs: true", param="top_logprobs")
    return (top or 0) if on else None


def completion_logprobs(body: dict) -> int | None:
    """Completions: `logprobs: k` (0..20) asks for k alternatives per token; null is off."""
    return integer(body, "logprobs", None, 0, MAX_LOGPROBS)


@dataclass
class Common:
    """What both endpoints share: the choices per prompt, the token cap, sampling, stream options."""

    n: int
    max_tokens: int | None  # None: up to the context limit
    params: SamplingParams  # with max_tokens left at its default; `capped` sets it per prompt
    stream: bool
    include_usage: bool
    stop_token_ids: list[int]
    ignore_eos: bool

    def capped(self, prompt_len: int, max_model_len: int, param: str) -> SamplingParams:
        """The params for a prompt of `prompt_len` tokens; a prompt that leaves no room is a 400."""
        room = max_model_len - prompt_len
        if room < 1 or (self.max_tokens is not None and self.max_tokens > room):
            asked = "" if self.max_tokens is None else f" + {self.max_tokens} completion tokens"
            raise bad_request(f"this model's context length is {max_model_len} tokens, but the request needs "
                              f"{prompt_len} prompt tokens{asked}; shorten the {param} or lower max_tokens",
                              param=param, code="context_length_exceeded")
        from dataclasses import replace

        return replace(self.params, max_tokens=self.max_tokens or room)


def common(body: dict, vocab_size: int, *, max_tokens_names: tuple[str, ...] = ("max_tokens",)) -> Common:
    """The shared fields of a request (already checked against the allowed set)."""
    max_tokens = None
    for name in max_tokens_names:  # the first one set wins (max_completion_tokens before max_tokens)
        max_tokens = integer(body, name, None, 1)
        if max_tokens is not None:
            break
    top_k = integer(body, "top_k", 0, -1)
    seed = integer(body, "seed", None, -(2 ** 63), 2 ** 63 - 1)
    params = SamplingParams(  # (a temperature below MIN_TEMPERATURE samples greedily: SamplingParams)
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),  # -1 is vLLM's "off", as 0 is ours
        min_p=_number(body, "min_p", 0.0, 0.0, 0.999999),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, 10.0),
        seed=None if seed is None else seed % 2 ** 63,  # torch seeds are unsigned
        stop=stop_strings(body),
    )
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise bad_request(f"stream_options must be an object with include_usage only, got {options!r}",
                          param="stream_options")
    include_usage = boolean(options or {}, "include_usage", False)
    if include_usage and not stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    return Common(n=integer(body, "n", 1, 1, MAX_N), max_tokens=max_tokens, params=params, stream=stream,
                  include_usage=include_usage, stop_token_ids=token_ids(body, "stop_token_ids", vocab_size),
                  ignore_eos=boolean(body, "ignore_eos", False))


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: with a seed, choice k uses seed + k, so n > 1 choices differ but a
    request is still reproducible."""
    if params.seed is None or n == 1:
        return [params] * n
    from dataclasses import replace

    return [replace(params, seed=(params.seed + k) % 2 ** 63) for k in range(n)]


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out
