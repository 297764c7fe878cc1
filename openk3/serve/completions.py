"""`POST /v1/completions`: raw prompts (no chat template), for evaluation and RL.

`prompt` is a string, a list of token ids, or a list of either (a batch); each prompt gets `n` choices,
numbered prompt-major (choice `i * n + j` is prompt i's j-th). Stop strings and stop token ids are the
engine's (applied to the decoded text; the stop string itself is not returned). `echo` puts the prompt's
text before its completion. `response_format` json_object / json_schema (vLLM's extension of this
endpoint) decodes the text under the schema's grammar (`openk3/serve/grammar.py`).
"""

from __future__ import annotations

import time
from dataclasses import replace

from openk3.serve import grammar, protocol
from openk3.serve.errors import bad_request
from openk3.serve.outputs import KEEPALIVE, Collector, EngineFailed, completion_logprobs, error_frame, new_id, sse

FIELDS = protocol.SAMPLING_FIELDS + ("logprobs", "prompt", "echo", "suffix", "best_of", "response_format")


def _prompts(body: dict, state) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt:
        batch = prompt
    else:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of those",
                          param="prompt")
    out = []
    for k, p in enumerate(batch):
        if isinstance(p, str) and p:
            out.append(state.tok.encode(p))
        elif isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool)
                                               and 0 <= i < state.vocab_size for i in p):
            out.append(list(p))
        else:
            raise bad_request(f"prompt[{k}] must be a non-empty string or a list of token ids in "
                              f"0..{state.vocab_size - 1}", param="prompt")
    return out


def prepare(state, body: dict) -> dict:
    protocol.check_fields(body, FIELDS)
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported (no fill-in-the-middle)", param="suffix", code="unsupported_field")
    common = protocol.common(body, state.vocab_size, default_max_tokens=state.default_max_tokens)
    if body.get("best_of") not in (None, common.n):
        raise bad_request(f"best_of must equal n ({common.n}) when given, got {body['best_of']!r}", param="best_of")
    logprobs = protocol.completion_logprobs(body)
    echo = protocol.boolean(body, "echo", False)
    if echo and logprobs is not None:
        # The legacy API then scores the prompt tokens too: prompt log probabilities are not implemented.
        raise bad_request("echo with logprobs (log probabilities of the prompt tokens) is not supported",
                          param="echo", code="unsupported_field")
    common.params = replace(common.params, logprobs=logprobs, logprobs_mode=state.logprobs_mode,
                            structured=grammar.completion(state, body))
    prompts = _prompts(body, state)
    protocol.check_capacity(len(prompts) * common.n, state.loop.capacity, "prompt" if len(prompts) > 1 else "n")
    params = [common.capped(len(p), state.max_model_len, "prompt") for p in prompts]
    requests = [(p, sp) for p, base in zip(prompts, params, strict=True)
                for sp in protocol.choice_params(base, common.n)]
    return {"common": common, "prompts": prompts, "requests": requests,
            "echo": [state.tok.decode(p) if echo else "" for p in prompts]}


def _start(state, job: dict) -> Collector:
    common = job["common"]
    return Collector(state.loop, job["requests"], stop_token_ids=common.stop_token_ids, ignore_eos=common.ignore_eos)


def _logprobs(state, token_ids: list[int], entries: list | None, offset: int) -> dict | None:
    """The choice's `logprobs` object, or None when the request did not ask (the engine kept no entries).
    Every generated token is listed, a stop token included (as its name): joined, `tokens` can run past
    `text`, which a stop string or stop token ends."""
    return None if entries is None else completion_logprobs(state.tok, token_ids, entries, offset)


def _usage(job: dict, completion_tokens: int) -> dict:
    return protocol.usage(sum(len(p) for p in job["prompts"]), completion_tokens)


async def complete(state, job: dict, model: str) -> dict:
    collector = _start(state, job)
    n = job["common"].n
    finals = {}
    try:
        async for k, out in collector.outputs():
            failed = grammar.failure(out, job["common"].params.structured)
            if failed is not None:
                raise failed
            if out.finished:
                finals[k] = out
    except EngineFailed as e:
        raise e.api_error() from None
    finally:
        collector.close()
    choices = [{"index": k, "text": job["echo"][k // n] + finals[k].text,
                "logprobs": _logprobs(state, finals[k].token_ids, finals[k].logprobs, 0),
                "finish_reason": finals[k].finish_reason} for k in range(len(job["requests"]))]
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage(job, sum(len(o.token_ids) for o in finals.values()))}


async def stream(state, job: dict, model: str):
    collector = _start(state, job)
    n = job["common"].n
    head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model}

    # Per choice: tokens not yet sent with a chunk (text held back by a stop string comes later, and its tokens
    # with it) and the text offset of the next token.
    pending: list[tuple[list[int], list]] = [([], []) for _ in job["requests"]]
    offsets = [0] * len(job["requests"])

    def chunk(k: int, text: str, finish: str | None = None) -> str:
        ids, entries = pending[k]
        logprobs = _logprobs(state, ids, entries, offsets[k]) if ids else None
        if logprobs is not None:
            offsets[k] += sum(len(t) for t in logprobs["tokens"])
            pending[k] = ([], [])
        return sse({**head, "choices": [{"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish}]})

    async def body():
        generated = 0
        try:
            for k in range(len(job["requests"])):
                if job["echo"][k // n]:
                    yield chunk(k, job["echo"][k // n])
            try:
                async for k, out in collector.outputs(state.sse_keepalive_s):
                    if out is None:
                        yield KEEPALIVE
                        continue
                    failed = grammar.failure(out, job["common"].params.structured)
                    if failed is not None:
                        yield grammar.error_event(failed)
                        break
                    generated += len(out.delta_token_ids)
                    if out.delta_logprobs is not None:
                        pending[k][0].extend(out.delta_token_ids)
                        pending[k][1].extend(out.delta_logprobs)
                    if out.delta_text or out.finished:
                        yield chunk(k, out.delta_text, out.finish_reason if out.finished else None)
            except EngineFailed as e:
                yield error_frame(e)
            else:
                if job["common"].include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(job, generated)})
            yield sse("[DONE]")
        finally:  # also on a client disconnect: free the slots now
            collector.close()

    return body()
