"""Structured outputs (issue 28): grammar-constrained decoding with llguidance in the engine, `LLM`, and the server.

The nano model has random weights: under a grammar it writes garbage that fits the grammar, which is the point
(validity, not quality). Schemas bound every string and array so that outputs end within `max_tokens`; an
output cut at the limit (finish_reason "length") is not required to validate, but most must finish.
Thinking is scripted where needed: a wrapper of `Engine._sample` writes a short reasoning and `<|close|>`,
then the grammar takes over (the random model would think for hundreds of tokens before closing).
"""

from __future__ import annotations

import codecs
import json
import random
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from serve_helpers import byte_tokenizer, nano_model, scripted_builder, served

import openk3
from openk3.chat import StreamParser, marker_ids_of
from openk3.infer.engine import Engine
from openk3.infer.sample import SamplingParams, sample_next
from openk3.infer.structured import Structured, StructuredError, grammars_for
from openk3.infer.xtml_grammar import chat_constraint
from openk3.serve import create_app

MODEL = "nano-test"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "w", "parameters": {  # short names: byte tokens are slow
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 3}, "u": {"enum": ["c", "f"]},
                                     "d": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["c", "u"], "additionalProperties": False}}}
# a schema the argument form cannot write (a string format): its calls are one JSON block
LOOKUP = {"type": "function", "function": {"name": 'look&"up', "parameters": {
    "type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"]}}}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def llm(tok):
    return openk3.LLM(nano_model(), tok, max_num_seqs=4)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def think_then(engine: Engine, reasoning: bytes, tok) -> None:
    """Script every request's first tokens: `reasoning` then `<|close|>`; sampling (masked) goes on after."""
    script = list(reasoning) + [tok.special_ids["<|close|>"]]
    original = engine._sample

    def sample(reqs, logits):
        toks = original(reqs, logits)
        return [script[len(r.out)] if len(r.out) < len(script) else t for r, t in zip(reqs, toks, strict=True)]

    engine._sample = sample


def parse_ids(tok, ids: list[int], thinking: bool) -> dict:
    """The assistant message of a completion given as ids (markers by id, as the server parses)."""
    parser = StreamParser(thinking, marker_ids=marker_ids_of(tok))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in ids:
        if t in parser._marker_ids:
            rest = decoder.decode(b"", final=True)
            decoder.reset()
            if rest:
                parser.feed_token(-1, rest)
            parser.feed_token(t, "")
        elif not tok.is_special(t):
            parser.feed_token(t, decoder.decode(tok.decode_bytes([t])))
    parser.finish()
    return parser.message()


# ---- the mask ----------------------------------------------------------------------------------------------


def test_mask_is_exactly_the_grammar(tok):
    """Masked entries are -inf exactly where llguidance says a token cannot come next (checked token by token with
    the matcher itself), the others keep their logits; thinking rows mask only the stop ids."""
    g = grammars_for(tok)
    s = Structured.of({"json": PERSON})
    text = b'{"name": "ab", "age": 7'
    for cut in (0, 1, 9, len(text)):
        c = g.start(s, tok.stop_ids)
        for b in text[:cut]:
            c.consume(b)
        logits = torch.randn(2, tok.vocab_size, generator=torch.Generator().manual_seed(cut))
        out = g.mask(logits, [1], [c])
        assert torch.equal(out[0], logits[0])  # an unconstrained row is untouched
        allowed = {t for t in range(tok.vocab_size) if c.matcher.validate_tokens([t]) == 1}
        assert allowed and allowed != set(range(tok.vocab_size))
        assert {t for t in range(tok.vocab_size) if out[1, t] != float("-inf")} == allowed
        assert torch.equal(out[1, sorted(allowed)], logits[1, sorted(allowed)])
    thinking = g.start(Structured(s.grammar, after_think=True), [5])
    out = g.mask(torch.zeros(1, tok.vocab_size), [0], [thinking])
    assert {t for t in range(tok.vocab_size) if out[0, t] == float("-inf")} == {5, *tok.stop_ids}


def test_masked_token_is_never_sampled(tok):
    """Over many seeds and sampling settings, a token drawn from masked logits is always one the grammar allows."""
    g = grammars_for(tok)
    s = Structured.of({"regex": "[ab]{3}x"})
    for seed in range(300):
        c = g.start(s, tok.stop_ids)
        logits = torch.randn(1, tok.vocab_size, generator=torch.Generator().manual_seed(seed)) * 5
        logits[0, ord("z")] = 1e4  # the model's favourite is forbidden
        params = SamplingParams(temperature=[0, 0.7, 1.5][seed % 3], top_k=[0, 5][seed % 2], seed=seed)
        generator = torch.Generator().manual_seed(seed)
        t = sample_next(g.mask(logits, [0], [c])[0], params, generator)
        assert t in (ord("a"), ord("b")), (seed, t)


