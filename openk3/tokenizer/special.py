"""K3's special-token block: 256 reserved ids right after the BPE ranks (spec §7.1).

K3 has 163,584 ranks (ids 0..163583) and the block 163584..163839. The named tokens sit at fixed
offsets into the block; every other id in it is `<|reserved_token_{id}|>` with the *absolute* id (the
K3 tokenizer class builds the names as `f"<|reserved_token_{i}|>"` for i in range(num_ranks,
num_ranks + 256), e.g. `<|reserved_token_163592|>`). A smaller tokenizer trained here keeps the
same offsets after its own ranks, so the XTML markers exist at every model size.

`special` is the HF `added_tokens_decoder` flag: `<|open|>`, `<|close|>`, `<|sep|>` are *not*
special (so `skip_special_tokens` keeps them), the rest are. For encoding, all 256 ids are control
tokens: recognised only when special-token recognition is on, never produced from user text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

__all__ = [
    "K3_NAMED_SPECIALS", "K3_NUM_RANKS", "NUM_RESERVED", "XTML_MARKERS", "added_tokens_decoder", "k3_special_flags",
    "k3_special_tokens", "parse_tokenizer_config", "reserved_name", "tokenizer_config",
]

K3_NUM_RANKS = 163_584
NUM_RESERVED = 256

# (offset from the first special id, name, HF "special" flag) -- spec §7.1, ids 163584 + offset.
K3_NAMED_SPECIALS: tuple[tuple[int, str, bool], ...] = (
    (0, "[BOS]", True),
    (1, "[EOS]", True),  # document terminator (tokenizer_config eos_token)
    (2, "<|end_of_msg|>", True),  # turn terminator (config.json / generation_config eos)
    (3, "<|open|>", False),
    (4, "<|close|>", False),
    (5, "<|sep|>", False),
    (6, "[start_header_id]", True),
    (7, "[end_header_id]", True),
    (9, "[EOT]", True),
    (18, "<|media_begin|>", True),
    (19, "<|media_content|>", True),
    (20, "<|media_end|>", True),
    (21, "<|media_pad|>", True),
    (65, "<osagent_mode>", True),
    (254, "[UNK]", True),
    (255, "[PAD]", True),
)

# The control tokens the XTML chat renderer emits as structure (openk3.chat.xtml.MARKERS). A
# tokenizer without one of them would encode that structure as plain bytes -- a prompt the model
# never saw, with no error -- so loading such a tokenizer_config.json is refused.
XTML_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")

# Extra keys written to tokenizer_config.json (the HF-facing part of the K3 file).
_CONFIG_DEFAULTS = {
    "bos_token": "[BOS]",
    "eos_token": "[EOS]",
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "clean_up_tokenization_spaces": False,
    "tokenizer_class": "TikTokenTokenizer",
}


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def k3_special_tokens(num_ranks: int = K3_NUM_RANKS) -> dict[str, int]:
    """All 256 special tokens (name -> id) of the K3 layout placed after `num_ranks` ranks, in id order."""
    named = {num_ranks + off: name for off, name, _ in K3_NAMED_SPECIALS}
    return {named.get(i, reserved_name(i)): i for i in range(num_ranks, num_ranks + NUM_RESERVED)}


def k3_special_flags() -> dict[str, bool]:
    """HF `special` flag of each named K3 token (reserved ones are not listed; they count as special)."""
    return {name: flag for _, name, flag in K3_NAMED_SPECIALS}


def _entry(name: str, special: bool) -> dict:
    return {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


def added_tokens_decoder(special_tokens: Mapping[str, int], flags: Mapping[str, bool] | None = None) -> dict:
    """HF `added_tokens_decoder` for the named tokens (the reserved names are implied, as in K3's file)."""
    flags = flags or {}
    return {str(i): _entry(name, bool(flags.get(name, True)))
            for name, i in sorted(special_tokens.items(), key=lambda kv: kv[1]) if name != reserved_name(i)}


def tokenizer_config(special_tokens: Mapping[str, int], flags: Mapping[str, bool] | None = None,
                     extra: Mapping | None = None) -> dict:
    """The tokenizer_config.json object: `added_tokens_decoder` plus bos/eos/pad/unk names and `extra` keys."""
    cfg = {"added_tokens_decoder": added_tokens_decoder(special_tokens, flags)}
    for key, value in {**_CONFIG_DEFAULTS, **(extra or {})}.items():
        if key == "added_tokens_decoder":
            continue
        if key.endswith("_token") and isinstance(value, str) and value not in special_tokens:
            continue  # do not name a token this tokenizer does not have
        cfg[key] = value
    return cfg


def _line_of(text: str, key: str) -> int | None:
    m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
    return text.count("\n", 0, m.start()) + 1 if m else None


def parse_tokenizer_config(text: str, num_ranks: int, path: str = "tokenizer_config.json"
                           ) -> tuple[dict[str, int], dict[str, bool], dict]:
    """Read a tokenizer_config.json text for a rank file of `num_ranks` ranks.

    Returns (special_tokens name -> id for all 256 ids of the block, `special` flags of the named ones,
    the other top-level keys). Names come from `added_tokens_decoder`; ids it does not name get
    `<|reserved_token_{id}|>`. Raises ValueError naming `path` (and the line where it can) when the
    JSON is malformed or a special id is below `num_ranks` (collides with a rank), outside the
    256-id block, or a name is used twice, and when `added_tokens_decoder` lacks one of the
    XTML_MARKERS the chat renderer needs.
    """
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to parse") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}:1: expected a JSON object at the top level, got {type(cfg).__name__}")
    decoder = cfg.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}:{_line_of(text, 'added_tokens_decoder')}: added_tokens_decoder must be an object")
    named: dict[int, str] = {}
    flags: dict[str, bool] = {}
    seen: dict[str, int] = {}
    for key, entry in decoder.items():
        where = f"{path}:{_line_of(text, key)}"
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{where}: added_tokens_decoder key {key!r} is not an integer id") from None
        if isinstance(entry, str):
            entry = {"content": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
            raise ValueError(f"{where}: added_tokens_decoder[{key!r}] needs a non-empty string 'content'")
        name = entry["content"]
        if token_id < num_ranks:
            raise ValueError(f"{where}: special token {name!r} id {token_id} collides with a BPE rank "
                             f"(the rank file has ranks 0..{num_ranks - 1}; specials start at {num_ranks})")
        if token_id >= num_ranks + NUM_RESERVED:
            raise ValueError(f"{where}: special token {name!r} id {token_id} is outside the reserved block "
                             f"{num_ranks}..{num_ranks + NUM_RESERVED - 1}")
        if name in seen:
            raise ValueError(f"{where}: special token {name!r} is given two ids ({seen[name]} and {token_id})")
        seen[name] = token_id
        named[token_id] = name
        flags[name] = bool(entry.get("special", True))
    specials: dict[str, int] = {}
    for i in range(num_ranks, num_ranks + NUM_RESERVED):
        name = named.get(i, reserved_name(i))
        if name in specials:  # a named token spelled like the implied name of another reserved id
            a, b = (specials[name], i) if specials[name] in named else (i, specials[name])
            raise ValueError(f"{path}:{_line_of(text, str(a))}: special token {name!r} (id {a}) clashes with "
                             f"the reserved name of id {b}")
        specials[name] = i
    missing = [m for m in XTML_MARKERS if m not in specials]
    if missing:
        raise ValueError(f"{path}: added_tokens_decoder lacks the chat control token(s) {', '.join(missing)}: "
                         f"K3's chat format needs {', '.join(XTML_MARKERS)} as special ids (without them the "
                         "prompt structure would be encoded as plain text)")
    extra = {k: v for k, v in cfg.items() if k != "added_tokens_decoder"}
    for key in NAMED_TOKENS:
        _check_named_token(extra, key, specials, f"{path}:{_line_of(text, key)}")
    return specials, flags, extra


#: Config fields that name a special token (`Tokenizer.bos_id` / `eos_id` / `pad_id` / `unk_id` look them up).
NAMED_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _check_named_token(cfg: dict, key: str, specials: dict[str, int], where: str) -> None:
    """`cfg[key]`, when given, must be null or name a special token (a string or HF's {"content": ...}): a name
    the tokenizer lacks would leave that id None, silently (no eos: generation never stops at it)."""
    value = cfg.get(key)
    name = value.get("content") if isinstance(value, dict) else value
    if value is None or (isinstance(name, str) and name in specials):
        return
    if not isinstance(name, str):
        raise ValueError(f"{where}: {key} must be a special token's name (a string), null or "
                         f"{{\"content\": NAME}}, got {value!r:.80}")
    named = [n for n in specials if not n.startswith("<|reserved_token_")]
    raise ValueError(f"{where}: {key} {name!r} is not a special token of this tokenizer (its named specials: "
                     f"{', '.join(named[:12])}{', ...' if len(named) > 12 else ''})")
