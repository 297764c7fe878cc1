"""`openk3.LLM`: loading (checkpoint folder, run folder, in-memory), generate, stream and chat mechanics.

A random-init nano model says nothing useful: these tests check only mechanics (greedy = argmax of full
forwards, batching, stops, seeds, rendering, parsing), never what the model says.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import openk3
from openk3.chat import encode_segments, render, render_text
from openk3.infer.engine import Engine, RequestOutput
from openk3.infer.llm import LLM, ChatResult, resolve_checkpoint, resolve_dtype
from openk3.infer.sample import SamplingParams
from openk3.tokenizer import Tokenizer

USER = [{"role": "user", "content": "Hello there"}]


def byte_tokenizer() -> Tokenizer:
    """256 byte ranks + K3's 256-id special block = nano's vocabulary of 512."""
    return Tokenizer({bytes([b]): b for b in range(256)})


def make_checkpoint(path) -> None:
    model = openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0)
    openk3.save(model, path, dtype=torch.float32)
    byte_tokenizer().save(str(path))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llm") / "ckpt"
    make_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, max_num_seqs=4)


def full_forward_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


def scripted_stream(*completions: list[int]):
    """An `Engine.stream` stand-in that emits the given token ids, one completion per call."""
    queue = list(completions)

    def stream(self, prompt, params=None, **kw):
        ids = queue.pop(0)
        for k, tid in enumerate(ids):
            last = k == len(ids) - 1
            yield RequestOutput("fake", list(prompt), ids[:k + 1], "", [tid], "", last, "stop" if last else None)

    return stream


# ---- loading -------------------------------------------------------------------------------------

def test_lazy_export_and_repr(llm, ckpt):
    assert openk3.LLM is LLM and "LLM" in openk3.__all__
    assert llm.path == ckpt and llm.tokenizer.vocab_size == llm.config.vocab_size == 512
    assert str(ckpt) in repr(llm)
    assert llm.model.lm_head.weight.dtype == torch.float32


def test_missing_path_and_folder_without_tokenizer(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        LLM(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        LLM(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ckpt / name, bare / name)
    with pytest.raises(ValueError, match=f"{bare}.*tiktoken.model"):
        LLM(bare)
    with pytest.raises(FileNotFoundError, match="tok-nowhere"):
        LLM(bare, tokenizer=tmp_path / "tok-nowhere")
    assert LLM(bare, tokenizer=str(ckpt)).tokenizer.vocab_size == 512  # an explicit tokenizer folder


def test_training_run_folder_follows_latest(tmp_path, ckpt):
    run = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(ckpt, run / "checkpoints" / f"step_00000{step}")
        (run / "checkpoints" / f"step_00000{step}" / "trainer_state.pt").write_bytes(b"x")
    (run / "checkpoints" / "latest").write_text("step_000001\n")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_000001"
    assert resolve_checkpoint(run / "checkpoints") == run / "checkpoints" / "step_000001"
    assert resolve_checkpoint(ckpt / "config.json") == ckpt
    assert LLM(run).path == run / "checkpoints" / "step_000001"
    empty = tmp_path / "empty-run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="without a complete checkpoint"):
        resolve_checkpoint(empty)


def test_in_memory_model_and_checks(llm):
    model = openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0)
    mem = LLM(model, byte_tokenizer())
    assert mem.path is None and "in-memory" in repr(mem)
    a = mem.generate("abc", max_tokens=4, temperature=0, ignore_eos=True)[0].token_ids
    assert a == llm.generate("abc", max_tokens=4, temperature=0, ignore_eos=True)[0].token_ids
    ids_only = LLM(model)  # no tokenizer: token-id prompts only
    assert len(ids_only.generate([5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)[0].token_ids) == 3
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        ids_only.chat(USER)
    small = Tokenizer({bytes([b]): b for b in range(256)}, {"[A]": 256})
    with pytest.raises(ValueError, match="must match"):
        LLM(model, small)
    with pytest.raises(TypeError):
        LLM(42)
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("auto") is None
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8")


def test_keep_packed_loads_mxfp4_experts_packed_and_decodes(tmp_path):
    """`LLM(path, keep_packed=True)` on an MXFP4 checkpoint keeps the experts packed (what the release
    ships), decodes through the MXFP4 kernel, and its greedy tokens are the argmax of full forwards; an
    in-memory model is refused (nothing to keep)."""
    from openk3.model.packed_experts import PackedExperts

    path = tmp_path / "mx"
    openk3.save(openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0), path, experts_format="mxfp4",
                dtype=torch.float32)
    byte_tokenizer().save(str(path))
    packed = LLM(path, keep_packed=True)
    assert any(isinstance(m, PackedExperts) for m in packed.model.modules())
    plain = LLM(path)
    assert not any(isinstance(m, PackedExperts) for m in plain.model.modules())
    ids = packed.tokenizer.encode("Hello")
    (a,) = packed.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
    assert a.token_ids == full_forward_greedy(packed.model, ids, 6)
    assert a.token_ids == plain.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)[0].token_ids
    with pytest.raises(ValueError, match="keep_packed applies to a checkpoint path"):
        LLM(plain.model, keep_packed=True)


def _bf16_checkpoint(path, experts_format: str = "bf16"):
    openk3.save(openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0), path, dtype=torch.bfloat16,
                experts_format=experts_format)
    byte_tokenizer().save(str(path))
    return path


def _dtype_notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "openk3.infer.llm"]


def test_auto_dtype_computes_a_bf16_checkpoint_in_float32_on_cpu_and_says_so(tmp_path, caplog):
    """F18: `LLM(path)` as it comes computes a bf16 checkpoint in float32 on CPU (decode in bf16 is 1.5-2x
    slower there) and logs one line with the choice and why; an explicit dtype wins."""
    path = _bf16_checkpoint(tmp_path / "bf16")
    with caplog.at_level("INFO", logger="openk3"):
        auto = LLM(path)
    assert {p.dtype for p in auto.model.parameters()} == {torch.float32}
    (note,) = _dtype_notes(caplog)
    assert "compute dtype float32 on CPU" in note and "stored bfloat16" in note and "--dtype bf16" in note
    caplog.clear()
    with caplog.at_level("INFO", logger="openk3"):
        kept = LLM(path, dtype="bf16")
    assert kept.model.model.embed_tokens.weight.dtype == torch.bfloat16
    (note,) = _dtype_notes(caplog)
    assert "compute dtype bfloat16, as asked" in note
    ids = auto.tokenizer.encode("Hi")  # the float32 model is the bf16 weights, exactly: same greedy tokens
    assert auto.generate(ids, max_tokens=4, temperature=0, ignore_eos=True)[0].token_ids == \
        full_forward_greedy(kept.model.float(), ids, 4)


def test_auto_dtype_keeps_packed_mxfp4_experts_packed(tmp_path):
    """The float32 choice applies to the trunk: MXFP4 experts loaded with keep_packed stay packed bytes."""
    from openk3.model.packed_experts import PackedExperts

    llm = LLM(_bf16_checkpoint(tmp_path / "mx", experts_format="mxfp4"), keep_packed=True)
    packed = [m for m in llm.model.modules() if isinstance(m, PackedExperts)]
    assert packed and all(t.dtype == torch.uint8 for m in packed for t in m.buffers())
    assert llm.model.model.embed_tokens.weight.dtype == torch.float32


def test_compute_dtype_choice():
    """The rule itself, on every device (no GPU needed to check what a GPU would get)."""
    from openk3.infer.llm import compute_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compute_dtype(None, torch.bfloat16, cpu)[0] == torch.float32
    assert compute_dtype(None, torch.float16, cpu)[0] == torch.float32
    assert compute_dtype(None, torch.float32, cpu)[0] is None  # float32 and float64 stay as stored
    assert compute_dtype(None, torch.float64, cpu)[0] is None
    dtype, why = compute_dtype(None, torch.bfloat16, cuda)
    assert dtype is None and why == "compute dtype bfloat16 on cuda, as stored"
    assert compute_dtype(torch.bfloat16, torch.bfloat16, cpu)[0] == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_value_error(ckpt):
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(ckpt, device="cuda")


# ---- generate ------------------------------------------------------------------------------------

def test_greedy_text_and_ids_match_full_forwards(llm):
    ids = llm.tokenizer.encode("Hello")
    out = llm.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True)
    assert isinstance(out, list) and len(out) == 1
    (a,) = out
    assert a.prompt_token_ids == ids and a.finish_reason == "length" and len(a.token_ids) == 8
    assert a.token_ids == full_forward_greedy(llm.model, ids, 8)
    (b,) = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8), ignore_eos=True)
    assert b.token_ids == a.token_ids and b.text == a.text
    (c,) = llm.generate(torch.tensor(ids), max_tokens=8, temperature=0, ignore_eos=True)
    assert c.token_ids == a.token_ids
    assert llm.generate([], max_tokens=3) == []


def test_batch_equals_one_by_one(llm):
    prompts = ["Hello", "abc", [1, 2, 3, 4, 5], "a longer prompt than the others"]
    params = SamplingParams(temperature=0, max_tokens=6)
    batch = llm.generate(prompts, params, ignore_eos=True)
    assert [o.prompt_token_ids for o in batch] == [llm.engine.encode(p) for p in prompts]
    for p, o in zip(prompts, batch, strict=True):
        assert llm.generate(p, params, ignore_eos=True)[0].token_ids == o.token_ids
    per_prompt = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 3, 4)]
    assert [len(o.token_ids) for o in llm.generate(prompts, per_prompt, ignore_eos=True)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="4 prompts but 2"):
        llm.generate(prompts, per_prompt[:2])


def test_stop_string_and_stop_token(llm):
    (ref,) = llm.generate("abc", max_tokens=24, temperature=0, ignore_eos=True)
    cut = next(i for i, ch in enumerate(ref.text) if i > 0 and ch.isascii() and ch.isprintable())
    stop = ref.text[cut]
    (out,) = llm.generate("abc", max_tokens=24, temperature=0, ignore_eos=True, stop=stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:ref.text.index(stop)]
    stop_id = ref.token_ids[3]
    (out,) = llm.generate("abc", max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(stop_id) + 1]  # the stop id is included


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=12)
    a = llm.generate(["Hello", "Hello"], params, ignore_eos=True)
    b = llm.generate("Hello", params, ignore_eos=True)[0]
    assert a[0].token_ids == a[1].token_ids == b.token_ids
    c = llm.generate("Hello", params, seed=124, ignore_eos=True)[0]  # keyword overrides params
    assert c.token_ids != b.token_ids


def test_bad_arguments(llm):
    with pytest.raises(TypeError, match="unknown sampling option"):
        llm.generate("x", max_token=3)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.generate(["x", 3.5])
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("x", temperature=-1)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", "x" * 5000])
    assert not llm.engine.has_unfinished()  # nothing was queued by the failed calls


def test_stream_and_abort(llm):
    outs = list(llm.stream("Hello", max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(o.delta_token_ids) for o in outs] == [1] * 5 and outs[-1].finished
    ref = llm.generate("Hello", max_tokens=5, temperature=0, ignore_eos=True)[0]
    assert outs[-1].token_ids == ref.token_ids and "".join(o.delta_text for o in outs) == ref.text
    it = llm.stream("Hello", max_tokens=50, temperature=0, ignore_eos=True)
    next(it)
    it.close()
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="one prompt"):
        llm.stream(["a", "b"])


# ---- chat ----------------------------------------------------------------------------------------

def test_chat_returns_message_and_second_turn_extends_the_prompt(llm):
    deltas = []
    r = llm.chat(USER, max_tokens=12, temperature=0, effort="low", on_delta=deltas.append)
    assert isinstance(r, ChatResult)
    assert r.message["role"] == "assistant" and set(r.message) >= {"role", "content", "reasoning_content"}
    assert r.prompt_token_ids == encode_segments(render({"messages": USER, "thinking_effort": "low"}),
                                                 llm.tokenizer).ids
    assert r.finish_reason in ("stop", "length") and 1 <= len(r.token_ids) <= 12
    assert r.text == llm.tokenizer.decode(r.token_ids)
    streamed = "".join(d.get("reasoning_content", "") for d in deltas)
    assert streamed == (r.message["reasoning_content"] or "")
    assert "".join(d.get("content", "") for d in deltas) == (r.message["content"] or "")
    history = [*USER, r.message, {"role": "user", "content": "And then?"}]
    r2 = llm.chat(history, max_tokens=6, temperature=0, effort="low")
    assert r2.prompt_token_ids[:len(r.prompt_token_ids)] == r.prompt_token_ids  # same rendering of turn 1
    assert len(history) == 3  # not modified


def test_chat_thinking_options(llm):
    off = llm.chat(USER, max_tokens=2, temperature=0, thinking=False)
    gen = llm.tokenizer.encode('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>', allow_special=True)
    assert off.prompt_token_ids[-len(gen):] == gen
    on, thinking = llm.chat_prompt(USER, effort=None)
    assert thinking and "thinking_effort" not in llm.tokenizer.decode(on)
    assert "thinking_effort=max" in llm.tokenizer.decode(llm.chat_prompt(USER)[0])
    assert llm.chat_prompt(USER, effort="none")[1] is False
    with pytest.raises(ValueError, match="medium"):
        llm.chat(USER, effort="medium")
    with pytest.raises(TypeError, match="messages"):
        llm.chat("hi")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = ("The user wants the weather in Zürich; call the tool ☕.<|close|>think<|sep|><|open|>response<|sep|>"
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
        "<|open|>argument key=\"city\" type=\"string\"<|sep|>Zürich<|close|>argument<|sep|>"
        "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")
ANSWER = "Done.<|close|>think<|sep|><|open|>response<|sep|>It is 18°C.<|close|>response<|sep|><|close|>message<|sep|>"


def test_chat_tool_call_parsing_and_round_trip(llm, monkeypatch):
    tok = llm.tokenizer
    call_ids = tok.encode(CALL + "<|end_of_msg|>", allow_special=True)
    monkeypatch.setattr(Engine, "stream", scripted_stream(call_ids, tok.encode(ANSWER + "<|end_of_msg|>",
                                                                                allow_special=True)))
    deltas = []
    r = llm.chat(USER, tools=TOOLS, on_delta=deltas.append)
    assert r.problems == [] and r.token_ids == call_ids and r.finish_reason == "stop"
    assert r.reasoning_content == "The user wants the weather in Zürich; call the tool ☕."  # multi-byte chars intact
    assert r.content is None
    assert r.tool_calls == [{"id": "call_0", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 3}'}}]
    assert deltas[-1] == {"tool_call": r.tool_calls[0]} and all("tool_calls" not in d for d in deltas)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == r.reasoning_content
    # the next turn renders the parsed message back to exactly what the model wrote
    history = [*USER, r.message, {"role": "tool", "tool_call_id": "call_0", "content": "18°C"}]
    prompt = render_text({"messages": history, "tools": TOOLS})
    assert '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>' + CALL + "<|end_of_msg|>" in prompt
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>18°C' in prompt
    r2 = llm.chat(history, tools=TOOLS)
    assert r2.message == {"role": "assistant", "reasoning_content": "Done.", "content": "It is 18°C."}


def test_chat_call_ids_count_over_the_conversation(llm, monkeypatch):
    tok = llm.tokenizer
    ids = tok.encode(CALL + "<|end_of_msg|>", allow_special=True)
    monkeypatch.setattr(Engine, "stream", scripted_stream(ids))
    earlier = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}
    history = [*USER, earlier, {"role": "tool", "tool_call_id": "call_0", "content": "a"},
               {"role": "tool", "tool_call_id": "call_1", "content": "b"}]
    assert llm.chat(history, tools=TOOLS).tool_calls[0]["id"] == "call_2"