def test_engine_outputs_follow_the_grammar_over_seeds(tok):
    """Sampled and greedy decoding on the random model: every output matches its grammar, exactly."""
    engine = Engine(nano_model(), tok, max_num_seqs=8)
    specs = {"json": {"json": PERSON}, "regex": {"regex": "[a-c]{2,5}(-[0-9]{1,2})?"},
             "choice": {"choice": ["yes", "no"]}}
    params = [SamplingParams(seed=seed, temperature=t, max_tokens=80, structured=Structured.of(spec))
              for spec in specs.values() for seed in range(4) for t in (0, 1.0)]
    outs = engine.generate(["Give it to me"] * len(params), params)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 0.9 * len(outs)
    for o, p in zip(outs, params, strict=True):
        if o.finish_reason != "stop":
            continue
        assert o.stop_reason in tok.stop_ids  # the grammar ended: only the end-of-sequence ids were left
        if p.structured == Structured.of(specs["json"]):
            jsonschema.validate(json.loads(o.text), PERSON)
        elif p.structured == Structured.of(specs["choice"]):
            assert o.text in ("yes", "no")
        else:
            assert re.fullmatch("[a-c]{2,5}(-[0-9]{1,2})?", o.text), o.text


def test_mixed_batch_leaves_unconstrained_rows_alone(tok):
    """Constrained and unconstrained requests share batches (3 slots, 8 requests joining and leaving): every
    unconstrained request makes the tokens it makes alone, and the constrained ones follow their grammar."""
    model = nano_model()
    plain = [SamplingParams(seed=s, max_tokens=12) for s in range(4)]
    alone = [Engine(model, tok, max_num_seqs=1).generate(["hi there"], [p])[0].token_ids for p in plain]
    s = Structured.of({"json": PERSON})
    mixed = [x for p in plain for x in (p, SamplingParams(seed=p.seed, max_tokens=80, structured=s))]
    outs = Engine(model, tok, max_num_seqs=3).generate(["hi there"] * len(mixed), mixed)
    assert [o.token_ids for o in outs[::2]] == alone
    for o in outs[1::2]:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), PERSON)


def test_grammar_that_cannot_go_on_ends_with_error(tok):
    """A token the grammar cannot take (forced here past the mask) ends that request with finish reason "error"
    and llguidance's reason; the others in the batch carry on; nothing hangs. ignore_eos: a finished grammar
    still stops the request."""
    engine = Engine(nano_model(), tok, max_num_seqs=4)
    original = engine._sample

    def sample(reqs, logits):
        toks = original(reqs, logits)
        return [ord("!") if r.id == "bad" and len(r.out) == 2 else t for r, t in zip(reqs, toks, strict=True)]

    engine._sample = sample
    s = Structured.of({"json": PERSON})
    engine.add_request("x", SamplingParams(seed=1, max_tokens=80, structured=s), request_id="bad")
    engine.add_request("x", SamplingParams(seed=2, max_tokens=20), request_id="plain", ignore_eos=True)
    engine.add_request("x", SamplingParams(seed=3, max_tokens=20, structured=Structured.of({"choice": ["ok"]})),
                       request_id="eos", ignore_eos=True)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["bad"].finish_reason == "error" and "doesn't satisfy the grammar" in finals["bad"].stop_reason
    assert finals["bad"].token_ids == finals["bad"].token_ids[:3] and len(finals["bad"].token_ids) == 3
    assert finals["plain"].finish_reason == "length"
    assert finals["eos"].finish_reason == "stop" and finals["eos"].text == "ok"


def test_abort_a_constrained_request(tok):
    engine = Engine(nano_model(), tok, max_num_seqs=2)
    s = Structured.of({"regex": "[a-z]{50}"})
    engine.add_request("x", SamplingParams(seed=1, max_tokens=40, structured=s), request_id="a")
    engine.add_request("x", SamplingParams(seed=2, max_tokens=40, structured=s), request_id="b")
    engine.step()
    engine.abort("a")
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["a"].finish_reason == "abort"
    assert finals["b"].finish_reason == "length" and re.fullmatch("[a-z]{40}", finals["b"].text)


# ---- LLM ---------------------------------------------------------------------------------------------------


def test_llm_generate_structured(llm):
    outs = llm.generate(["a", "b"], structured={"json": PERSON}, max_tokens=80, seed=3)
    for o in outs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), PERSON)
    with pytest.raises(ValueError, match="structured: must be an object with exactly one of"):
        llm.generate("a", structured={"yaml": "x"})
    with pytest.raises(StructuredError, match="look-around") as e:
        llm.generate("a", structured={"json": {"type": "string", "pattern": "(?<=a)b"}})
    assert e.value.field == "structured"


