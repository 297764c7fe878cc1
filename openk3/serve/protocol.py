"""Request bodies of the OpenAI API -> checked values and `SamplingParams`.

Bodies are read as plain JSON objects and checked field by field here, so that every mistake is a 400 in
the error envelope naming the field and the value (`errors.APIError`). Fields are in three sets: those
honoured; those the API defines that this server does not implement yet (`NOT_YET`: refused by name when
set to anything but their "off" value, never dropped silently); and keys it does not know, which are
ignored and logged, as vLLM does: clients and agent frameworks send fields of newer API versions
(`store`, `metadata`, `service_tier`, ...) that must not make a request fail.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from openk3.infer.sample import MIN_REPETITION_PENALTY, SamplingParams
from openk3.serve.errors import APIError, bad_request

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


#: The default cap on a request body (`create_app(max_body_bytes=...)`, `--max-body-mb`): 32 MiB holds a prompt of a
#: million tokens several times over (about 4 bytes a token as text, 7 as a JSON list of ids), and parsing that
#: much JSON takes at most about a second (measured: 31 MiB of text 0.13 s, 33 MiB of token ids 0.7-1.0 s), a
#: second in which the parser holds the interpreter lock and every other request waits.
MAX_BODY_BYTES = 32 * 2 ** 20
#: The deepest JSON a body may nest (a tool's `parameters` or a `response_format` schema included): real
#: schemas nest a few levels (OpenAI's strict mode allows 10), while the renderer's recursion broke near 490.
MAX_JSON_DEPTH = 100


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, or a 413 once it passes `max_bytes` (at once when Content-Length says so), or a 408
    when it has not all arrived within `timeout_s`. Both answers close the connection (the rest of the body
    is not read). A client that goes away mid-body raises starlette's ClientDisconnect."""
    length = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body is larger than this server's limit of {max_bytes} bytes "
                            "(openk3 serve --max-body-mb)", code="request_too_large")
    if length.isdigit() and int(length) > max_bytes:
        raise too_big

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (openk3 serve --body-timeout)",
                       code="request_timeout") from None


_CONTAINERS = {dict, list}


def _deeper_than(value, limit: int) -> str | None:
    """The top-level key (or "") under which `value` nests deeper than `limit`, else None. Iterative: a
    recursive walk is what such a body breaks."""
    stack = [(value, 1, "")] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth, top = stack.pop()
        if depth > limit:
            return top
        if not _CONTAINERS & set(map(type, node.values() if isinstance(node, dict) else node)):
            continue  # leaves only (a prompt of a million token ids): no Python-level loop over them
        children = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((child, depth + 1, top if depth > 1 else str(key)) for key, child in children
                     if isinstance(child, (dict, list)))
    return None


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        body = None  # nested deeper than the parser's stack: refused below, like any body past MAX_JSON_DEPTH
        too_deep = ""
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    else:
        too_deep = _deeper_than(body, MAX_JSON_DEPTH)
    if too_deep is not None:
        raise bad_request(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels"
                          + (f" (in {too_deep})" if too_deep else ""), param=too_deep or None, code="json_too_deep")
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
    max_tokens: int | None  # None: the server's default cap (`default_max_tokens`), else up to the context limit
    params: SamplingParams  # with max_tokens left at its default; `capped` sets it per prompt
    stream: bool
    include_usage: bool
    stop_token_ids: list[int]
    ignore_eos: bool
    default_max_tokens: int | None = None

    def capped(self, prompt_len: int, max_model_len: int, param: str) -> SamplingParams:
        """The params for a prompt of `prompt_len` tokens; a prompt that leaves no room is a 400. Without a
        max_tokens of its own the request gets the server's default cap, or what room the context leaves."""
        room = max_model_len - prompt_len
        if room < 1 or (self.max_tokens is not None and self.max_tokens > room):
            asked = "" if self.max_tokens is None else f" + {self.max_tokens} completion tokens"
            raise bad_request(f"this model's context length is {max_model_len} tokens, but the request needs "
                              f"{prompt_len} prompt tokens{asked}; shorten the {param} or lower max_tokens",
                              param=param, code="context_length_exceeded")
        from dataclasses import replace

        return replace(self.params, max_tokens=self.max_tokens or min(self.default_max_tokens or room, room))


def common(body: dict, vocab_size: int, *, max_tokens_names: tuple[str, ...] = ("max_tokens",),
           default_max_tokens: int | None = None) -> Common:
    """The shared fields of a request (already checked against the allowed set); `default_max_tokens` caps a
    request that sets no max_tokens (`openk3 serve --default-max-tokens`)."""
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
    if options is not None and not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {options!r}", param="stream_options")
    if set(options or {}) - {"include_usage"}:  # include_obfuscation (OpenAI), continuous_usage_stats (vLLM), ...
        log.info("ignored stream_options field(s): %s", ", ".join(sorted(set(options) - {"include_usage"})))
    include_usage = boolean(options or {}, "include_usage", False)
    if include_usage and not stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    return Common(n=integer(body, "n", 1, 1, MAX_N), max_tokens=max_tokens, params=params, stream=stream,
                  include_usage=include_usage, stop_token_ids=token_ids(body, "stop_token_ids", vocab_size),
                  ignore_eos=boolean(body, "ignore_eos", False), default_max_tokens=default_max_tokens)


def check_capacity(count: int, capacity: int, param: str) -> None:
    """A request of `count` engine requests (prompts x n) that could never be admitted, even by an idle server,
    is a 400 naming the limit: a 429 would tell clients to retry what cannot succeed."""
    if count > capacity:
        raise bad_request(f"this request needs {count} engine requests (prompts x n), more than this server ever "
                          f"holds at once ({capacity}: --max-num-seqs + --max-queue); split it into smaller requests",
                          param=param, code="request_too_large")


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
