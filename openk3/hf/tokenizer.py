"""openk3's tokenizer as a Hugging Face tokenizer: `tokenizer.json` beside `tiktoken.model`, one
`tokenizer_config.json` that openk3 and transformers both read, and `K3TokenizerFast` for K3's chat format.

    from openk3.tokenizer import Tokenizer
    from openk3.hf.tokenizer import save_hf_tokenizer
    tok = Tokenizer.from_dir("tok")
    save_hf_tokenizer(tok, "tok")                       # adds tokenizer.json; openk3 still reads the folder

    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained("tok")
    hf(text, add_special_tokens=False).input_ids                           == tok.encode(text, allow_special=True)
    hf(text, add_special_tokens=False, split_special_tokens=True).input_ids == tok.encode(text)
    hf.apply_chat_template(messages)   # K3TokenizerFast: == encode_segments(render({"messages": messages}), tok).ids

`tokenizer.json` restates the rank-BPE in `tokenizers` terms: the K3 regex as a `Split` pre-tokenizer (the
Oniguruma engine reads K3_PAT_STR as it is, `&&` class intersection included, with the same Unicode tables as
tiktoken 0.14), then `ByteLevel` (bytes -> GPT-2's printable stand-ins), a BPE model whose ids are the ranks and
whose merges are every split of a token into two tokens, ordered by the token's rank, with `ignore_merges` (a
piece that is itself a token is that token, as in tiktoken); the 256-id special block as added tokens, all
`special` so that `split_special_tokens=True` encodes their names as ordinary text. No normalizer and no
post-processor: openk3 adds no BOS.

Where the ids can differ (`tests/test_hf_tokenizer.py` pins each one down):
* openk3 encodes a text in pieces (`openk3.tokenizer.bpe.encode_chunks`: 400,000-char slices, runs of whitespace
  or non-whitespace cut every 25,000 chars, lone surrogates -> U+FFFD). A plain `PreTrainedTokenizerFast`
  encodes the whole text, so a text with a run longer than 25,000 chars (or longer than 400,000 chars in all)
  may get other ids there, and one with a lone surrogate is refused by `tokenizers`. `K3TokenizerFast` cuts the
  text like openk3 first, so it gives openk3's ids for every text.
* `decode(ids, skip_special_tokens=True)` of a plain `PreTrainedTokenizerFast` drops all 256 special ids;
  openk3 (and `K3TokenizerFast`) keep `<|open|>`, `<|close|>` and `<|sep|>`, whose HF `special` flag is false.
* transformers' own `save_pretrained` of a plain `PreTrainedTokenizerFast` writes those three as non-special into
  tokenizer.json, so the plain tokenizer reloaded from there matches them in text even with
  `split_special_tokens=True`. `K3TokenizerFast` marks every added token special when it loads (and its own
  save_pretrained keeps `tiktoken.model` and openk3's flags), so text never yields a control id through it.
* No chat template: K3 renders chat in Python (`openk3.chat.xtml`), each segment tokenised on its own, which a
  Jinja template rendered to one string cannot express; `K3TokenizerFast.apply_chat_template` does it.

Which class `AutoTokenizer.from_pretrained(folder)` gives: `tokenizer_config.json` names `K3TokenizerFast`.
transformers finds a class by that name only once it is registered (`register_tokenizer`, done by importing
`openk3.hf`); until then the name is unknown and it falls back to `PreTrainedTokenizerFast` (alias of
`TokenizersBackend`) over tokenizer.json, which encodes exactly as above. With `remote_code=True` the folder
also gets `tokenization_openk3.py` and an `auto_map`, so `trust_remote_code=True` loads `K3TokenizerFast` in a
process that never imported openk3 (openk3 must still be installed; the file only imports it) -- and, as for any
folder with custom code, transformers then refuses to load it without `trust_remote_code=True` unless openk3.hf
is imported. Hence `remote_code=False` by default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

from transformers import AddedToken, AutoTokenizer, BatchEncoding, PreTrainedTokenizerFast
from transformers.tokenization_utils_base import TruncationStrategy

from openk3.chat.xtml import Segment, render, render_text
from openk3.fsutil import write_atomic
from openk3.tokenizer.bpe import K3_PAT_STR, Tokenizer, encode_chunks, write_tiktoken_ranks
from openk3.tokenizer.special import NAMED_TOKENS, reserved_name, tokenizer_config
from openk3.tokenizer.train import byte_level_decoder

__all__ = [
    "HF_CLASS_NAME", "K3TokenizerFast", "REMOTE_CODE_FILE", "hf_tokenizer_config", "register_tokenizer",
    "save_hf_tokenizer", "tokenizer_json",
]

#: `tokenizer_class` written to tokenizer_config.json: the name `register_tokenizer` makes known to transformers.
HF_CLASS_NAME = "K3TokenizerFast"
#: The remote-code shim `save_hf_tokenizer(..., remote_code=True)` writes.
REMOTE_CODE_FILE = "tokenization_openk3.py"
_AUTO_MAP = {"AutoTokenizer": [None, f"{REMOTE_CODE_FILE[:-3]}.{HF_CLASS_NAME}"]}

# A subclass, not a re-export: transformers marks the class it loads as remote code (`register_for_auto_class`),
# and a later save_pretrained copies that class's file; marking the shim's own class keeps openk3's untouched.
_SHIM = f'''"""Remote-code entry point of an openk3 tokenizer folder: `AutoTokenizer.from_pretrained(folder,
trust_remote_code=True)` loads {HF_CLASS_NAME} from here. Needs the openk3 package installed."""

from openk3.hf.tokenizer import {HF_CLASS_NAME} as _OpenK3Tokenizer


class {HF_CLASS_NAME}(_OpenK3Tokenizer):
    """openk3.hf.tokenizer.{HF_CLASS_NAME}, as loaded through `auto_map`."""
'''


# ----------------------------------------------------------------------------------------------- tokenizer.json


def _byte_to_char() -> dict[int, str]:
    return {b: c for c, b in byte_level_decoder().items()}


def _merges(ranks: Mapping[bytes, int], spell) -> list[list[str]]:
    """Every split of a token into two tokens, listed at the token's rank (the splits of one token left to right).

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, whatever the split; `tokenizers`
    merges the pair listed first. Listed this way, pairs of different tokens are ordered by rank, as in tiktoken.
    The one order tiktoken does not have is between two splits of the same token (it takes the leftmost pair);
    they would have to be mergeable at the same moment to matter, which no test has produced (random rank tables
    over 2-3 letter alphabets, both split orders, every text up to 9 letters). A token with no split into two
    tokens is reached only as a whole piece: by `ignore_merges` in HF, by tiktoken's whole-piece lookup."""
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append([spell(left), spell(right)])
    return merges


