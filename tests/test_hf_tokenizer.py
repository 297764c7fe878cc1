"""openk3's tokenizer exported for Hugging Face (openk3/hf/tokenizer.py): AutoTokenizer gives openk3's ids.

One small trained tokenizer (K3's 256-id special block after 1,792 ranks) is written with `save_hf_tokenizer`;
the checks compare `openk3.tokenizer.Tokenizer.encode` with the plain `PreTrainedTokenizerFast` (what
AutoTokenizer gives without openk3) and with `K3TokenizerFast`, over a corpus of awkward text, the XTML chat
renderer, the folder both worlds read, and how AutoTokenizer picks the class with and without openk3 / remote code.
The one place the plain tokenizer differs (texts openk3 encodes in pieces) is pinned at its exact boundary.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # HF tokenizers: one thread, like the rest of the suite

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from openk3.chat.xtml import encode_segments, render, render_text  # noqa: E402
from openk3.data.corpus import builtin_corpus, iter_documents  # noqa: E402
from openk3.hf.tokenizer import (  # noqa: E402
    HF_CLASS_NAME,
    REMOTE_CODE_FILE,
    K3TokenizerFast,
    hf_tokenizer_config,
    register_tokenizer,
    save_hf_tokenizer,
    tokenizer_json,
)
from openk3.tokenizer import MAX_ENCODE_CHARS, MAX_RUN_CHARS, Tokenizer, k3_special_tokens, train_bpe  # noqa: E402

MULTILINGUAL = (
    "中文分词测试，汉字漢字。日本語のテキストとカタカナ。한국어 텍스트입니다. Ελληνικά κείμενα. Русский текст. "
    "العربية نص. हिन्दी पाठ। ภาษาไทย naïve café Ünïcödé 😀😀 🇫🇷🇫🇷 👍🏽 \U0001f9d1\u200d\U0001f4bb"
)

CORPUS = [
    "",
    "Hello, world! This is ordinary ASCII prose; it has commas, semicolons -- and dashes.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\nclass A(B):\n\tpass\n",
    "if (a && b || !c) { x->y = z[i++]; } /* C */ <div class=\"k\">&amp;</div>",
    "Numbers: 0 7 42 123 4567 89012 3.14159 1e-9 -17 1,000,000 " + "1234567890" * 7 + " ٣٤٥ Ⅻ ½",
    MULTILINGUAL,
    "mixedScript中文English日本語123abcΑΒΓ",
    "it's It'S IT'S we'll WE'LL We'Ll they're THEY'RE I've I'M you'd don't won't 's 'll",
    "a    b\t\tc\n\n\nd \n \n e\r\nf\r\n\r\n   \u3000 \xa0\x0b\x0c\x1c\x85\u2028g      ",
    "   leading and trailing spaces   ",
    "\n\n\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ᚠᚢᚦ 𓀀𓀁 \U000e0041 \ufffd \x00\x01\x7f \u200b\u200c\u200d e\u0301 ǅungla ʕAa",
    "<|open|> <|close|><|sep|>[BOS][EOS]<|end_of_msg|>x<|reserved_token_1799|>y<osagent_mode>",
    "almost special: <|open|  <|opn|> [BOS [BOSS] <|reserved_token_99999|> <|reserved_token_|>",
]

FRAGMENTS = [
    "中文", "汉字漢字", "日本語", "한국어", "Hello", "WORLD", "camelCase", "ǅungla", "ʕAa", "naïve", "e\u0301", "'S",
    "'s", "'ll", "'LL", "'Re", "don't", "I'M", "123", "4567890", "٣٤٥", " ", "  ", "\t", "\n", "\r\n", "\n\n\n",
    "   \n", " \u3000 ", "\x0b", "\x1c", "\u2028", "\xa0", "<|open|>", "<|close|>", "<|sep|>", "[BOS]", "[PAD]",
    "<|end_of_msg|>", "<osagent_mode>", "<|reserved_token_1900|>", "def f(x):\n    return x", "{}", "!!", " ?!",
    "-->", "😀", "🇫🇷", "\U0001f9d1\u200d\U0001f4bb", "\x00", "\ufffd", "ꙮ", "𝔘",
]


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(builtin_corpus(300_000) + [MULTILINGUAL] * 8, 2048)


@pytest.fixture(scope="module")
def out(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tok")
    save_hf_tokenizer(tok, folder)
    return folder


@pytest.fixture(scope="module")
def plain(out):
    """What AutoTokenizer gives where openk3 is not imported: the generic fast tokenizer over tokenizer.json."""
    t = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert type(t).__name__ == "TokenizersBackend"
    return t


@pytest.fixture(scope="module")
def k3(out):
    return K3TokenizerFast.from_pretrained(out)


def _all_specials_text(tok: Tokenizer) -> str:
    """Every one of the 256 special names embedded in text."""
    return "".join(f"w{i} {name}" for i, name in enumerate(tok.special_ids))


def _texts(tok: Tokenizer) -> list[str]:
    held_out = [d.text[:3000] for d in iter_documents(340_000)][-6:]  # past the 300 kB the tokenizer saw
    return [*CORPUS, _all_specials_text(tok), *held_out]


def _fuzz(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    pool = [chr(c) for c in (*range(32, 127), *range(0xa0, 0x250), 0x3000, 0x4e2d, 0x1f600, 0x10ffff, 0xe000)]
    return ["".join(rnd.choice(FRAGMENTS) if rnd.random() < 0.6 else rnd.choice(pool)
                    for _ in range(rnd.randint(0, 24))) for _ in range(n)]


def _ids(hf, texts, **kwargs) -> list[list[int]]:
    return hf(texts, add_special_tokens=False, **kwargs)["input_ids"]


# --------------------------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("which", ["plain", "k3"])
def test_encode_equals_openk3(tok, which, request):
    hf = request.getfixturevalue(which)
    texts = _texts(tok) + _fuzz(1500)
    assert _ids(hf, texts) == [tok.encode(t, allow_special=True) for t in texts]
    assert _ids(hf, texts, split_special_tokens=True) == [tok.encode(t) for t in texts]
    # one text at a time and through encode(): the same
    assert hf.encode(texts[12], add_special_tokens=False) == tok.encode(texts[12], allow_special=True)
    assert hf(texts[12], add_special_tokens=False).input_ids == tok.encode(texts[12], allow_special=True)


def test_code_points_across_unicode(tok, plain):
    """The Oniguruma regex of tokenizers classes code points as tiktoken's does (letters, marks, numbers, Han,
    whitespace: the Unicode tables agree). Every third code point here; all of them agree too, 3x slower."""
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    text = "".join(c + (" " if i % 40 == 0 else "'s" if i % 97 == 0 else "") for i, c in enumerate(chars[::3]))
    assert _ids(plain, [text], split_special_tokens=True)[0] == tok.encode(text)


def test_special_tokens_in_text(tok, plain, k3):
    text = _all_specials_text(tok)
    for hf in (plain, k3):
        ids = _ids(hf, [text])[0]
        assert sorted(i for i in ids if tok.is_special(i)) == sorted(tok.special_ids.values())
        assert not any(tok.is_special(i) for i in _ids(hf, [text], split_special_tokens=True)[0])
    assert plain.convert_tokens_to_ids("<|open|>") == tok.special_ids["<|open|>"]
    assert len(plain) == tok.vocab_size and plain.vocab_size == tok.n_ranks
    assert (plain.bos_token_id, plain.eos_token_id, plain.pad_token_id, plain.unk_token_id) == \
        (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id)
    assert plain("hi").input_ids == tok.encode("hi")  # add_special_tokens=True adds no BOS, like openk3


def test_decode_round_trip(tok, plain, k3):
    for text in _texts(tok) + _fuzz(300, seed=1):
        ids = tok.encode(text, allow_special=True)
        assert plain.decode(ids) == k3.decode(ids) == tok.decode(ids) == text
    rnd = random.Random(2)  # ids that cut UTF-8 characters: the same U+FFFD replacements
    for _ in range(300):
        ids = [rnd.randrange(tok.vocab_size) for _ in range(rnd.randint(1, 12))]
        assert plain.decode(ids) == tok.decode(ids)


def test_skip_special_tokens(tok, plain, k3):
    ids = tok.encode("a<|open|>b<|sep|>[BOS]c<|close|><|end_of_msg|><|reserved_token_1800|>d", allow_special=True)
    kept = "a<|open|>b<|sep|>c<|close|>d"
    assert k3.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special=True) == kept
    # the plain tokenizer drops all 256 (tokenizers has one `special` flag for splitting and skipping)
    assert plain.decode(ids, skip_special_tokens=True) == "abcd"


_NO_SLICE = "hello world " * (MAX_ENCODE_CHARS // 12) + "hell"  # exactly MAX_ENCODE_CHARS chars


@pytest.mark.parametrize("text, cut", [
    ("1" * MAX_RUN_CHARS, False),
    ("1" * (MAX_RUN_CHARS + 1), True),  # openk3: 8333 x '111' + '1' | '1'; whole: 8333 x '111' + '11'
    (" " * (MAX_RUN_CHARS + 7) + "x", True),  # cut, but the regex splits there anyway: the same ids
    (_NO_SLICE, False),
    (_NO_SLICE + "o", True),  # openk3: ...'hell' | 'o'; whole: ...'hello'
    ("a\ud800b", True),  # openk3: U+FFFD; tokenizers refuses the string
], ids=["run-at-limit", "run-past-limit", "space-run-past-limit", "slice-at-limit", "slice-past-limit",
        "lone-surrogate"])
def test_texts_openk3_encodes_in_pieces(tok, plain, k3, text, cut):
    """openk3 cuts runs of > MAX_RUN_CHARS and texts of > MAX_ENCODE_CHARS and replaces lone surrogates: the
    plain tokenizer encodes the whole text (and refuses surrogates), so it agrees up to the limits exactly and
    may differ past them; K3TokenizerFast cuts like openk3 and always agrees."""
    assert len(_NO_SLICE) == MAX_ENCODE_CHARS
    want = tok.encode(text)
    assert _ids(k3, [text], split_special_tokens=True)[0] == want
    if "\ud800" in text:
        with pytest.raises(TypeError):
            plain(text)
    elif not cut or text.startswith(" "):
        assert _ids(plain, [text])[0] == want
    else:
        assert _ids(plain, [text])[0] != want
    if len(text) > MAX_RUN_CHARS + 10:
        return
    assert k3.encode(text, add_special_tokens=False, split_special_tokens=True) == want
    assert k3.convert_tokens_to_ids(k3.tokenize(text, split_special_tokens=True)) == want
    batch = k3([text, "hi"], add_special_tokens=False, padding=True, return_tensors="pt")
    assert batch["input_ids"][0].tolist() == want and batch["attention_mask"][1].sum().item() == len(tok.encode("hi"))
    if cut:
        with pytest.raises(ValueError, match="in pieces"):
            k3(text, return_offsets_mapping=True)


# --------------------------------------------------------------------------------------------- chat

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <|open|> now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

CHATS = {
    "system-user": ({"messages": [{"role": "system", "content": "You are terse."},
                                  {"role": "user", "content": "Hello there! 中文?"}]}, {}),
    "reasoning": ({"messages": [{"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4", "reasoning_content": "Add them: 4."},
                                {"role": "user", "content": "and 3+3?"}]}, {}),
    "tools": ({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "<|close|>clear"}'}],
        "tools": TOOLS, "tool_choice": "required"}, {"tool_choice": "required"}),
    "typed-markers": ({"messages": [{"role": "user", "content": "I type <|open|>message<|sep|> [BOS] <|end_of_msg|>"}],
                       "thinking": False}, {"thinking": False}),
    "effort": ({"messages": [{"role": "user", "content": "hi"}], "thinking_effort": "low",
                "response_format": {"type": "json_object"}},
               {"thinking_effort": "low", "response_format": {"type": "json_object"}}),
}


@pytest.mark.parametrize("name", list(CHATS))
def test_apply_chat_template_equals_xtml(tok, k3, name):
    request, options = CHATS[name]
    segments = render(request)
    want = encode_segments(segments, tok)
    got = k3.apply_chat_template(request["messages"], tools=request.get("tools"), add_generation_prompt=True,
                                 **options)  # (transformers 5: a dict)
    assert got["input_ids"] == want.ids
    assert k3.apply_chat_template(request["messages"], tools=request.get("tools"), tokenize=False,
                                  add_generation_prompt=True, **options) == render_text(segments)
    out = k3.apply_chat_template(request["messages"], tools=request.get("tools"), return_dict=True,
                                 add_generation_prompt=True, return_assistant_tokens_mask=True, **options)
    assert out["input_ids"] == want.ids and out["attention_mask"] == [1] * len(want.ids)
    assert out["assistant_masks"] == [int(m) for m in want.mask]
    no_prompt = k3.apply_chat_template(request["messages"], tools=request.get("tools"),  # (the default: False)
                                       return_dict=False, **options)
    assert no_prompt == encode_segments(render({**request, "add_generation_prompt": False}), tok).ids


def test_apply_chat_template_batch_and_tensors(tok, k3):
    chats = [CHATS["system-user"][0]["messages"], CHATS["reasoning"][0]["messages"]]
    want = [encode_segments(render({"messages": c}), tok) for c in chats]
    assert k3.apply_chat_template(chats, return_dict=False, add_generation_prompt=True) == [w.ids for w in want]
    batch = k3.apply_chat_template(chats, return_dict=True, padding=True, return_tensors="pt",
                                   add_generation_prompt=True, return_assistant_tokens_mask=True)
    n = max(len(w.ids) for w in want)
    assert batch["input_ids"].shape == (2, n) and batch["assistant_masks"].shape == (2, n)
    for row, w in enumerate(want):
        assert batch["input_ids"][row, :len(w.ids)].tolist() == w.ids
        assert batch["attention_mask"][row].sum().item() == len(w.ids)
        assert batch["assistant_masks"][row, :len(w.ids)].tolist() == [int(m) for m in w.mask]
    cut = k3.apply_chat_template(chats[0], truncation=True, max_length=7, return_dict=False, add_generation_prompt=True)
    assert cut == want[0].ids[:7]


def test_apply_chat_template_python_function_tools(tok, k3):
    def get_weather(city: str) -> str:
        """Weather of a city.

        Args:
            city: The city.
        """

    schema = transformers.utils.get_json_schema(get_weather)
    msgs = [{"role": "user", "content": "hi"}]
    assert k3.apply_chat_template(msgs, tools=[get_weather]) == k3.apply_chat_template(msgs, tools=[schema])  # dicts


@pytest.mark.parametrize("kwargs, message", [
    ({"chat_template": "{{ messages }}"}, "no Jinja"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"documents": [{"title": "a", "text": "b"}]}, "documents"),
    ({"tokenizer_kwargs": {"add_special_tokens": True}}, "tokenizer_kwargs"),
    ({"sanitize_control_tokens": False}, "sanitize_control_tokens"),
    ({"return_assistant_tokens_mask": True, "return_dict": False}, "return_dict=True"),
    ({"thinking_effort": "medium"}, "medium"),
])
def test_apply_chat_template_refuses(k3, kwargs, message):
    with pytest.raises(ValueError, match=message):
        k3.apply_chat_template([{"role": "user", "content": "hi"}], **kwargs)


# --------------------------------------------------------------------------------------------- the folder


def test_openk3_still_reads_the_folder(tok, out):
    back = Tokenizer.from_dir(out)
    assert back.ranks == tok.ranks and back.special_ids == tok.special_ids and back.special_flags == tok.special_flags
    assert (back.bos_id, back.eos_id, back.pad_id, back.unk_id, back.stop_ids) == \
        (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id, tok.stop_ids)
    for text in _texts(tok):
        assert back.encode(text, allow_special=True) == tok.encode(text, allow_special=True)
    assert sorted(os.listdir(out)) == ["tiktoken.model", "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == HF_CLASS_NAME and "auto_map" not in cfg
    assert cfg["added_tokens_decoder"][str(tok.special_ids["<|open|>"])]["special"] is False


def _same_as_openk3(hf, tok) -> None:
    """Specials on and off, XTML with markers typed by the user, skip_special_tokens: all as openk3."""
    text = _all_specials_text(tok)
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text, allow_special=True)
    assert hf.encode(text, add_special_tokens=False, split_special_tokens=True) == tok.encode(text)
    request, options = CHATS["typed-markers"]
    assert hf.apply_chat_template(request["messages"], return_dict=False, add_generation_prompt=True,
                                  **options) == encode_segments(render(request),
                                                                                         tok).ids
    ids = tok.encode(text, allow_special=True)
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special=True)


def test_k3_save_pretrained_keeps_openk3_files(tok, k3, tmp_path):
    k3.save_pretrained(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    assert back.ranks == tok.ranks and back.special_ids == tok.special_ids and back.special_flags == tok.special_flags
    assert back.eos_id == tok.eos_id
    _same_as_openk3(K3TokenizerFast.from_pretrained(tmp_path), tok)
    assert k3.to_openk3().special_flags == tok.special_flags


def test_k3_after_a_plain_transformers_save(tok, plain, tmp_path):
    """transformers' own save writes `<|open|>` & co as non-special into tokenizer.json (its AddedToken flags come
    from tokenizer_config.json): K3TokenizerFast still never makes a control id of text."""
    plain.save_pretrained(tmp_path)
    flags = {t["content"]: t["special"] for t in json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]}
    assert flags["<|open|>"] is False  # (what the plain tokenizer reloaded from here would then match in text)
    _same_as_openk3(K3TokenizerFast.from_pretrained(tmp_path), tok)


def test_k3_loads_a_folder_without_tokenizer_json(tok, tmp_path):
    tok.save(tmp_path)  # openk3's own files only
    hf = K3TokenizerFast.from_pretrained(tmp_path)
    texts = _texts(tok)
    assert _ids(hf, texts) == [tok.encode(t, allow_special=True) for t in texts]
    assert hf.to_openk3().ranks == tok.ranks


def test_deterministic(tok, tmp_path):
    save_hf_tokenizer(tok, tmp_path / "a")
    save_hf_tokenizer(Tokenizer.from_dir(tmp_path / "a"), tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "tiktoken.model"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert json.dumps(tokenizer_json(tok)) == json.dumps(tokenizer_json(tok))


def test_remote_code_files(tok, tmp_path):
    save_hf_tokenizer(tok, tmp_path, remote_code=True, model_max_length=4096)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["auto_map"] == {"AutoTokenizer": [None, "tokenization_openk3.K3TokenizerFast"]}
    assert cfg["model_max_length"] == 4096
    assert "from openk3.hf.tokenizer import K3TokenizerFast" in (tmp_path / REMOTE_CODE_FILE).read_text()
    save_hf_tokenizer(tok, tmp_path)  # a plain save drops the shim it wrote and the auto_map
    assert not (tmp_path / REMOTE_CODE_FILE).exists()
    assert "auto_map" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / REMOTE_CODE_FILE).write_text("# the user's own file\n")
    save_hf_tokenizer(tok, tmp_path)
    assert (tmp_path / REMOTE_CODE_FILE).exists()


def test_config_replaces_foreign_code_pointers(tok):
    foreign = Tokenizer(tok.ranks, tok.special_ids, special_flags=tok.special_flags,
                        config={"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                                "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576})
    cfg = hf_tokenizer_config(foreign)
    assert "auto_map" not in cfg and cfg["tokenizer_class"] == HF_CLASS_NAME and cfg["model_max_length"] == 1048576


@pytest.mark.slow(seconds=4)
def test_k3_full_size_layout(tmp_path):
    """K3's real layout: 163,584 ranks (dense synthetic ones), the specials at 163,584.. with K3's names (reserved
    ones named by absolute id); a vocabulary over 100k also takes transformers through its Mistral-regex check."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_structured import synthetic_tokenizer  # (dense synthetic ranks: many splits cut UTF-8 characters)

    tok = Tokenizer(synthetic_tokenizer(163_584, seed=3).ranks, config={"model_max_length": 1048576})
    save_hf_tokenizer(tok, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "transformers_version": "5.23.0"}))
    plain = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert len(plain) == 163_840 and plain.convert_tokens_to_ids("<|reserved_token_163592|>") == 163_592
    assert plain.model_max_length == 1048576
    texts = CORPUS + _fuzz(400, seed=4)
    assert _ids(plain, texts) == [tok.encode(t, allow_special=True) for t in texts]
    assert _ids(plain, texts, split_special_tokens=True) == [tok.encode(t) for t in texts]


