"""The generation engine: continuous batching over a `SlotCache` (spec §8).

Each `step()`:
1. applies pending aborts (their slots are freed at once);
2. prefills waiting requests first-come first-served while a slot is free, at most `prefill_chunk`
   prompt tokens per step (a long prompt is prefilled over several steps, so running requests keep
   decoding: chunked prefill); a request whose prompt is done samples its first token and takes a slot;
3. decodes one token for every running request in one batched forward (rows of different lengths);
   a request with a grammar (`SamplingParams.structured`, openk3/infer/structured.py) has the tokens its
   grammar cannot take next masked to -inf before sampling (rows without one are sampled as they are);
4. checks stops (stop token ids, stop strings, max_tokens, max_model_len, a completed or failed
   grammar), calls the callbacks, and frees finished slots, keeping the running requests in slots 0..n-1
   (compaction).

Requests join and leave between steps. The engine is single-threaded; `abort` may be called from any
thread (or from a callback) and takes effect at the next step boundary.

Legend: n running requests, V vocabulary.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from openk3.infer.detok import TextStream
from openk3.infer.graph import DecodeGraph
from openk3.infer.prefix import PrefixCache
from openk3.infer.sample import SamplingParams, make_generator, sample_next, sampling_logits, token_logprobs
from openk3.infer.structured import Constraint, Grammars, grammars_for
from openk3.model.cache import DenseCache, SlotCache


@dataclass
class RequestOutput:
    """What a request has produced so far (`delta_*`: new since the previous output of this request).

    `token_ids` includes a stop token id when one ended the request (chat parsers need it); `text`
    never contains a stop token's text or a stop string. `finish_reason`: "stop" (stop token or
    string, `stop_reason` says which; also a grammar that has ended), "length" (max_tokens or the context
    limit), "abort", "error" (the request's grammar could go no further: `stop_reason` is llguidance's reason).

    `logprobs` / `delta_logprobs` (None unless the request's `SamplingParams.logprobs` is set): one entry
    per token of `token_ids` / `delta_token_ids`, `(logprob, [(id, logprob), ...])`: the token's log
    probability and the k most likely tokens', as `sample.token_logprobs` computes them: of the model's raw
    distribution (before penalties, temperature and filters), or with `logprobs_mode="processed"` of the
    distribution the token was drawn from (`sample.sampling_logits`).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: dict = field(default_factory=dict)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    delta_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class _Request:
    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, stop_ids: frozenset[int],
                 stream: TextStream | None, on_output, device, cache_points: tuple[int, ...] = (),
                 keep_cache: bool = False, constraint: Constraint | None = None) -> None:
        self.id, self.prompt, self.params, self.stop_ids = rid, prompt, params, stop_ids
        self.constraint = constraint
        self.cache_points, self.keep_cache = cache_points, keep_cache  # increasing prompt lengths to snapshot at
        self.stream, self.on_output = stream, on_output
        self.generator = None if params.greedy else make_generator(params.seed, device)  # where logits live
        self.out: list[int] = []
        self.logprobs: list | None = None if params.logprobs is None else []  # one entry per token of out
        self.sent_tokens = 0
        self.cache: DenseCache | None = None
        self.prefilled = 0
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.t_arrival = time.perf_counter()
        self.t_first: float | None = None

    def seen(self) -> list[int] | tuple:
        """The ids the repetition penalty looks at (prompt and output), or none when the request has no penalty."""
        return self.prompt + self.out if self.params.repetition_penalty != 1.0 else ()


