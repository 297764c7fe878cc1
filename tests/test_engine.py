"""The generation engine (openk3/infer/engine.py) and its decode state (openk3/model/cache.py).

Correctness is checked against the slowest obvious twin: the argmax of a full forward over the
whole sequence, recomputed for every new token, in float64 (no near-ties can flip a token). The
engine's batches mix prompts of odd, different lengths, with fewer slots than requests, so requests
join and leave between steps and slots get compacted.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import assert_close, nano_cut

from openk3.config import preset
from openk3.infer.detok import TextStream
from openk3.infer.engine import Engine
from openk3.infer.sample import SamplingParams
from openk3.model.cache import DenseCache, KDAState, MLAState, SlotCache
from openk3.model.model import K3ForCausalLM
from openk3.tokenizer import Tokenizer
from openk3.tokenizer.special import k3_special_tokens

F64 = torch.float64
GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPT_LENGTHS = (5, 17, 1, 30, 9, 3)


@pytest.fixture(scope="module")
def model64():
    return K3ForCausalLM.build(nano_cut(), dtype=F64, seed=0).eval()


@pytest.fixture(scope="module")
def model32():
    return K3ForCausalLM.build(nano_cut(), seed=0).eval()


@pytest.fixture(scope="module")
def tok():
    """Byte-level tokenizer with K3's special block: 256 ranks + 256 specials = nano's vocabulary."""
    return Tokenizer({bytes([i]): i for i in range(256)}, k3_special_tokens(256))


def prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def full_forward_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The slow twin: recompute the whole sequence for every token, take the argmax."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


# ---- correctness --------------------------------------------------------------------------------------

def test_greedy_generation_equals_repeated_full_forwards(model64):
    eng = Engine(model64, max_num_seqs=3, prefill_chunk=8)
    outs = eng.generate(prompts(), GREEDY)
    for p, out in zip(prompts(), outs, strict=True):
        assert out.finished and out.finish_reason == "length"
        assert out.prompt_token_ids == p
        assert out.token_ids == full_forward_greedy(model64, p, GREEDY.max_tokens)
    assert not eng.has_unfinished() and eng.num_free_slots == 3


def test_batched_equals_one_by_one(model64):
    ps = prompts(1)
    params = [GREEDY, SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=10),
              SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, seed=3, max_tokens=7),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=11, max_tokens=12),
              GREEDY, SamplingParams(temperature=1.0, seed=5, max_tokens=4)]
    batched = Engine(model64, max_num_seqs=4, prefill_chunk=64).generate(ps, params)
    one = Engine(model64, max_num_seqs=1)
    for p, sp, got in zip(ps, params, batched, strict=True):
        ref = one.generate([p], sp)[0]
        assert got.token_ids == ref.token_ids
    # The same seeds give the same samples run after run.
    again = Engine(model64, max_num_seqs=6).generate(ps, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in batched]


def test_batched_equals_one_by_one_float32(model32):
    """fp32 rows of a batch may round differently from a single row; logits must stay within fp32 noise."""
    ps = prompts(2, (4, 11, 7))
    cache = SlotCache(model32, 3)
    singles = []
    with torch.inference_mode():
        for slot, p in enumerate(ps):
            dense = model32.new_cache()
            model32(torch.tensor([p]), cache=dense)
            cache.install(slot, dense)
            singles.append(model32(torch.tensor([[p[-1]]]), cache=dense)[0, -1])
        batched = model32(torch.tensor([[p[-1]] for p in ps]), cache=cache.view(3))[:, -1]
    for i in range(3):
        assert_close(f"row {i}", singles[i], batched[i], 1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_shot(model64, chunk):
    p = prompts(3, (37,))[0]
    with torch.no_grad():
        one = model64.new_cache()
        ref = model64(torch.tensor([p]), cache=one)[0, -1]
        parts = model64.new_cache()
        for s in range(0, len(p), chunk):
            got = model64(torch.tensor([p[s:s + chunk]]), cache=parts)[0, -1]
    assert_close("last logits", ref, got, 1e-12)
    with torch.no_grad():
        assert_close("last_only", ref, model64(torch.tensor([p]), cache=model64.new_cache(), last_only=True)[0, -1],
                     1e-12)
    for i, (a, b) in enumerate(zip(one.layers, parts.layers, strict=True)):
        if isinstance(a, KDAState):
            for name in ("conv_q", "conv_k", "conv_v", "conv", "recurrent"):
                assert_close(f"layer {i} {name}", getattr(a, name), getattr(b, name), 1e-12)
        else:
            assert_close(f"layer {i} ckv", a.ckv, b.ckv, 1e-12)
            assert_close(f"layer {i} kpe", a.kpe, b.kpe, 1e-12)
    eng_out = Engine(model64, prefill_chunk=chunk).generate([p], GREEDY)[0]
    assert eng_out.token_ids == Engine(model64, prefill_chunk=4096).generate([p], GREEDY)[0].token_ids


def test_kda_state_is_constant_as_context_grows(model32):
    """Measured: KDA bytes do not change with length; MLA bytes grow by (C + Dr) values per MLA layer per token."""
    cfg = model32.config
    mla_layers = len(cfg.mla_layers)
    per_token = mla_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    cache = model32.new_cache()
    sizes = []
    with torch.inference_mode():
        model32(torch.randint(0, 256, (1, 3)), cache=cache)
        for n in range(3, 200):
            if n in (3, 50, 199):
                sizes.append((n, cache.nbytes()))
            model32(torch.randint(0, 256, (1, 1)), cache=cache)
    kda = {s["kda_state"] for _, s in sizes}
    assert len(kda) == 1 and kda.pop() > 0
    for n, s in sizes:
        assert s["mla_cache"] == n * per_token


def test_decode_path_equals_forward_with_grad(model64):
    """The in-place KDA decode (`_decode_`, no grad) equals the layer's functional forward (with grad)."""
    layer = model64.model.layers[0].self_attn
    x = torch.randn(2, 6, model64.config.hidden_size, dtype=F64)
    st = layer.empty_state(2, "cpu", F64)
    with torch.no_grad():
        _, st = layer(x[:, :5], state=st)
        ref_state = KDAState(*(t.clone() for t in st.tensors()))
    with torch.enable_grad():
        ref, ref_state = layer(x[:, 5:], state=ref_state)
    with torch.no_grad():
        got, same = layer(x[:, 5:], state=st)
    assert same is st
    assert_close("out", ref.detach(), got, 1e-13)
    for name, a, b in zip(("conv", "recurrent"), ref_state.tensors(), st.tensors(), strict=True):
        assert_close(name, a.detach(), b, 1e-13)