# --------------------------------------------------------------------------------------------- AutoTokenizer


class _TokenizerTestConfig(transformers.PretrainedConfig):
    model_type = "openk3-hf-tokenizer-test"


def test_auto_tokenizer_after_register(tok, out):
    register_tokenizer(_TokenizerTestConfig)
    register_tokenizer(_TokenizerTestConfig)  # idempotent
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf) is K3TokenizerFast
    assert transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True).__class__ is K3TokenizerFast


_FRESH_PROCESS = """
import json, sys
from transformers import AutoTokenizer
plain_dir, remote_dir, texts_file, result_file = sys.argv[1:5]
with open(texts_file, encoding="utf-8") as fh:
    texts = json.load(fh)
res = {}
t = AutoTokenizer.from_pretrained(plain_dir)
res["plain"] = type(t).__name__
res["plain_ids"] = t(texts, add_special_tokens=False)["input_ids"]
res["plain_split_ids"] = t(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
res["openk3_imported"] = any(m.startswith("openk3") for m in sys.modules)
for trust in (False, None):
    try:
        AutoTokenizer.from_pretrained(remote_dir, trust_remote_code=trust)
        res[str(trust)] = "loaded"
    except ValueError as e:
        res[str(trust)] = str(e)
# (the shim imports openk3.hf, which registers K3TokenizerFast: from here on no remote code is needed)
t = AutoTokenizer.from_pretrained(remote_dir, trust_remote_code=True)
res["trusted"] = [c.__module__ + "." + c.__name__ for c in type(t).__mro__[:2]]
res["trusted_chat"] = t.apply_chat_template([{"role": "user", "content": "hi <|open|>"}], return_dict=False,
                                           add_generation_prompt=True)
with open(result_file, "w", encoding="utf-8") as fh:  # stdout also carries transformers' trust prompt
    json.dump(res, fh)
"""