def _check_special_names(tok, vocab: Mapping[str, int]) -> None:
    """ValueError for the special names `tokenizers` cannot hold beside the byte-level vocabulary."""
    char_to_byte = byte_level_decoder()
    for name, i in tok.special_ids.items():
        if name in vocab:
            # an added token spelled like a vocabulary entry takes that entry's id in `tokenizers`
            raise ValueError(f"special token {name!r} (id {i}) is spelled like the byte-level form of rank "
                             f"{vocab[name]} ({tok.id_to_piece(vocab[name])!r}); tokenizers would give the name "
                             "that rank's id. Rename the special token or drop the rank.")
        if all(c in char_to_byte for c in name) and bytes(char_to_byte[c] for c in name) != name.encode("utf-8"):
            # the ByteLevel decoder reads such a name as byte stand-ins, so decode would print other text
            raise ValueError(f"special token {name!r} (id {i}) is written only in ByteLevel's byte stand-in "
                             "characters but is not plain ASCII; HF's decoder would turn it into other bytes. "
                             "Use ASCII (or add a character outside U+0021..U+0143) in the name.")


def tokenizer_json(tok: Tokenizer) -> dict:
    """The `tokenizer.json` object (HF `tokenizers` format) that encodes and decodes as `tok` does.

    Ids: rank r -> id r, special ids as in `tok.special_ids`. Raises ValueError for a special name spelled like a
    vocabulary entry or written in ByteLevel stand-in characters (see `_check_special_names`).
    """
    if not isinstance(getattr(tok, "ranks", None), Mapping) or not isinstance(getattr(tok, "special_ids", None),
                                                                               Mapping):
        raise ValueError(f"expected an openk3.tokenizer.Tokenizer, got {type(tok).__name__}")
    byte_to_char = _byte_to_char()

    def spell(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {spell(token): rank for token, rank in sorted(tok.ranks.items(), key=lambda kv: kv[1])}
    _check_special_names(tok, vocab)
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True}  # all special: `split_special_tokens=True` must encode every name as text
             for name, i in sorted(tok.special_ids.items(), key=lambda kv: kv[1])]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": K3_PAT_STR}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": True,  # tiktoken: a piece that is itself a token is that token
            "vocab": vocab,
            "merges": _merges(tok.ranks, spell),
        },
    }


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