# ---- scheduling, stops, streaming, cancellation --------------------------------------------------------

def test_cancellation_frees_the_slot_and_others_continue(model64):
    ps = prompts(4, (6, 9, 4))
    ref = Engine(model64, max_num_seqs=3).generate(ps, GREEDY)
    eng = Engine(model64, max_num_seqs=3)
    ids = [eng.add_request(p, GREEDY) for p in ps]
    eng.step()
    eng.step()
    assert eng.num_free_slots == 0
    eng.abort(ids[0])  # the request in slot 0: the last one moves into its slot
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == ids[0]]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert eng.num_free_slots == 1
    finals = {}
    while eng.has_unfinished():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert finals[ids[1]].token_ids == ref[1].token_ids
    assert finals[ids[2]].token_ids == ref[2].token_ids
    assert eng.num_free_slots == 3 and eng.stats["aborted"] == 1 and eng.stats["finished"] == 2


def test_abort_waiting_request_and_unknown_id(model64):
    eng = Engine(model64, max_num_seqs=1)
    a = eng.add_request([1, 2, 3], GREEDY)
    b = eng.add_request([4, 5], GREEDY)
    eng.abort(b)
    eng.abort("no-such-request")
    outs = eng.step()
    assert any(o.request_id == b and o.finish_reason == "abort" for o in outs)
    assert len(eng.waiting) == 0 and len(eng.running) == 1 and eng.running[0].id == a
    eng.run()
    assert eng.num_free_slots == 1