@pytest.mark.slow(seconds=4)
def test_auto_tokenizer_in_a_process_without_openk3_hf(tok, out, tmp_path):
    """No `import openk3.hf`: the plain folder gives PreTrainedTokenizerFast (same ids); the remote-code folder
    gives the shim's K3TokenizerFast with trust_remote_code=True and is refused without it (HF's rule for custom
    code that no installed class matches)."""
    remote = tmp_path / "remote"
    save_hf_tokenizer(tok, remote, remote_code=True)
    texts = CORPUS + [_all_specials_text(tok)]
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "texts.json").write_text(json.dumps(texts), encoding="utf-8")
    args = [str(out), str(remote), str(tmp_path / "texts.json"), str(tmp_path / "result.json")]
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert res["plain"] == "TokenizersBackend" and not res["openk3_imported"]
    assert res["plain_ids"] == [tok.encode(t, allow_special=True) for t in texts]
    assert res["plain_split_ids"] == [tok.encode(t) for t in texts]
    assert res["trusted"][0].endswith("tokenization_openk3.K3TokenizerFast")
    assert res["trusted"][1] == "openk3.hf.tokenizer.K3TokenizerFast"
    assert res["trusted_chat"] == encode_segments(render({"messages": [{"role": "user", "content": "hi <|open|>"}]}),
                                                  tok).ids
    assert "trust_remote_code=True" in res["False"] and "trust_remote_code=True" in res["None"]