@pytest.mark.parametrize("thinking", [False, True])
def test_llm_chat_response_format_and_named_tool(llm, tok, thinking):
    """Both with thinking off and on: with it on the reasoning is free and the grammar starts after it."""
    if thinking:
        think_then(llm.engine, b"hmm", tok)
    try:
        messages = [{"role": "user", "content": "Who?"}]
        rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
        r = llm.chat(messages, thinking=thinking, response_format=rf, max_tokens=120, seed=5)
        assert r.finish_reason == "stop" and not r.problems
        assert r.reasoning_content == ("hmm" if thinking else None)
        jsonschema.validate(json.loads(r.content), PERSON)
        named = {"type": "function", "function": {"name": "w"}}
        r = llm.chat(messages, thinking=thinking, tools=[WEATHER, LOOKUP], tool_choice=named, max_tokens=260, seed=6)
        assert r.finish_reason == "stop" and not r.problems and not r.content
        (call,) = r.tool_calls
        assert call["function"]["name"] == "w"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    finally:
        llm.engine.__dict__.pop("_sample", None)


# ---- the XTML grammar against the parser -------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["named", "named_block", "required", "auto_strict", "json_or_calls"])
@pytest.mark.parametrize("thinking", [False, True])
def test_xtml_grammar_is_what_the_parser_reads(tok, choice, thinking):
    """Random walks through the grammar (each step a uniformly random allowed token) parse without a single
    problem, and every constrained call's arguments validate against the tool's schema."""
    g = grammars_for(tok)
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    kw = {"named": dict(tools=[WEATHER, LOOKUP], tool_choice=named("w")),
          "named_block": dict(tools=[WEATHER, LOOKUP], tool_choice=named('look&"up')),
          "required": dict(tools=[WEATHER, LOOKUP], tool_choice="required", parallel=False),
          "auto_strict": dict(tools=[strict, LOOKUP]),
          "json_or_calls": dict(tools=[strict], response_format={"type": "json_object"})}[choice]
    s = chat_constraint(tok, thinking=thinking, **kw)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in kw["tools"]}
    ended = 0
    for seed in range(12):
        rnd = random.Random(seed)
        c = g.start(s, tok.stop_ids)
        ids = list(b"why") + [tok.special_ids["<|close|>"]] if thinking else []
        for t in ids:
            c.consume(t)
        while len(ids) < 500 and (not ids or ids[-1] not in tok.stop_ids):
            row = g.mask(torch.zeros(1, tok.vocab_size), [0], [c])[0]
            ids.append(rnd.choice((row > float("-inf")).nonzero().flatten().tolist()))
            c.consume(ids[-1])
            assert c.error is None
        if ids[-1] not in tok.stop_ids:
            continue
        ended += 1
        msg = parse_ids(tok, ids, thinking)
        assert msg["problems"] == [], tok.decode(ids)
        calls = msg["tool_calls"] or []
        if choice in ("named", "named_block", "required"):
            assert len(calls) == 1 and msg["content"] is None
        if choice.startswith("named"):
            assert calls[0]["function"]["name"] == kw["tool_choice"]["function"]["name"]
        if choice == "json_or_calls" and not calls:
            assert isinstance(json.loads(msg["content"]), dict)
        for call in calls:
            name = call["function"]["name"]
            if choice != "auto_strict" or name == "w":
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    assert ended >= 4


def test_chat_constraint_refusals(tok):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?=a)"}}}}}
    with pytest.raises(StructuredError, match="look-around") as e:
        chat_constraint(tok, thinking=False, tools=[WEATHER, bad], tool_choice="required")
    assert e.value.field == "tools[1].function.parameters"
    assert chat_constraint(tok, thinking=False, tools=[WEATHER, bad], tool_choice="auto") is None  # nothing strict
    with pytest.raises(StructuredError) as e:
        chat_constraint(tok, thinking=False, tools=[WEATHER], tool_choice=named("g"))
    assert e.value.field == "tool_choice"
    with pytest.raises(StructuredError) as e:
        chat_constraint(tok, thinking=False, tool_choice="required")
    assert e.value.field == "tool_choice"


# ---- the server, with the official openai client ----------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    app = create_app(scripted_builder(4), served_model_name=MODEL)
    with served(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


OFF = {"thinking": False}


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    ok: bool
    tag: Literal["a", "b"]


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Who?"}], n=3,
                                      response_format=Person, max_tokens=100, seed=1, extra_body=OFF)
    assert len(r.choices) == 3 and all(isinstance(c.message.parsed, Person) for c in r.choices)


