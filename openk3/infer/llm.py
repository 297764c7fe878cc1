"""`openk3.LLM`: a checkpoint (or a model + tokenizer) -> text generation and XTML chat, offline.

    llm = openk3.LLM("runs/nano")                  # a checkpoint folder, or a training run folder
    out = llm.generate("Once upon a time", max_tokens=32, temperature=0)[0]
    print(out.text, out.finish_reason)

    messages = [{"role": "user", "content": "Hi!"}]
    r = llm.chat(messages, effort="low", max_tokens=512)
    messages.append(r.message)                     # reasoning kept: the renderer puts it back in the history
    messages.append({"role": "user", "content": "And then?"})
    r = llm.chat(messages, effort="low", max_tokens=512)

Generation runs on `openk3.infer.engine.Engine` (continuous batching); chat renders the request with
`openk3.chat.render` + `encode_segments` and parses the completion token by token with
`openk3.chat.StreamParser` (markers recognised by their control ids only). Nothing here touches the
network: weights and tokenizer come from local folders.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from openk3.checkpoint import resolve_checkpoint
from openk3.common import resolve_device, resolve_dtype
from openk3.infer.engine import Engine, RequestOutput
from openk3.infer.sample import SamplingParams
from openk3.infer.structured import Structured

__all__ = ["LLM", "ChatResult", "resolve_checkpoint", "resolve_dtype"]

Prompt = str | Sequence[int]
log = logging.getLogger(__name__)  # `openk3 generate/chat` print the `openk3` logger's notes on stderr


def stored_dtype(folder: Path) -> torch.dtype | None:
    """The on-disk dtype of a checkpoint's token embedding -- the trunk dtype `openk3.load` keeps when given
    no dtype -- from the safetensors header alone. None when it cannot be read (the load then says why)."""
    from openk3.checkpoint import files
    from openk3.checkpoint.layout import PREFIX, TORCH_DTYPES

    embed = "model.embed_tokens.weight"
    try:
        wm = files.weight_map(folder)
        name = next((n for n in (PREFIX + embed, embed) if n in wm), None)
        if name is None:
            return None
        with files.open_shard(folder / wm[name]) as h:
            return TORCH_DTYPES.get(h.get_slice(name).get_dtype())
    except ValueError:
        return None


def compute_dtype(asked: torch.dtype | None, stored: torch.dtype | None,
                  device: torch.device) -> tuple[torch.dtype | None, str]:
    """The dtype to load a checkpoint in (None: as stored) and a line saying why.

    An asked dtype always wins. Otherwise ("auto"): on CPU a bf16/fp16 checkpoint computes in float32,
    because decode in bf16 measured 1.5-2x slower than in float32 on the project's CPU (issue 15; small,
    batch 1: 13-16 against 24-26 tokens/s; the CPU MoE kernels are float32/float64 only; fp16 is slower
    still), at twice the memory of the float weights; MXFP4 experts kept packed (keep_packed) stay
    packed. On a GPU the stored dtype is kept (bf16 is its fast path)."""
    def name(d: torch.dtype | None) -> str:
        return "an unread dtype" if d is None else str(d).removeprefix("torch.")

    if asked is not None:
        return asked, f"compute dtype {name(asked)}, as asked (the checkpoint stores {name(stored)})"
    if device.type == "cpu" and stored in (torch.bfloat16, torch.float16):
        keep = "bf16" if stored == torch.bfloat16 else "fp16"
        return torch.float32, (f"compute dtype float32 on CPU, where it decodes 1.5-2x faster than the stored "
                               f"{name(stored)}; dtype='{keep}' (--dtype {keep}) keeps {name(stored)}, at half the "
                               f"memory")
    return None, f"compute dtype {name(stored)} on {device.type}, as stored"


def _load_tokenizer(folder: str | os.PathLike, what: str):
    from openk3.tokenizer import Tokenizer

    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"{folder}: no such tokenizer folder")
    if not (folder / "tiktoken.model").is_file():
        raise ValueError(f"{folder}: no tokenizer here (tiktoken.model is missing); "
                         f"{what}pass a tokenizer folder (tokenizer=DIR, CLI --tokenizer DIR)")
    try:
        return Tokenizer.from_dir(str(folder))
    except (OSError, KeyError) as e:
        raise ValueError(f"{folder}: cannot load the tokenizer ({e})") from None


@dataclasses.dataclass
class ChatResult:
    """One assistant turn.

    message: the OpenAI-style assistant message -- `role`, `content` (None when empty and there are
        tool calls), `reasoning_content` (None when there was no reasoning), and `tool_calls` (only when
        the model called tools: `[{"id", "type": "function", "function": {"name", "arguments"}}]`, the
        arguments a JSON object string). Append it to the messages to continue the conversation.
    token_ids: the generated ids (including the stop id, e.g. `<|end_of_msg|>`, when one ended it).
    finish_reason: the engine's: "stop", "length" or "abort".
    problems: what the parser found off-grammar (`openk3.chat.PROBLEM_CODES`); empty for clean output.
    prompt_token_ids: the rendered prompt.
    text: the completion decoded with its markers (what `openk3 parse` reads).
    """

    message: dict
    token_ids: list[int]
    finish_reason: str | None
    problems: list[dict]
    prompt_token_ids: list[int]
    text: str

    @property
    def content(self) -> str | None:
        return self.message.get("content")

    @property
    def reasoning_content(self) -> str | None:
        return self.message.get("reasoning_content")

    @property
    def tool_calls(self) -> list[dict]:
        return self.message.get("tool_calls") or []


class LLM:
    """A model + tokenizer + generation engine.

    Args:
        path_or_model: a checkpoint folder (or its config.json), a training run folder (its latest
            complete checkpoint is used), or an in-memory `K3ForCausalLM`.
        tokenizer: an `openk3.tokenizer.Tokenizer` or a tokenizer folder. Default: the checkpoint
            folder's own tokenizer files (required for a path). With an in-memory model and no
            tokenizer, prompts must be token ids and outputs have ids only (no chat).
        dtype: the compute dtype: a torch dtype or a name ("bf16"/"bfloat16", "fp32"/"float32", ...;
            `openk3.common.resolve_dtype`) casts (fp32 islands stay fp32; an in-memory model is cast in
            place). None or "auto": for a path, float32 on CPU when the checkpoint stores bf16/fp16 (CPU
            decode in bf16 is 1.5-2x slower), as stored on a GPU (`compute_dtype`); an in-memory model
            is left as it is. For a path the choice and its reason are logged (INFO, `openk3` logger).
        device: where the weights go ("cpu", "cuda", "cuda:N"; a ValueError when this machine has no such
            device); None = "cpu" for a path, and leaves an in-memory model where it is.
        max_num_seqs, max_model_len, prefill_chunk, compile: the engine's (see `Engine`; `compile=True`
            compiles the decode step at the first generation: slower start, much faster tokens).
        keep_packed: a checkpoint's MXFP4 experts stay packed in memory (4.25 bits/weight, as the release
            ships them) and decode through the MXFP4 CPU kernel (float32 trunk; other dtypes dequantise each
            touched expert); no effect on float experts.
        experts, expert_cache, io_threads, direct_io: `experts="stream"` leaves a checkpoint's MXFP4 routed
            experts on disk and reads them into a per-layer cache of `expert_cache` bytes as layers need them
            (`openk3.load`; CPU, uncompiled; tokens equal `keep_packed=True`'s bit for bit). Counters:
            `openk3.stream.stats(llm.model)`.
        trunk, trunk_group: "bf16" (as loaded), "int8" or "int4" (groups of `trunk_group` inputs): the trunk's linears
            as weight-only integers, quantised while loading (`openk3.load`; CPU; `openk3.quant.trunk`). A
            checkpoint path only.
    """

    def __init__(self, path_or_model: Any, tokenizer: Any = None, *, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, max_num_seqs: int = 16, max_model_len: int | None = None,
                 prefill_chunk: int = 512, compile: bool = False, keep_packed: bool = False,
                 prefix_cache: int = 0, experts: str = "memory", expert_cache: int | str | None = None,
                 io_threads: int = 4, direct_io: bool | None = None, trunk: str = "bf16",
                 trunk_group: int = 32) -> None:
        dtype = resolve_dtype(dtype)
        device = resolve_device(device) if device is not None else None
        self.path: Path | None = None
        if isinstance(path_or_model, torch.nn.Module):
            if keep_packed:
                raise ValueError("keep_packed applies to a checkpoint path; pack an in-memory model's experts with "
                                 "openk3.model.packed_experts.pack_model_experts_(model)")
            if experts != "memory":
                raise ValueError("experts='stream' applies to a checkpoint path (the experts are read from its files)")
            if trunk != "bf16":
                raise ValueError("trunk applies to a checkpoint path; quantise an in-memory model with "
                                 "openk3.quant.trunk.quantize_trunk_(model, fmt)")
            model = path_or_model
            if dtype is not None:
                model = model.cast(dtype) if hasattr(model, "cast") else model.to(dtype)
            if device is not None:
                model = model.to(device)
        elif isinstance(path_or_model, (str, os.PathLike)):
            self.path = resolve_checkpoint(path_or_model)
            if tokenizer is None:  # check the tokenizer before the (slower) weights
                tokenizer = _load_tokenizer(self.path, "this checkpoint has no tokenizer files; ")
            from openk3.checkpoint import load

            device = device or torch.device("cpu")
            dtype, why = compute_dtype(dtype, stored_dtype(self.path), device)
            log.info("%s: %s", self.path, why)
            if (experts == "stream" or trunk != "bf16") and compile:
                raise ValueError("experts='stream' and an integer trunk decode uncompiled: drop compile=True "
                                 "(--compile)")
            load_kw = {} if experts == "memory" else {"experts": experts, "expert_cache": expert_cache,
                                                      "io_threads": io_threads, "direct_io": direct_io}
            if trunk != "bf16":
                load_kw.update(trunk=trunk, trunk_group=trunk_group)
            model = load(self.path, dtype=dtype, device=device, keep_packed=keep_packed, **load_kw)
        else:
            raise TypeError(f"LLM needs a checkpoint path or a K3ForCausalLM, got {type(path_or_model).__name__}")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _load_tokenizer(tokenizer, "")
        vocab = model.config.vocab_size
        if tokenizer is not None and tokenizer.vocab_size != vocab:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is {vocab}; "
                             "they must match")
        self.model = model
        self.tokenizer = tokenizer
        self.engine = Engine(model, tokenizer, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             prefill_chunk=prefill_chunk, compile=compile, prefix_cache=prefix_cache)

    @property
    def config(self):
        return self.model.config

    def __repr__(self) -> str:
        where = str(self.path) if self.path is not None else "in-memory model"
        return f"LLM({where}, vocab {self.config.vocab_size}, {self.config.num_hidden_layers} layers)"

    # ---- prompts and params ----------------------------------------------------------------------

    @staticmethod
    def _batch(prompts: Any) -> list[Prompt]:
        """A str or one list of ids -> one prompt; a list of str / lists of ids -> a batch."""
        if hasattr(prompts, "tolist") and not isinstance(prompts, str):  # a tensor or array of ids
            prompts = prompts.tolist()
        if isinstance(prompts, str):
            return [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a str, a list of token ids, or a list of those; "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [prompts]
        out: list[Prompt] = []
        for k, p in enumerate(prompts):
            if hasattr(p, "tolist") and not isinstance(p, str):
                p = p.tolist()
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
                out.append(list(p))
            else:
                raise TypeError(f"prompts[{k}] must be a str or a list of token ids, got {type(p).__name__}")
        return out

    @staticmethod
    def _params(params: SamplingParams | Sequence[SamplingParams] | None, n: int,
                overrides: dict) -> list[SamplingParams]:
        if isinstance(overrides.get("stop"), str):
            overrides = {**overrides, "stop": (overrides["stop"],)}
        if overrides.get("structured") is not None:
            overrides = {**overrides, "structured": Structured.of(overrides["structured"])}
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}; "
                            f"SamplingParams has {', '.join(sorted(fields))}")
        if params is None or isinstance(params, SamplingParams):
            base = params if params is not None else SamplingParams()
            one = dataclasses.replace(base, **overrides) if overrides else base
            return [one] * n
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"{n} prompts but {len(plist)} SamplingParams")
        return [dataclasses.replace(p, **overrides) if overrides else p for p in plist]

    def _check(self, batch: list[Prompt], plist: Sequence[SamplingParams] = ()) -> list[list[int]]:
        """Encode every prompt and check its length (and every grammar) before anything is queued."""
        ids = [self.engine.encode(p) for p in batch]
        for k, row in enumerate(ids):
            if len(row) >= self.engine.max_model_len:
                raise ValueError(f"prompt {k} has {len(row)} tokens; max_model_len is {self.engine.max_model_len}")
        for s in {p.structured for p in plist if p.structured is not None}:
            self.engine.grammars().check(s)
        return ids

    # ---- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = False, stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                 skip_special_tokens: bool = True, **sampling: Any) -> list[RequestOutput]:
        """Generate for one prompt or a batch; always returns a list of `RequestOutput`, in prompt order.

        prompts: a str or one list of token ids (a single prompt: the result is a one-element list), or
            a list of str / lists of token ids (a batch). An empty list is an empty batch.
        params: one `SamplingParams` for all, a list (one per prompt), or None (the defaults).
        **sampling: SamplingParams fields applied on top, e.g. `max_tokens=16, temperature=0, seed=1,
            stop="\\n"` (a str stop is one stop string), `structured={"json": schema}` (the output follows the
            grammar: `openk3.infer.structured`; also {"json_object": True}, {"regex": ...}, {"choice": [...]},
            {"grammar": lark}; a grammar llguidance refuses is a ValueError with its reason).
        stop_token_ids / ignore_eos / skip_special_tokens: as `Engine.add_request` (the tokenizer's stop
            ids, `<|end_of_msg|>` and `[EOS]`, apply unless ignore_eos).

        The prompts are decoded together (continuous batching); each request's tokens depend only on its
        prompt, params and seed. An exception or Ctrl-C aborts the requests still running.
        """
        batch = self._batch(prompts)
        plist = self._params(params, len(batch), sampling)
        ids = self._check(batch, plist)
        rids: list[str] = []
        finals: dict[str, RequestOutput] = {}
        bar = None
        try:
            for row, sp in zip(ids, plist, strict=True):
                rids.append(self.engine.add_request(row, sp, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                                                    skip_special_tokens=skip_special_tokens))
            wanted = set(rids)
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=len(rids), desc="generate", unit="req")
            while len(finals) < len(rids) and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in rids:
                if rid not in finals:
                    self.engine.abort(rid)
        return [finals[r] for r in rids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
               stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
               skip_special_tokens: bool = True, **sampling: Any) -> Iterator[RequestOutput]:
        """Yield one prompt's `RequestOutput`s as tokens arrive (`delta_text`, `delta_token_ids`); the last
        has `finished=True`. Closing the iterator early (or leaving a `with contextlib.closing(...)`)
        aborts the request."""
        batch = self._batch(prompt)
        if len(batch) != 1:
            raise ValueError(f"stream takes one prompt, got {len(batch)}")
        (sp,) = self._params(params, 1, sampling)
        (ids,) = self._check(batch, [sp])
        return self.engine.stream(ids, sp, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                                  skip_special_tokens=skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                    thinking: bool | None = None, effort: str | None = "max", tool_choice: Any = None,
                    response_format: Any = None) -> tuple[list[int], bool]:
        """The request's prompt ids (rendered with `openk3.chat.render`, each segment encoded on its own)
        and whether the completion starts in the think channel."""
        from openk3.chat import encode_segments, render, resolve_thinking

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of {'role', 'content'} dicts")
        request: dict[str, Any] = {"messages": list(messages), "thinking_effort": effort}
        if tools:
            request["tools"] = list(tools)
        if thinking is not None:
            request["thinking"] = bool(thinking)
        if tool_choice is not None:
            request["tool_choice"] = tool_choice
        if response_format is not None:
            request["response_format"] = response_format
        on, _ = resolve_thinking(request)
        return encode_segments(render(request), self.tokenizer).ids, on

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None, *,
             tools: Sequence[dict] | None = None, thinking: bool | None = None, effort: str | None = "max",
             tool_choice: Any = None, response_format: Any = None, structured: Any = None,
             parallel_tool_calls: bool = True, on_delta: Callable[[dict], None] | None = None,
             **sampling: Any) -> ChatResult:
        """One assistant turn for an OpenAI-style conversation, in K3's XTML format.

        messages: [{"role": "system"|"user"|"assistant"|"tool", "content": ..., ...}] (not modified);
            assistant messages from earlier `chat` results go back in as they are (`reasoning_content`
            and `tool_calls` included); a tool result is {"role": "tool", "tool_call_id": ID, "content": ...}.
        tools: OpenAI tools list ({"type": "function", "function": {"name", "description", "parameters"}}).
        thinking: None/True = think first (K3's default), False = answer directly.
        effort: "low", "high" or "max" (the default, as K3's HF template); None omits the effort message;
            "none" turns thinking off. "medium" is rejected (see docs/chat-format.md).
        tool_choice: "auto" (the default with tools), "none", "required" (one or more calls; one unless
            parallel_tool_calls), or {"type": "function", "function": {"name": N}} (exactly one call of N); the
            last two are decoded under a grammar, and so are the calls of tools marked `"strict": true`.
        response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}:
            the content is decoded under the schema's grammar (the renderer also tells the model).
        structured: a content grammar as in `generate` ({"json": schema}, {"regex": ...}, ...).
            With thinking on, every grammar applies after the reasoning (`openk3.infer.xtml_grammar`).
        params / **sampling: as in `generate` (SamplingParams defaults: temperature 1, max_tokens 256).
        on_delta: called while generating with {"reasoning_content": text}, {"content": text}, and, once
            the turn is done, {"tool_call": {"id", "type", "function": {"name", "arguments"}}} per call.

        Generation stops at `<|end_of_msg|>` (or `[EOS]`, max_tokens, the context limit). Tool call ids are
        `call_<k>`, k counted over the whole conversation, so they are unique within it.
        """
        from openk3.chat import StreamParser, marker_ids_of
        from openk3.infer.xtml_grammar import chat_constraint

        # a named tool choice is rendered as "required" (the release's renderer has no text for a name)
        shown = "required" if isinstance(tool_choice, dict) else tool_choice
        prompt_ids, thinking_on = self.chat_prompt(messages, tools=tools, thinking=thinking, effort=effort,
                                                   tool_choice=shown, response_format=response_format)
        (sp,) = self._params(params, 1, sampling)
        if tools or tool_choice is not None or response_format is not None or structured is not None:
            constraint = chat_constraint(self.tokenizer, thinking=thinking_on, tools=tools,
                                         tool_choice=tool_choice, response_format=response_format,
                                         structured=structured, parallel=parallel_tool_calls)
            sp = dataclasses.replace(sp, structured=constraint)
        if len(prompt_ids) >= self.engine.max_model_len:
            raise ValueError(f"the conversation has {len(prompt_ids)} tokens; max_model_len is "
                             f"{self.engine.max_model_len}")
        earlier = sum(len(m.get("tool_calls") or []) for m in messages
                      if isinstance(m, dict) and m.get("role") == "assistant")
        tok = self.tokenizer
        markers = marker_ids_of(tok)
        parser = StreamParser(thinking_on, call_id=lambda n, name: f"call_{earlier + n}", marker_ids=markers)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def deliver(deltas: list[dict]) -> None:
            if on_delta is None:
                return
            for d in deltas:
                if "tool_calls" not in d:  # calls are delivered whole at the end
                    on_delta(d)

        def feed(tid: int) -> None:
            if tid in markers:
                rest = decoder.decode(b"", final=True)  # bytes of a character cut by the marker
                decoder.reset()
                if rest:
                    deliver(parser.feed_token(-1, rest))
                deliver(parser.feed_token(tid, ""))
            elif tok.is_special(tid):
                return  # other control tokens ([BOS], reserved ids) carry no text
            else:
                deliver(parser.feed_token(tid, decoder.decode(tok.decode_bytes([tid]))))

        last: RequestOutput | None = None
        with contextlib.closing(self.engine.stream(prompt_ids, sp)) as outputs:
            for out in outputs:
                last = out
                for tid in out.delta_token_ids:
                    feed(tid)
        rest = decoder.decode(b"", final=True)
        if rest:
            deliver(parser.feed_token(-1, rest))
        deliver(parser.finish())
        message = parser.message()
        problems = message.pop("problems")
        if message["tool_calls"] is None:
            del message["tool_calls"]
        elif on_delta is not None:
            for call in message["tool_calls"]:
                on_delta({"tool_call": call})
        token_ids = list(last.token_ids) if last is not None else []
        return ChatResult(message=message, token_ids=token_ids,
                          finish_reason=last.finish_reason if last is not None else None, problems=problems,
                          prompt_token_ids=prompt_ids, text=tok.decode(token_ids))