# ----------------------------------------------------------------------------------------------- config + files

# Keys of an existing config that would point transformers at code or files this folder does not have (K3's
# own `auto_map` names tokenization_kimi.py).
_REPLACED_KEYS = ("auto_map", "tokenizer_class", "tokenizer_file", "vocab_file")


def hf_tokenizer_config(tok: Tokenizer, *, remote_code: bool = False, model_max_length: int | None = None) -> dict:
    """openk3's tokenizer_config.json object (`Tokenizer.save`) plus what AutoTokenizer reads: `tokenizer_class`,
    no BOS/EOS added by encode, and with `remote_code` the `auto_map` of the shim. openk3 reads it back
    unchanged: extra keys are kept as `Tokenizer.config`."""
    extra = {k: v for k, v in tok.config.items() if k not in _REPLACED_KEYS}
    extra.update({"tokenizer_class": HF_CLASS_NAME, "add_bos_token": False, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False})
    if model_max_length is not None:
        if isinstance(model_max_length, bool) or not isinstance(model_max_length, int) or model_max_length < 1:
            raise ValueError(f"model_max_length must be a positive integer, got {model_max_length!r}")
        extra["model_max_length"] = model_max_length
    if remote_code:
        extra["auto_map"] = _AUTO_MAP
    return tokenizer_config(tok.special_ids, tok.special_flags, extra)


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike, *, remote_code: bool = False,
                      model_max_length: int | None = None) -> list[str]:
    """Write `tiktoken.model`, `tokenizer.json` and `tokenizer_config.json` (and with `remote_code`
    `tokenization_openk3.py`) into `out_dir` (created if needed); each file atomically. Returns the paths written.

    The folder then loads with `openk3.tokenizer.Tokenizer.from_dir` (same tokenizer as `tok`) and with
    `transformers.AutoTokenizer.from_pretrained` (module docstring). Raises ValueError as `tokenizer_json`.
    """
    out_dir = os.fspath(out_dir)
    tok_json = _json_bytes(tokenizer_json(tok))  # checks before anything is written
    cfg = hf_tokenizer_config(tok, remote_code=remote_code, model_max_length=model_max_length)
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", REMOTE_CODE_FILE)}
    write_tiktoken_ranks(paths["tiktoken.model"], tok.ranks)
    write_atomic(paths["tokenizer.json"], tok_json)
    # written last: AutoTokenizer reads it first, so a folder with it names files that are all there
    write_atomic(paths["tokenizer_config.json"], (json.dumps(cfg, indent=2, ensure_ascii=False) + "\n").encode())
    shim = paths.pop(REMOTE_CODE_FILE)
    if remote_code:
        write_atomic(shim, _SHIM.encode("utf-8"))
        paths[REMOTE_CODE_FILE] = shim
    else:
        remove_own_shim(shim)
    return list(paths.values())