class Engine:
    """Continuous-batching generation over one model.

    Args:
        model: a `K3ForCausalLM` (eval mode is set here).
        tokenizer: an `openk3.tokenizer.Tokenizer`, needed for text prompts, text output and stop
            strings; without one, prompts must be token ids and outputs have ids only.
        max_num_seqs: requests decoded together (slots).
        max_model_len: prompt + generated tokens per request (default: the config's
            max_position_embeddings).
        prefill_chunk: prompt tokens prefilled per step (chunked prefill).
        compile: run decode steps through a compiled `DecodeGraph` (`openk3/infer/graph.py`): much less
            per-token overhead, at the price of a one-time compile (~40-90 s per graph on one CPU core) at
            the first step.
        prefix_cache: keep up to this many prefix snapshots (`openk3/infer/prefix.py`; 0 = off): a request
            starts from the longest stored prefix of its prompt. Snapshots are taken where a request says
            (`cache_prefix`, `keep_cache`), so requests that say nothing cost nothing extra.
        prefix_cache_bytes: the snapshots' total size limit.
    """

    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 16, max_model_len: int | None = None,
                 prefill_chunk: int = 512, compile: bool = False, prefix_cache: int = 0,
                 prefix_cache_bytes: int = 1 << 30) -> None:
        if max_num_seqs < 1 or prefill_chunk < 1:
            raise ValueError(f"max_num_seqs and prefill_chunk must be >= 1, got {max_num_seqs}, {prefill_chunk}")
        if prefix_cache < 0:
            raise ValueError(f"prefix_cache must be >= 0 (0 = off), got {prefix_cache}")
        if max_model_len is not None and max_model_len < 1:  # 0 is not "the default": None is
            raise ValueError(f"max_model_len must be >= 1 (or None for the model's), got {max_model_len}")
        self.model = model.eval()
        self.tok = tokenizer
        self.cfg = model.config
        self.max_model_len = self.cfg.max_position_embeddings if max_model_len is None else max_model_len
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.device = next(model.parameters()).device
        self.slots = SlotCache(model, max_num_seqs)
        self.graph = DecodeGraph.of(model) if compile else None
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # running[i].slot == i
        self._by_id: dict[str, _Request] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.default_stop_ids = frozenset(tokenizer.stop_ids) if tokenizer is not None else frozenset()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "aborted": 0,
                      "cached_prompt_tokens": 0}
        self.prefix = PrefixCache(prefix_cache, prefix_cache_bytes) if prefix_cache else None
        self._grammars: Grammars | None = None  # built at the first request with a grammar

    def grammars(self) -> Grammars:
        """The tokenizer's llguidance side (`openk3.infer.structured.Grammars`), for grammars and masks."""
        if self.tok is None:
            raise ValueError("structured output needs a tokenizer: give the engine one")
        if self._grammars is None:
            self._grammars = grammars_for(self.tok)
        return self._grammars

    # ---- requests --------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text (needs the tokenizer) or as ids (checked)."""
        if isinstance(prompt, str):
            if self.tok is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            ids = self.tok.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        return ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, on_output: Callable[[RequestOutput], None] | None = None,
                    stop_token_ids: Iterable[int] | None = None, ignore_eos: bool = False,
                    skip_special_tokens: bool = True, cache_prefix: int | Sequence[int] | None = None,
                    keep_cache: bool = False) -> str:
        """Queue a request; returns its id. `on_output` is called with every new `RequestOutput`.

        stop_token_ids: extra ids that end generation; the tokenizer's stop ids (`<|end_of_msg|>`,
        `[EOS]`) apply unless `ignore_eos`.
        cache_prefix: the first `cache_prefix` prompt tokens are shared with other requests: snapshot the
            state after them (1 <= cache_prefix < prompt length); several lengths snapshot at each (prompts
            that branch like a tree: a family's tool declarations, then each effort's system message, ...;
            one already stored, or passed by this request's own hit, is skipped). keep_cache: when this request finishes
            (a stop or a length limit), snapshot its state, so that a next turn that extends the sequence
            prefills only what is new. Both need `Engine(prefix_cache=N)` and are ignored without it.
        """
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        points = () if cache_prefix is None else \
            (cache_prefix,) if isinstance(cache_prefix, int) else tuple(cache_prefix)
        for k in points:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < len(ids):
                raise ValueError(f"cache_prefix must be in 1..{len(ids) - 1} (the prompt has {len(ids)} tokens), "
                                 f"got {cache_prefix}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._by_id:
            raise ValueError(f"request id {rid!r} is already in use")
        stops = (frozenset() if ignore_eos else self.default_stop_ids) | frozenset(stop_token_ids or ())
        if params.stop and self.tok is None:
            raise ValueError("stop strings need a tokenizer")
        stream = TextStream(self.tok, params.stop, skip_special=skip_special_tokens) if self.tok else None
        constraint = self.grammars().start(params.structured, stops) if params.structured is not None else None
        req = _Request(rid, ids, params, stops, stream, on_output, self.device,
                       tuple(sorted(set(points))) if self.prefix is not None else (),
                       keep_cache and self.prefix is not None,
                       constraint)
        self._by_id[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe; takes effect at the next step boundary). Unknown ids are ignored."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self.running)

    # ---- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduling step (see the module docstring); returns the outputs it produced."""
        outputs: list[RequestOutput] = []
        self._apply_aborts(outputs)
        budget = self.prefill_chunk
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.cache is None:
                self._start_prefill(req)
            n = min(budget, len(req.prompt) - req.prefilled)
            point = next((k for k in req.cache_points if k > req.prefilled), None)
            if point is not None:
                n = min(n, point - req.prefilled)  # stop at the shared prefix to snapshot it
            chunk = torch.tensor([req.prompt[req.prefilled:req.prefilled + n]], device=self.device)
            logits = self.model(chunk, cache=req.cache, mla_impl="naive", last_only=True)
            req.prefilled += n
            budget -= n
            self.stats["prompt_tokens"] += n
            if req.prefilled == point:
                self.prefix.put(req.prompt[:req.prefilled], req.cache)
            if req.prefilled < len(req.prompt):
                break  # the rest of this prompt goes in the next steps
            self.waiting.popleft()
            req.slot = len(self.running)
            self.slots.install(req.slot, req.cache)
            req.cache = None
            self.running.append(req)
            req.t_first = time.perf_counter()
            (tok,), (lp,) = self._choose([req], logits[:, -1])
            self._accept(req, tok, lp, outputs)
        self._release_finished()  # requests that stopped at their first token
        if self.running:
            ids = torch.tensor([[r.out[-1]] for r in self.running], device=self.device)
            n = len(self.running)
            if self.graph is not None:
                logits_nV = self.graph(ids, self.slots, n)
            else:
                logits_nV = self.model(ids, cache=self.slots.view(n))[:, -1]
            for req, tok, lp in zip(self.running, *self._choose(self.running, logits_nV), strict=True):
                self._accept(req, tok, lp, outputs)
        self._release_finished()
        return outputs

    def _start_prefill(self, req: _Request) -> None:
        """A fresh cache, or a copy of the longest stored prefix of the prompt (then only the rest is prefilled)."""
        hit = self.prefix.lookup(req.prompt) if self.prefix is not None else None
        if hit is None:
            req.cache = self.model.new_cache()
            return
        req.prefilled, req.cache = hit
        self.stats["cached_prompt_tokens"] += req.prefilled

    def _choose(self, reqs: list[_Request], logits_nV: torch.Tensor) -> tuple[list[int], list]:
        """Each row's next token (drawn from its grammar's masked logits where it has one) and log probabilities."""
        rows = [i for i, r in enumerate(reqs) if r.constraint is not None]
        masked_nV = self.grammars().mask(logits_nV, rows, [reqs[i].constraint for i in rows]) if rows else logits_nV
        toks = self._sample(reqs, masked_nV)
        return toks, self._logprobs(reqs, logits_nV, toks, masked_nV)

    def _sample(self, reqs: list[_Request], logits_nV: torch.Tensor) -> list[int]:
        logits_nV = logits_nV.float()
        simple = [i for i, r in enumerate(reqs) if r.params.greedy and r.params.repetition_penalty == 1.0]
        toks: list[int | None] = [None] * len(reqs)
        if simple:  # all rows greedy (the common case): no gathered copy of their logits
            rows = logits_nV if len(simple) == len(reqs) else logits_nV[simple]
            best = rows.argmax(-1).tolist()
            for i, t in zip(simple, best, strict=True):
                toks[i] = t
        for i, r in enumerate(reqs):
            if toks[i] is None:
                toks[i] = sample_next(logits_nV[i], r.params, r.generator, r.seen())
        return toks  # type: ignore[return-value]

    def _logprobs(self, reqs: list[_Request], logits_nV: torch.Tensor, toks: list[int],
                  masked_nV: torch.Tensor | None = None) -> list:
        """The log probability entries of the rows whose request asks for them (None for the others). Kept
        apart from `_sample` so that a batch where no row asks costs nothing more than a list of Nones,
        and whatever chose the tokens, the entries describe the tokens actually taken. "raw" entries are of
        the model's logits (a grammar's mask is processing); "processed" ones of `masked_nV`, what was sampled."""
        masked_nV = logits_nV if masked_nV is None else masked_nV
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        out: list = [None] * len(reqs)
        if rows:
            picked = logits_nV if len(rows) == len(reqs) else logits_nV[rows]
            processed = [j for j, i in enumerate(rows) if reqs[i].params.logprobs_mode == "processed"]
            if processed:  # these rows' entries describe the distribution each token was drawn from
                picked = picked.to(torch.promote_types(picked.dtype, torch.float32), copy=True)
                for j in processed:
                    r = reqs[rows[j]]
                    picked[j] = sampling_logits(masked_nV[rows[j]], r.params, r.seen())
            entries = token_logprobs(picked, [toks[i] for i in rows], [reqs[i].params.logprobs for i in rows])
            for i, e in zip(rows, entries, strict=True):
                out[i] = e
        return out

    def _accept(self, req: _Request, tok: int, logprob, outputs: list[RequestOutput]) -> None:
        """Append a sampled token (and its logprob entry, when asked), apply the stop rules, emit an output."""
        grammar = req.constraint
        if grammar is not None and grammar.error is not None:  # its grammar allowed no token: none was drawn
            self._fail(req, outputs)
            return
        req.out.append(tok)
        if req.logprobs is not None:
            req.logprobs.append(logprob)
        self.stats["generation_tokens"] += 1
        delta = ""
        if tok in req.stop_ids:
            req.finish_reason, req.stop_reason = "stop", tok
        elif req.stream is not None:
            delta = req.stream.add(tok)
            if req.stream.stopped is not None:
                req.finish_reason, req.stop_reason = "stop", req.stream.stopped
        if req.finish_reason is None and grammar is not None:
            grammar.consume(tok)
            if grammar.error is not None:
                req.finish_reason, req.stop_reason = "error", grammar.error
            elif grammar.done:  # its end-of-sequence token, taken where it is not a stop id (ignore_eos)
                req.finish_reason, req.stop_reason = "stop", tok
        if req.finish_reason is None:
            if len(req.out) >= req.params.max_tokens or len(req.prompt) + len(req.out) >= self.max_model_len:
                req.finish_reason = "length"
        if req.finish_reason is not None and req.stream is not None:
            delta += req.stream.finish()
        outputs.append(self._emit(req, delta))

    def _fail(self, req: _Request, outputs: list[RequestOutput]) -> None:
        req.finish_reason, req.stop_reason = "error", req.constraint.error
        outputs.append(self._emit(req, req.stream.finish() if req.stream is not None else ""))

    def _emit(self, req: _Request, delta: str) -> RequestOutput:
        new = req.out[req.sent_tokens:]
        new_lp = None if req.logprobs is None else req.logprobs[req.sent_tokens:]
        req.sent_tokens = len(req.out)
        done = req.finish_reason is not None
        metrics = {"prompt_tokens": len(req.prompt), "generation_tokens": len(req.out)}
        if done:
            now = time.perf_counter()
            metrics["time_to_first_token_s"] = None if req.t_first is None else req.t_first - req.t_arrival
            metrics["e2e_s"] = now - req.t_arrival
        text = req.stream.text if req.stream is not None else ""
        out = RequestOutput(req.id, req.prompt, list(req.out), text, new, delta, done, req.finish_reason,
                            req.stop_reason, metrics, None if req.logprobs is None else list(req.logprobs), new_lp)
        if req.on_output is not None:
            req.on_output(out)
        return out

    def _apply_aborts(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            req = self._by_id.get(rid)
            if req is None or req.finish_reason is not None:
                continue
            req.finish_reason = "abort"
            self.stats["aborted"] += 1
            if req in self.waiting:
                self.waiting.remove(req)
                req.cache = None
                del self._by_id[rid]
            outputs.append(self._emit(req, ""))
        self._release_finished()

    def _release_finished(self) -> None:
        """Free the slots of finished requests; the last running request moves into each hole."""
        for i in range(len(self.running) - 1, -1, -1):
            req = self.running[i]
            if req.finish_reason is None:
                continue
            if req.keep_cache and req.finish_reason in ("stop", "length"):
                # the slot holds every token fed: the prompt and all but the last generated one
                snap = self.slots.extract(req.slot)
                assert snap.seq_len == len(req.prompt) + len(req.out) - 1, "slot length out of step with the ids"
                self.prefix.put(req.prompt + req.out[:-1], snap, copy=False)
            last = self.running.pop()
            if last is not req:
                self.slots.move(last.slot, req.slot)
                last.slot = req.slot
                self.running[req.slot] = last
            else:
                self.slots.clear(req.slot)
            req.slot = None
            self._by_id.pop(req.id, None)
            if req.finish_reason != "abort":
                self.stats["finished"] += 1

    # ---- convenience loops -----------------------------------------------------------------------

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            self.step()

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, progress: bool = False, **request_kw) -> list[RequestOutput]:
        """Run `prompts` to completion (batched); returns the final outputs in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        finals: dict[str, RequestOutput] = {}
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist, strict=True):
                ids.append(self.add_request(p, sp, **request_kw))
        except Exception:  # a bad prompt queues nothing: withdraw the ones already added
            for rid in ids:
                self.abort(rid)
            self._apply_aborts([])
            raise
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finals[i] for i in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               **request_kw) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they come (other queued requests advance too). Closing the
        iterator early aborts the request."""
        rid = self.add_request(prompt, params, **request_kw)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.abort(rid)
                self._apply_aborts([])