TINY = {"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
TINY2 = {"type": "function", "function": {"name": "u", "parameters": {
    "type": "object", "properties": {"s": {"enum": ["a", "b"]}}, "required": ["s"], "additionalProperties": False}}}


def test_named_tool_choice(client):
    for stream in (False, True):
        # (the server refuses LOOKUP's name: OpenAI's rule; the grammar's escaping of it is tested above)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, TINY],
                  tool_choice=named("t"), max_tokens=160, seed=7, extra_body=OFF)
        if stream:
            calls, finish = {}, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for ch in chunk.choices:
                    finish = ch.finish_reason or finish
                    for tc in ch.delta.tool_calls or []:
                        calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            calls = [{"name": n, "arguments": a} for n, a in calls.values()]
        else:
            r = client.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in r.choices[0].message.tool_calls]
        assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "t"
        jsonschema.validate(json.loads(calls[0]["arguments"]), TINY["function"]["parameters"])


def test_required_tool_choice_one_call(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}],
                                       tools=[TINY, TINY2], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=200, seed=2, n=2, extra_body=OFF)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        fn = choice.message.tool_calls[0].function
        schema = {"t": TINY, "u": TINY2}[fn.name]["function"]["parameters"]
        jsonschema.validate(json.loads(fn.arguments), schema)


def obj(required: list[str] | None = None, **props) -> dict:
    """An object schema with these properties, all required unless `required` says, no others."""
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


CORPUS = {
    "nested": obj(user=obj(id={"type": "integer", "minimum": 1, "maximum": 999},
                           name={"type": "string", "maxLength": 5})),
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                     "maxItems": 4},
    "enums": obj(color={"enum": ["red", "green", "blue"]}, size={"enum": [1, 2, 3]}),
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3}, {"type": "null"}]}},
        "required": ["v"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {"t": {"type": "number", "minimum": -5, "maximum": 5},
                                                       "p": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}},
                      "required": ["t", "p"], "additionalProperties": False},
    "patterns": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["code", "zip"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "boolean"},
                                                  "b": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "c": {"type": "string", "maxLength": 2}},
                 "required": ["a"], "additionalProperties": False},
    "objects_in_array": obj(items={"type": "array", "maxItems": 2, "items": obj(
        k={"enum": ["x", "y"]}, n={"type": "integer", "minimum": 0, "maximum": 5})}),
    "refs": {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["x"], "additionalProperties": False}},
             "type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                              "q": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]}},
             "required": ["p", "q"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "event"}, "ok": {"type": "boolean"}},
              "required": ["kind", "ok"], "additionalProperties": False},
    "string_length": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
                      "required": ["s"], "additionalProperties": False},
    "enum_array": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_json_schema_corpus(client, name):
    """Three sampled choices (their own seeds) per schema: every finished one validates; all of them finish
    (each schema bounds its strings, arrays and numbers so the output fits max_tokens)."""
    schema = CORPUS[name]
    jsonschema.Draft202012Validator.check_schema(schema)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer."}], n=3, seed=11, temperature=1.0, max_tokens=140,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        extra_body=OFF)
    for choice in r.choices:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_completions_response_format(server):
    r = httpx.post(server + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "JSON:", "max_tokens": 100, "seed": 4, "n": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}).json()
    for choice in r["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), PERSON)


def test_refused_grammar_is_a_400_naming_it(server):
    chat = server + "/v1/chat/completions"
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    look_around = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": look_around}}},
         "response_format.json_schema.schema", "look-around"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": look_around}}],
          "tool_choice": "required"}, "tools[1].function.parameters", "look-around"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "nope"}}}]},
         "tools[0].function.parameters", "nope"),
        ({"tools": [WEATHER], "tool_choice": named("nope")}, "tool_choice", "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema", "schema"),
    ]
    for extra, param, words in cases:
        r = httpx.post(chat, json={**ok, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    r = httpx.post(server + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "x", "schema": look_around}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"


def test_grammar_failure_mid_generation_is_a_clear_error(server, client):
    """The scripted output (reasoning, then plain text) cannot follow a JSON grammar: the engine ends the choice
    with "error" and the server answers a 400 `structured_output_failed` naming the field (an error event in a
    stream), never a hang or a 5xx."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "#script:text#"}], max_tokens=60,
              response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert e.value.body["code"] == "structured_output_failed" and e.value.body["param"] == "response_format"
    with pytest.raises(openai.APIError, match="could not go on"):
        for _ in client.chat.completions.create(stream=True, **kw):
            pass