def remove_own_shim(path: str) -> None:
    """A shim left by an earlier `remote_code=True` save is removed (the config no longer names it); a file of
    that name with other content is the user's and stays."""
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() != _SHIM:
                return
        os.unlink(path)
    except (OSError, UnicodeDecodeError):
        pass


def register_tokenizer(config_class) -> None:
    """Make `AutoTokenizer` give K3TokenizerFast for `config_class` and for `tokenizer_class: K3TokenizerFast`
    in tokenizer_config.json. Safe to call again."""
    AutoTokenizer.register(config_class, tokenizer_class=K3TokenizerFast, exist_ok=True)


# ----------------------------------------------------------------------------------------------- the class


def _ranks_of(backend) -> dict[bytes, int]:
    """tiktoken ranks of a byte-level BPE backend (its vocabulary ids are the ranks)."""
    char_to_byte = byte_level_decoder()
    try:
        return {bytes(char_to_byte[c] for c in token): i for token, i in backend.get_vocab(with_added_tokens=False)
                .items()}
    except KeyError:
        raise ValueError("the tokenizer's vocabulary is not byte-level (a token outside the ByteLevel alphabet); "
                         "it is not an openk3 tokenizer") from None


class K3TokenizerFast(PreTrainedTokenizerFast):
    """The HF tokenizer of an openk3/K3 tokenizer folder: the ids of `openk3.tokenizer.Tokenizer` for every text,
    and `apply_chat_template` rendering K3's XTML chat format (`openk3.chat.xtml`) segment by segment.

    K3 has no Jinja template (`chat_template` stays None): XTML tokenises each segment on its own, with the
    control tokens recognised only in the structural ones, which a template rendered to one string cannot say.
    """

    # openk3's rank file: lets from_pretrained build the backend from a folder that has no tokenizer.json yet
    vocab_files_names = {"tokenizer_file": "tokenizer.json", "vocab_file": "tiktoken.model"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # openk3's HF `special` flags as the files give them (tokenizer_config.json's added_tokens_decoder over
        # tokenizer.json's): skip_special_tokens keeps the ids flagged false (`<|open|>`, `<|close|>`, `<|sep|>`)
        added = self.added_tokens_decoder
        self._kept_on_skip = frozenset(i for i, token in added.items() if not token.special)
        # ...while for encoding every added token is a control token: marked special in the backend, whatever the
        # files say (transformers' own save writes the flags above into tokenizer.json), so that
        # split_special_tokens=True and XTML's text segments encode every name as ordinary text
        if self._kept_on_skip:
            self._tokenizer.add_special_tokens([AddedToken(added[i].content, special=True, normalized=False)
                                                for i in sorted(self._kept_on_skip)])

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        tokenizer_file, vocab_file = kwargs.get("tokenizer_file"), kwargs.get("vocab_file")
        if tokenizer_file is not None and os.path.isfile(tokenizer_file):
            return kwargs  # __init__ reads tokenizer.json as it is (pre-tokenizer included)
        if isinstance(vocab_file, str) and os.path.isfile(vocab_file):
            # transformers' own tiktoken converter would use GPT-4's regex, not K3's: build it here
            from tokenizers import Tokenizer as BackendTokenizer

            tok = Tokenizer.from_dir(os.path.dirname(vocab_file))
            kwargs = {k: v for k, v in kwargs.items() if k not in ("tokenizer_file", "vocab_file")}
            kwargs["tokenizer_object"] = BackendTokenizer.from_str(json.dumps(tokenizer_json(tok)))
            return kwargs
        return super().convert_to_native_format(trust_remote_code=trust_remote_code, **kwargs)

    # ------------------------------------------------------------------------------------------- openk3 twin

    def to_openk3(self) -> Tokenizer:
        """The `openk3.tokenizer.Tokenizer` with the same ids (ranks from the vocabulary, specials and their HF
        `special` flags from the added tokens)."""
        added = self.added_tokens_decoder
        specials = {token.content: i for i, token in added.items()}
        flags = {token.content: i not in self._kept_on_skip for i, token in added.items()
                 if token.content != reserved_name(i)}
        config = {k: str(getattr(self, k)) for k in NAMED_TOKENS if getattr(self, k) is not None}
        return Tokenizer(_ranks_of(self.backend_tokenizer), specials, special_flags=flags, config=config)

    def _save_pretrained(self, save_directory, file_names, legacy_format=None, filename_prefix=None):
        """After transformers' save (tokenizer.json, and tokenizer_config.json without the added tokens): put
        openk3's `added_tokens_decoder` back into the config and write `tiktoken.model`, so that openk3 reads the
        saved folder too (before any push_to_hub upload, which follows this hook)."""
        files = super()._save_pretrained(save_directory, file_names, legacy_format, filename_prefix)
        tok = self.to_openk3()
        config_path = file_names[0]
        with open(config_path, encoding="utf-8") as fh:
            written = json.load(fh)
        cfg = tokenizer_config(tok.special_ids, tok.special_flags, {**written, "tokenizer_class": HF_CLASS_NAME})
        write_atomic(config_path, (json.dumps(cfg, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
        ranks_path = os.path.join(os.fspath(save_directory), (filename_prefix + "-" if filename_prefix else "")
                                  + "tiktoken.model")
        write_tiktoken_ranks(ranks_path, tok.ranks)
        return (*files, ranks_path)

    # ------------------------------------------------------------------------------------------- encoding

    def _encode_pieces(self, pieces: list[str], allow_special: bool) -> list[list[int]]:
        """Backend ids of each piece; special names become their ids only with `allow_special`."""
        backend = self._tokenizer
        # transformers leaves the backend's padding/truncation as the last call set them (and sets them again on
        # every call): pieces must come back whole
        if backend.padding is not None:
            backend.no_padding()
        if backend.truncation is not None:
            backend.no_truncation()
        before = backend.encode_special_tokens
        backend.encode_special_tokens = not allow_special
        try:
            return [e.ids for e in backend.encode_batch(pieces, add_special_tokens=False)]
        finally:
            backend.encode_special_tokens = before

    def encode_exact(self, texts: Iterable[str], allow_special: bool) -> list[list[int]]:
        """openk3's `Tokenizer.encode(text, allow_special)` of each text: cut like openk3 (`encode_chunks`), each
        piece encoded on its own."""
        texts = list(texts)
        pieces, owner = [], []
        for k, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"encode expects str, got {type(text).__name__}")
            for piece in encode_chunks(text):
                pieces.append(piece)
                owner.append(k)
        out: list[list[int]] = [[] for _ in texts]
        for k, ids in zip(owner, self._encode_pieces(pieces, allow_special) if pieces else []):
            out[k].extend(ids)
        return out

    @staticmethod
    def _cut_by_openk3(text) -> bool:
        """True when openk3 encodes `text` in pieces or fixes surrogates in it, where the whole-text encoding of
        `tokenizers` may differ (or fail). Only a surrogate scan for texts of <= 25,000 chars."""
        if not isinstance(text, str):
            return False
        pieces = encode_chunks(text)
        return next(pieces, "") != text or next(pieces, None) is not None

    def _encode_plus(self, text, text_pair=None, **kwargs):
        batch = [text] if isinstance(text, str) else text
        if (text_pair is not None or kwargs.get("is_split_into_words") or kwargs.get("sanitize_control_tokens")
                or not isinstance(batch, (list, tuple)) or not all(isinstance(t, str) for t in batch)
                or not any(self._cut_by_openk3(t) for t in batch)):
            return super()._encode_plus(text, text_pair, **kwargs)
        return self._encode_cut(batch, batched=not isinstance(text, str), **kwargs)

    def _encode_cut(self, batch: list[str], batched: bool, add_special_tokens: bool = True,
                    padding_strategy=None, truncation_strategy=None, max_length: int | None = None,
                    pad_to_multiple_of: int | None = None, padding_side: str | None = None, return_tensors=None,
                    return_attention_mask: bool | None = None, split_special_tokens: bool | None = None,
                    **kwargs) -> BatchEncoding:
        """`_encode_plus` for texts openk3 encodes in pieces: ids from `encode_exact`; only ids and the attention
        mask (offsets, overflow and token-level outputs need the one `tokenizers` encoding it does not have)."""
        wanted = [k for k in ("return_offsets_mapping", "return_overflowing_tokens", "return_special_tokens_mask",
                              "return_length", "return_token_type_ids") if kwargs.get(k)]
        if wanted:
            raise ValueError(f"{', '.join(wanted)} is not available for a text that openk3 encodes in pieces (a run "
                             "of more than 25,000 whitespace or non-whitespace characters, more than 400,000 "
                             "characters, or lone surrogates); ask for input_ids / attention_mask only")
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        ids = self.encode_exact(batch, allow_special=not split)
        if add_special_tokens:
            bos = [self.bos_token_id] if self.add_bos_token and self.bos_token_id is not None else []
            eos = [self.eos_token_id] if self.add_eos_token and self.eos_token_id is not None else []
            ids = [bos + x + eos for x in ids]
        if truncation_strategy not in (None, TruncationStrategy.DO_NOT_TRUNCATE) and max_length is not None:
            ids = [x[:max_length] if self.truncation_side == "right" else x[-max_length:] for x in ids]
        return self.pad({"input_ids": ids if batched or return_tensors else ids[0]}, padding=padding_strategy or False,
                        max_length=max_length, pad_to_multiple_of=pad_to_multiple_of, padding_side=padding_side,
                        return_attention_mask=return_attention_mask, return_tensors=return_tensors)

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False, **kwargs) -> list[str]:
        if pair is None and self._cut_by_openk3(text):
            split = kwargs.get("split_special_tokens", self.split_special_tokens)
            return self.convert_ids_to_tokens(self.encode_exact([text], allow_special=not split)[0])
        return super().tokenize(text, pair, add_special_tokens, **kwargs)

    # ------------------------------------------------------------------------------------------- decoding

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if skip_special_tokens:
            # openk3 and K3 drop only the ids whose HF `special` flag is true: `<|open|>`, `<|close|>`, `<|sep|>`
            # stay. The backend's own skipping would drop every added token (all special there, see __init__).
            skip = self.added_tokens_decoder.keys() - self._kept_on_skip
            ids = [token_ids] if isinstance(token_ids, int) else token_ids
            token_ids = [i for i in ids if i not in skip]
        return super()._decode(token_ids, skip_special_tokens=False, **kwargs)

    # ------------------------------------------------------------------------------------------- chat

    def segment_ids(self, segments: Iterable[Segment]) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of XTML segments, as `openk3.chat.xtml.encode_segments` gives them with openk3's
        tokenizer: each segment on its own, control tokens recognised only in structural ones."""
        segments = list(segments)
        encoded: list[list[int] | None] = [None] * len(segments)
        for structural in (True, False):
            picked = [k for k, s in enumerate(segments) if s.structural == structural]
            for k, ids in zip(picked, self.encode_exact([segments[k].text for k in picked], structural)):
                encoded[k] = ids
        ids = [i for piece in encoded for i in piece]
        mask = [int(s.train) for s, piece in zip(segments, encoded) for _ in piece]
        return ids, mask

    def apply_chat_template(self, conversation, tools=None, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, *, documents=None, chat_template: str | None = None,
                            continue_final_message: bool = False, padding=False, truncation: bool = False,
                            max_length: int | None = None, return_tensors=None,
                            return_assistant_tokens_mask: bool = False, tokenizer_kwargs: dict | None = None,
                            sanitize_control_tokens: bool = True, **kwargs):
        """Render `conversation` (OpenAI-style messages, or a list of such conversations) in K3's XTML format.

        Returns, as transformers 5 does, a dict with input_ids and attention_mask (and `assistant_masks`: XTML's
        loss mask, with `return_assistant_tokens_mask`); the ids alone with `return_dict=False`; the prompt text
        with `tokenize=False`. `add_generation_prompt` defaults to false, as transformers' does (a training
        example gets no trailing assistant header); pass True to prompt the model (`xtml.render`'s default).
        Other keyword arguments go into the XTML request: thinking / enable_thinking, thinking_effort /
        reasoning_effort, tool_choice, response_format, response_schema, image_prompts, chat_template_kwargs.
        Text in messages and tools never yields a control id (`sanitize_control_tokens` is always on).
        Raises ValueError for what K3's format has no place for (a Jinja `chat_template`, `documents`,
        `continue_final_message`) and for requests `render` refuses.
        """
        if chat_template is not None:
            raise ValueError("K3 has no Jinja chat template: apply_chat_template renders XTML (openk3.chat.xtml); "
                             "leave chat_template unset")
        if documents:
            raise ValueError("K3's chat format has no place for documents; put them in a message")
        if continue_final_message:
            raise ValueError("continue_final_message is not supported by K3's chat format: render the conversation "
                             "with add_generation_prompt=True and append the prefill ids yourself")
        if tokenizer_kwargs:
            raise ValueError(f"tokenizer_kwargs are not supported (got {sorted(tokenizer_kwargs)}): XTML fixes how "
                             "each segment is encoded")
        if not sanitize_control_tokens:
            raise ValueError("sanitize_control_tokens=False is not supported: in K3's format text never yields a "
                             "control id")
        if return_assistant_tokens_mask and not (tokenize and return_dict):
            raise ValueError("return_assistant_tokens_mask=True needs tokenize=True and return_dict=True")
        batched = isinstance(conversation, (list, tuple)) and len(conversation) > 0 and \
            all(isinstance(c, (list, tuple)) or hasattr(c, "messages") for c in conversation)
        conversations = list(conversation) if batched else [conversation]
        tools = _tool_schemas(tools)
        rendered = [render(self._request(c, tools, add_generation_prompt, kwargs)) for c in conversations]
        if not tokenize:
            texts = [render_text(segments) for segments in rendered]
            return texts if batched else texts[0]
        encoded = [self.segment_ids(segments) for segments in rendered]
        ids, masks = [e[0] for e in encoded], [e[1] for e in encoded]
        if truncation and max_length is not None:
            keep = slice(None, max_length) if self.truncation_side == "right" else slice(-max_length, None)
            ids, masks = [x[keep] for x in ids], [m[keep] for m in masks]
        out = dict(self.pad({"input_ids": ids}, padding=padding, max_length=max_length))
        if return_assistant_tokens_mask:  # padded like the ids, with 0 (padding is no assistant output)
            out["assistant_masks"] = [_pad_like(m, len(x), self.padding_side) for m, x in zip(masks, out["input_ids"])]
        if not batched and not return_tensors:
            out = {k: v[0] for k, v in out.items()}
        out = BatchEncoding(out, tensor_type=return_tensors)
        return out if return_dict else out["input_ids"]

    @staticmethod
    def _request(messages, tools, add_generation_prompt: bool, options: dict) -> dict:
        messages = getattr(messages, "messages", messages)  # transformers' Chat objects
        if isinstance(messages, tuple):
            messages = list(messages)
        return {**options, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}


def _pad_like(mask: list[int], length: int, side: str) -> list[int]:
    fill = [0] * (length - len(mask))
    return mask + fill if side == "right" else fill + mask


def _tool_schemas(tools) -> list | None:
    """Tools as JSON schemas: Python functions become theirs (transformers.utils.get_json_schema), as HF does."""
    if not tools:
        return tools
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of tool schemas or functions, got {type(tools).__name__}")
    if not any(callable(t) for t in tools):
        return list(tools)
    from transformers.utils import get_json_schema

    return [get_json_schema(t) if callable(t) else t for t in tools]