def test_closing_a_stream_aborts_it(model64):
    eng = Engine(model64, max_num_seqs=2)
    it = eng.stream([7, 8, 9], SamplingParams(temperature=0, max_tokens=50))
    first = next(it)
    assert first.delta_token_ids and not first.finished
    it.close()
    assert not eng.has_unfinished() and eng.num_free_slots == 2


def test_stop_token_ids_and_callbacks(model64):
    p = prompts(5, (8,))[0]
    greedy = full_forward_greedy(model64, p, 10)
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    seen = []
    eng = Engine(model64)
    eng.add_request(p, GREEDY, stop_token_ids=[stop_at], on_output=seen.append)
    eng.run()
    final = seen[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == stop_at
    assert final.token_ids == greedy[:first + 1]  # the stop id is reported in token_ids
    assert [t for o in seen for t in o.delta_token_ids] == final.token_ids
    assert sum(o.finished for o in seen) == 1


def test_tokenizer_stop_ids_end_generation(model64, tok):
    """`<|end_of_msg|>` and `[EOS]` stop by default; ignore_eos turns that off."""
    p = prompts(6, (5,))[0]
    greedy = full_forward_greedy(model64, p, 10)
    eng = Engine(model64, tok)
    eng.default_stop_ids = frozenset({greedy[2]})  # pretend this token is end_of_msg
    out = eng.generate([p], GREEDY)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 3
    out = eng.generate([p], GREEDY, ignore_eos=True)[0]
    assert out.finish_reason == "length" and out.token_ids == greedy
    assert Engine(model64, tok).default_stop_ids == frozenset(tok.stop_ids)


def test_stop_strings_cut_the_text(tok):
    # all 9 layers: the 4-layer cut's greedy reply to this prompt is mostly special ids (no text to stop on)
    model64 = K3ForCausalLM.build(preset("nano"), dtype=F64, seed=0).eval()
    p = prompts(7, (6,))[0]
    greedy = full_forward_greedy(model64, p, 20)
    text = tok.decode(greedy)
    stop = text[5:8]
    assert stop and len(stop) == 3
    out = Engine(model64, tok).generate([p], SamplingParams(temperature=0, max_tokens=20, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]


def test_max_model_len_and_input_errors(model64, tok):
    eng = Engine(model64, tok, max_model_len=12)
    out = eng.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=100))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(list(range(12)))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 512])
    rid = eng.add_request([1], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1], request_id="x")
    eng.abort(rid)
    eng.step()
    with pytest.raises(ValueError, match="needs a tokenizer"):
        Engine(model64).add_request("hello")
    for bad in (0, -3):  # not "the model's default" (None is)
        with pytest.raises(ValueError, match=f"max_model_len must be >= 1.*got {bad}"):
            Engine(model64, tok, max_model_len=bad)


def test_text_prompts_and_streaming_deltas(model64, tok):
    eng = Engine(model64, tok)
    deltas = list(eng.stream("hello there", SamplingParams(temperature=0, max_tokens=12)))
    final = deltas[-1]
    assert final.finished and "".join(d.delta_text for d in deltas) == final.text
    assert final.prompt_token_ids == tok.encode("hello there")
    assert final.text == tok.decode(final.token_ids, skip_special=True)


# ---- the detokeniser -------------------------------------------------------------------------------------

def test_text_stream_utf8_split_and_stop_across_tokens(tok):
    s = TextStream(tok, ("END",))
    ids = list("héllo wEN".encode()) + list(b"Dmore")
    pieces = [s.add(i) for i in ids]
    assert "".join(pieces) + s.finish() == "héllo w"
    assert s.stopped == "END" and s.text == "héllo w"
    # the first byte of "é" alone releases nothing; held-back text never contains a partial stop string
    assert pieces[1] == ""
    plain = TextStream(tok)
    assert "".join(plain.add(i) for i in "añb".encode()) + plain.finish() == "añb"
    broken = TextStream(tok)
    assert broken.add(0xC3) == "" and broken.finish() == "\ufffd"