# --------------------------------------------------------------------------------------------- bad input


def _byte_ranks(*extra: bytes) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for t in extra:
        ranks[t] = len(ranks)
    return ranks


def test_special_name_spelled_like_a_rank_is_refused():
    tok = Tokenizer(_byte_ranks(b"[B", b"[BOS]"))
    with pytest.raises(ValueError, match=r"'\[BOS\]'.*spelled like the byte-level form of rank 257"):
        tokenizer_json(tok)


def test_special_name_in_byte_stand_ins_is_refused(tmp_path):
    specials = {("<|ñ|>" if i == 300 else name): i for name, i in k3_special_tokens(256).items()}
    with pytest.raises(ValueError, match=r"'<\|ñ\|>'.*stand-in"):
        save_hf_tokenizer(Tokenizer(_byte_ranks(), specials), tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing written
    ok = {("<|中|>" if i == 300 else name): i for name, i in k3_special_tokens(256).items()}
    tokenizer_json(Tokenizer(_byte_ranks(), ok))  # a name outside the stand-in alphabet decodes fine


def test_unmergeable_rank_still_encodes_alike(tmp_path):
    """A rank with no split into two ranks (b"xyz" without "xy"/"yz") is reached only as a whole regex piece, in
    tiktoken and (ignore_merges) in tokenizers alike: not an error."""
    tok = Tokenizer(_byte_ranks(b"xyz", b"ab", b"abab", b"ba"))
    save_hf_tokenizer(tok, tmp_path)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    for text in ["xyz", "xyzz", " xyz", "xyz xyz", "ababab", "abababa", "bababa xyz!"]:
        assert hf(text, add_special_tokens=False).input_ids == tok.encode(text)


def test_other_bad_input(tok, tmp_path):
    with pytest.raises(ValueError, match="expected an openk3.tokenizer.Tokenizer"):
        tokenizer_json(object())
    with pytest.raises(ValueError, match="model_max_length must be a positive integer"):
        save_hf_tokenizer(tok, tmp_path, model_max_length=0)