def test_text_stream_skips_special_tokens(tok):
    eos = tok.eos_id
    s = TextStream(tok, skip_special=True)
    assert s.add(ord("a")) + s.add(eos) + s.finish() == "a"
    s = TextStream(tok, skip_special=False)
    assert s.add(ord("a")) + s.add(eos) + s.finish() == "a" + tok.id_to_piece(eos)


# ---- the slot cache -----------------------------------------------------------------------------------

def test_slot_cache_install_move_and_growth(model64):
    cache = SlotCache(model64, 4)
    dense = DenseCache(model64.config.num_hidden_layers)
    with torch.no_grad():
        model64(torch.tensor([list(range(70))]), cache=dense)
    cache.install(2, dense)
    assert cache.host_lengths[2] == 70 and cache.capacity >= 71
    cache.move(2, 0)
    for i, st in enumerate(dense.layers):
        if isinstance(st, MLAState):
            assert torch.equal(cache.ckv[i][0, :70], st.ckv[0])
        else:
            assert torch.equal(cache.kda[i].recurrent[0], st.recurrent[0])
    assert cache.nbytes()["kda_state"] == sum(s.nbytes() for s in cache.kda if s is not None)


# ---- log probabilities ---------------------------------------------------------------------------------------

@torch.no_grad()
def reference_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of one full float64 forward over prompt + output: row j is the distribution of out[j]."""
    logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1:len(prompt) - 1 + len(out)]
    return torch.log_softmax(logits.double(), dim=-1)


def test_logprobs_equal_a_full_forward_float64_in_a_mixed_batch(model64):
    """Six odd-length prompts through three slots, greedy and sampled rows (with a temperature and top-k, which
    raw log probabilities ignore), asking k = None, 0 or 4: every asked entry equals log_softmax of the full
    forward; rows that do not ask have no entries and the same tokens as a batch where nobody asks."""
    ps = prompts(3)
    ks = [4, None, 0, 4, None, 2]
    temps = [0, 0, 0.8, 1.0, 0.9, 0]

    def params(ask: bool) -> list[SamplingParams]:
        return [SamplingParams(temperature=t, top_k=5 if t else 0, seed=11 + i, max_tokens=7,
                               logprobs=k if ask else None) for i, (t, k) in enumerate(zip(temps, ks, strict=True))]

    eng = Engine(model64, max_num_seqs=3, prefill_chunk=16)
    deltas: dict[str, list] = {}
    ids = [eng.add_request(p, sp, ignore_eos=True,
                           on_output=lambda o: deltas.setdefault(o.request_id, []).extend(o.delta_logprobs or []))
           for p, sp in zip(ps, params(True), strict=True)]
    finals = {}
    while eng.has_unfinished():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    plain = Engine(model64, max_num_seqs=3, prefill_chunk=16).generate(ps, params(False), ignore_eos=True)
    for rid, p, k, ref_out in zip(ids, ps, ks, plain, strict=True):
        out = finals[rid]
        assert out.token_ids == ref_out.token_ids and ref_out.logprobs is None and ref_out.delta_logprobs is None
        if k is None:
            assert out.logprobs is None and deltas.get(rid, []) == []
            continue
        assert len(out.logprobs) == len(out.token_ids) == 7 and deltas[rid] == out.logprobs
        ref = reference_logprobs(model64, p, out.token_ids)
        for j, (lp, top) in enumerate(out.logprobs):
            assert abs(lp - ref[j, out.token_ids[j]].item()) < 1e-9
            order = torch.argsort(ref[j], descending=True)[:k].tolist()
            assert [i for i, _ in top] == order and all(abs(v - ref[j, i].item()) < 1e-9 for i, v in top)


def test_processed_logprobs_are_of_the_distribution_each_token_was_drawn_from(model64):
    """logprobs_mode="processed": the entries are log_softmax of the sampling logits (repetition penalty,
    temperature, top-k, top-p applied; -inf outside the kept set), float64 here, in a batch mixed with raw and
    greedy rows; the tokens are the same as without log-probs. Greedy rows stay raw."""
    from openk3.infer.sample import sampling_logits

    ps = prompts(4, (5, 9, 12, 7))
    settings = [dict(temperature=0.7, logprobs_mode="processed"),
                dict(temperature=0.5, top_k=6, top_p=0.9, repetition_penalty=1.3, logprobs_mode="processed"),
                dict(temperature=0.7),  # raw: ignores the temperature
                dict(temperature=0, logprobs_mode="processed")]
    sp = [SamplingParams(seed=5 + i, max_tokens=6, logprobs=3, **kw) for i, kw in enumerate(settings)]
    got = Engine(model64, max_num_seqs=4, prefill_chunk=16).generate(ps, sp, ignore_eos=True)
    plain = Engine(model64, max_num_seqs=4, prefill_chunk=16).generate(
        ps, [dataclasses.replace(s, logprobs=None) for s in sp], ignore_eos=True)
    for p, s, out, ref_out in zip(ps, sp, got, plain, strict=True):
        assert out.token_ids == ref_out.token_ids
        with torch.no_grad():  # one full float64 forward: row j holds the logits that drew out[j]
            logits = model64(torch.tensor([p + out.token_ids]))[0, len(p) - 1:len(p) - 1 + len(out.token_ids)]
        raw = torch.log_softmax(logits.double(), -1)
        for j, (lp, top) in enumerate(out.logprobs):
            if s.logprobs_mode == "processed":  # the penalty is not shift-invariant: from the logits themselves
                want = torch.log_softmax(sampling_logits(logits[j], s, p + out.token_ids[:j]), -1)
            else:
                want = raw[j]
            assert abs(lp - want[out.token_ids[j]].item()) < 1e-9
            order = torch.argsort(want, descending=True, stable=True)[:3].tolist()
            assert [i for i, _ in top] == order and all(abs(v - want[i].item()) < 1e-9 for i, v in top)
        assert all(math.isfinite(lp) for lp, _ in out.logprobs)  # every drawn token is inside its kept set
    # a tempered row's processed entries differ from the raw ones of the same tokens
    raw0 = reference_logprobs(model64, ps[0], got[0].token_ids)
    gaps = [abs(lp - raw0[j, t].item()) for j, ((lp, _), t) in enumerate(zip(got[0].logprobs, got[0].token_ids))]
    assert max(gaps) > 1e-3
    with pytest.raises(ValueError, match="logprobs_mode must be one of 'raw', 'processed'"):
        SamplingParams(logprobs=0, logprobs_mode="logits")


def test_logprobs_through_the_eager_decode_graph(model64):
    """Engine(compile=True) decodes through `DecodeGraph`, which returns the same logits: logprobs come from them
    unchanged (its eager form here; tests/test_graph.py checks the compiled form against the eager one)."""
    from openk3.infer.graph import DecodeGraph

    ps = prompts(4, (6, 13))
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    ref = Engine(model64, max_num_seqs=2).generate(ps, sp, ignore_eos=True)
    eng = Engine(model64, max_num_seqs=2)
    eng.graph = DecodeGraph(model64, compile=False)
    got = eng.generate(ps, sp, ignore_eos=True)
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids
        for (la, ta), (lb, tb) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(la - lb) < 1e-9 and [i for i, _ in ta] == [i for i, _ in tb]


def test_no_logprob_work_when_no_row_asks(model64, monkeypatch):
    """A batch where no request asks for logprobs never computes them (the greedy argmax path stays as it was)."""
    import openk3.infer.engine as engine_mod

    def refuse(*args):
        raise AssertionError("token_logprobs was called")

    monkeypatch.setattr(engine_mod, "token_logprobs", refuse)
    outs = Engine(model64, max_num_seqs=2).generate(prompts(5, (4, 7, 2)), GREEDY, ignore_eos=True)
    assert all(len(o.token_ids) == 10 and o.logprobs is None for o in outs)
    with pytest.raises(AssertionError, match="was called"):  # the patch is where the engine computes them
        Engine(model64, max_num_seqs=2).generate([[1, 2]], SamplingParams(temperature=0, max_tokens=2, logprobs=0))
