"""K3's tokenizer: tiktoken rank-BPE over K3's pre-tokenizer regex, plus the 256-id special block.

Files (spec §7.1): `tiktoken.model` has one `base64(token_bytes) rank` line per token, ranks 0..N-1
(K3: N = 163,584); `tokenizer_config.json` names special ids in HF's `added_tokens_decoder` format.
The special block is the 256 ids N..N+255 (`openk3.tokenizer.special`), so `vocab_size` = N + 256.

Encoding a text, exactly as K3's tokenizer class does:
    1. the text is cut into 400,000-character slices;
    2. each slice is cut wherever a run of whitespace or of non-whitespace (Python's `str.isspace`)
       grows past 25,000 characters (the run is cut every 25,000 characters; a piece may hold several
       runs) -- `split_long_runs`;
    3. in a piece that is not valid UTF-8, surrogate pairs are joined and lone surrogates become
       U+FFFD, as tiktoken does;
    4. with special-token recognition on, every one of the 256 special names found in a piece becomes
       its id (leftmost first); the text between them, or the whole piece when recognition is off, is
       pre-tokenised with the K3 regex and each regex piece is rank-BPE encoded: a piece that is itself
       a token is that token, otherwise start from single bytes and repeatedly merge the adjacent pair
       whose concatenation has the lowest rank (leftmost on ties) until no adjacent pair is a token.

Two implementations share steps 1-3: the fast one runs step 4 in tiktoken's Rust core (built offline
from the local ranks), the slow one in plain Python over the `regex` module's V1 mode (the only mode
in which `regex` reads `&&` as class intersection). They give the same ids except on characters that
tiktoken's Unicode tables (16.0 in tiktoken 0.14) do not yet assign but `regex`'s newer ones do --
17,559 code points with `regex` 2026.11 (e.g. CJK Extension J, U+323B0..), which tiktoken treats as
unassigned; the one *re-categorised* character that matters, U+0295 (Ll for tiktoken, Lo for
`regex`), is pinned to tiktoken's reading in the slow twin's pattern. `tests/test_tokenizer.py`
proves the equality on everything else.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping

from openk3.fsutil import write_atomic
from openk3.tokenizer.special import k3_special_flags, k3_special_tokens, parse_tokenizer_config, tokenizer_config

__all__ = [
    "K3_PAT_STR", "MAX_ENCODE_CHARS", "MAX_RUN_CHARS", "Tokenizer", "bpe_encode_piece", "encode_chunks",
    "load_tiktoken_ranks", "pretokenize", "split_long_runs", "write_tiktoken_ranks",
]

MAX_ENCODE_CHARS = 400_000  # K3 class: tiktoken handles <= 400k chars per call without panicking
MAX_RUN_CHARS = 25_000  # K3 class: longest run of whitespace / non-whitespace per call (tiktoken issue 195)

_AND = "&" * 2  # class intersection: Rust regex (tiktoken) and `regex` in V1 mode
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_NOT_LETTER_OR_DIGIT = r"[^\r\n\p{L}\p{N}]?"


def _k3_pattern(upper_excluded: str = "") -> str:
    upper = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + _AND + r"[^\p{Han}" + upper_excluded + "]]"
    lower = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + _AND + r"[^\p{Han}]]"
    return "|".join([
        r"[\p{Han}]+",
        _NOT_LETTER_OR_DIGIT + upper + "*" + lower + "+" + _CONTRACTIONS,
        _NOT_LETTER_OR_DIGIT + upper + "+" + lower + "*" + _CONTRACTIONS,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ])


#: K3's pre-tokenizer regex, verbatim (tiktoken `pat_str`).
K3_PAT_STR = _k3_pattern()
# The slow twin's pattern: U+0295 is Ll in tiktoken's Unicode tables but Lo in `regex`'s; keep it out
# of the upper-case class so both engines split it alike.
_PY_PAT_STR = _k3_pattern("\u0295")


@functools.lru_cache(maxsize=1)
def _py_regex():
    import regex

    return regex.compile(_PY_PAT_STR, regex.V1)


def pretokenize(text: str) -> list[str]:
    """The K3 regex pieces of `text` (one segment: no slicing, no special tokens), via `regex` V1."""
    return _py_regex().findall(text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _fix_surrogates(text: str) -> str:
    """What tiktoken does to text that is not valid UTF-8: pair surrogates, lone ones -> U+FFFD."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@functools.lru_cache(maxsize=8)
def _long_run_regex(max_run: int) -> re.Pattern:
    # stdlib `re`'s \s is exactly str.isspace(); the look-behinds anchor each try at a run start, so
    # the scan stays linear in the text length.
    n = max_run + 1
    return re.compile(rf"(?<!\S)\S{{{n},}}|(?<!\s)\s{{{n},}}")


_WHITESPACE = re.compile(r"\s")
_NON_WHITESPACE = re.compile(r"\S")


def _may_have_long_run(text: str, max_run: int) -> bool:
    """Cheap necessary test: a run of more than `max_run` chars covers a whole aligned window of
    max_run // 2 chars, so if every such window holds both kinds of character there is no long run."""
    h = max(1, max_run // 2)
    for pos in range(0, len(text) - h + 1, h):
        end = pos + h
        if _WHITESPACE.search(text, pos, end) is None or _NON_WHITESPACE.search(text, pos, end) is None:
            return True
    return False


def split_long_runs(text: str, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """Cut `text` so that no piece has a run of more than `max_run` whitespace or non-whitespace chars.

    Same pieces as the K3 class's `_split_whitespaces_or_nonwhitespaces` (a per-character loop): a
    run longer than `max_run` is cut after every `max_run` characters of the run; shorter runs are
    never cut. The empty string gives `[""]`, like the original.
    """
    if max_run < 1:
        raise ValueError(f"max_run must be >= 1, got {max_run}")
    if len(text) <= max_run or not _may_have_long_run(text, max_run):
        return [text]
    cuts = []
    for m in _long_run_regex(max_run).finditer(text):
        cuts.extend(range(m.start() + max_run, m.end(), max_run))
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def encode_chunks(text: str, max_chars: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS) -> Iterator[str]:
    """Steps 1-3 of encoding (module docstring): the pieces each of which is encoded on its own."""
    for i in range(0, len(text), max_chars):
        for piece in split_long_runs(text[i:i + max_chars], max_run):
            yield _fix_surrogates(piece)


def bpe_encode_piece(piece: bytes, ranks: Mapping[bytes, int]) -> list[int]:
    """tiktoken rank-BPE of one pre-tokenised piece, written plainly (quadratic in the piece length)."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]


# ----------------------------------------------------------------------------------------------- files


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read a `tiktoken.model` (`base64(token_bytes) rank` per line; blank lines ignored).

    Raises ValueError naming the file and line for: a line without exactly two fields, bad base64,
    an empty token, a rank that is not a non-negative integer, a duplicate rank or token, ranks that
    are not exactly 0..N-1 (N = number of tokens), and a missing single byte (byte-level BPE needs
    all 256).
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the rank file ({e.strerror or e})") from None
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    line_of_token: dict[bytes, int] = {}
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{lineno}: expected 'base64(token) rank', got {len(fields)} field(s)")
        b64, rank_text = fields
        try:
            token = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{path}:{lineno}: bad base64 {b64[:40].decode('ascii', 'replace')!r}") from None
        if not token:
            raise ValueError(f"{path}:{lineno}: empty token")
        if not rank_text.isdigit():
            raise ValueError(f"{path}:{lineno}: rank {rank_text[:40].decode('ascii', 'replace')!r} is not a "
                             "non-negative integer")
        rank = int(rank_text)
        if rank in line_of_rank:
            raise ValueError(f"{path}:{lineno}: duplicate rank {rank} (first on line {line_of_rank[rank]})")
        if token in line_of_token:
            raise ValueError(f"{path}:{lineno}: duplicate token {token!r} (first on line {line_of_token[token]})")
        ranks[token] = rank
        line_of_rank[rank] = lineno
        line_of_token[token] = lineno
    n = len(ranks)
    if n == 0:
        raise ValueError(f"{path}: no ranks in the file")
    if max(line_of_rank) != n - 1:
        bad = min((line, r) for r, line in line_of_rank.items() if r >= n)
        missing = next(r for r in range(n) if r not in line_of_rank)
        raise ValueError(f"{path}:{bad[0]}: rank {bad[1]} breaks contiguity: {n} tokens must have ranks "
                         f"0..{n - 1} (rank {missing} is missing)")
    for b in range(256):
        if bytes([b]) not in ranks:
            raise ValueError(f"{path}: byte 0x{b:02x} has no rank (byte-level BPE needs all 256 single bytes)")
    return ranks


def write_tiktoken_ranks(path: str, ranks: Mapping[bytes, int]) -> None:
    """Write `ranks` as a `tiktoken.model` in rank order, atomically (temp file + rename)."""
    lines = [base64.b64encode(tok) + b" " + str(rank).encode() + b"\n"
             for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    write_atomic(path, b"".join(lines))


# ----------------------------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """tiktoken rank-BPE + K3 regex + a contiguous block of special tokens after the ranks.

    `Tokenizer(ranks, special_tokens)` validates: ranks exactly 0..N-1 with all 256 single bytes,
    special ids exactly N..N+len(special_tokens)-1 (no gaps, no collision with a rank), names unique
    and none a prefix of another (so leftmost-first matching is unambiguous). With
    `special_tokens=None` the K3 layout is used: 256 ids with the named tokens at K3's offsets.
    `special_flags` (HF `special` per name, used by `decode(skip_special=True)`) defaults to K3's flags
    for K3's names and True for any other.

    backend: "auto" (tiktoken if importable, else pure Python), "tiktoken" or "python".
    """

    def __init__(self, ranks: Mapping[bytes, int], special_tokens: Mapping[str, int] | None = None, *,
                 special_flags: Mapping[str, bool] | None = None, config: Mapping | None = None,
                 backend: str = "auto", name: str = "openk3", max_encode_chars: int = MAX_ENCODE_CHARS,
                 max_run_chars: int = MAX_RUN_CHARS):
        ranks = dict(ranks)
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise ValueError(f"ranks must be exactly 0..{n - 1}")
        if any(not isinstance(t, bytes) or not t for t in ranks):
            raise ValueError("every token must be non-empty bytes")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(f"byte 0x{missing[0]:02x} has no rank (byte-level BPE needs all 256 single bytes)")
        if special_tokens is None:
            special_tokens = k3_special_tokens(n)
        if special_flags is None:
            special_flags = k3_special_flags()
        specials = dict(sorted(special_tokens.items(), key=lambda kv: kv[1]))
        ids = list(specials.values())
        if ids != list(range(n, n + len(ids))):
            bad = next((i for k, i in enumerate(ids) if i != n + k), None)
            raise ValueError(f"special ids must be exactly {n}..{n + len(ids) - 1} (right after the {n} ranks, "
                             f"no gaps), got {bad}")
        names = sorted(specials)
        if names and not names[0]:
            raise ValueError("empty special token name")
        for a, b in zip(names, names[1:]):  # a prefix sorts right before the names it starts
            if b.startswith(a):
                raise ValueError(f"special token {a!r} is a prefix of {b!r}: matching would be ambiguous")
        if backend not in ("auto", "tiktoken", "python"):
            raise ValueError(f"backend must be 'auto', 'tiktoken' or 'python', got {backend!r}")
        self.ranks: dict[bytes, int] = ranks
        self.special_ids: dict[str, int] = specials
        self.special_flags: dict[str, bool] = {k: bool(v) for k, v in (special_flags or {}).items() if k in specials}
        self.config: dict = dict(config or {})
        self.name = name
        self.max_encode_chars = max_encode_chars
        self.max_run_chars = max_run_chars
        self._backend = backend
        self._build()

    def _build(self) -> None:
        table = [b""] * (len(self.ranks) + len(self.special_ids))
        for tok, rank in self.ranks.items():
            table[rank] = tok
        for name, i in self.special_ids.items():
            table[i] = name.encode("utf-8")
        self._id_bytes = table
        self._id_to_special = {i: name for name, i in self.special_ids.items()}
        self._enc = None
        self._special_re = None
        if self._backend == "python":
            self.backend = "python"
        else:
            try:
                import tiktoken  # noqa: F401
                self.backend = "tiktoken"
            except ImportError:
                if self._backend == "tiktoken":
                    raise
                self.backend = "python"

    # pickling: drop the compiled engines, rebuild on load
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_id_bytes", "_id_to_special", "_enc", "_special_re"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._build()

    # --------------------------------------------------------------------------------------- loading

    @classmethod
    def from_files(cls, tiktoken_model: str, tokenizer_config: str | None = None, **kwargs) -> Tokenizer:
        """Load a rank file and (optionally) a tokenizer_config.json; without one, the K3 special layout."""
        ranks = load_tiktoken_ranks(os.fspath(tiktoken_model))
        if tokenizer_config is None:
            return cls(ranks, None, **kwargs)
        path = os.fspath(tokenizer_config)
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read the tokenizer config ({e})") from None
        specials, flags, extra = parse_tokenizer_config(text, len(ranks), path)
        return cls(ranks, specials, special_flags=flags, config=extra, **kwargs)

    @classmethod
    def from_dir(cls, path: str, **kwargs) -> Tokenizer:
        """Load `path/tiktoken.model` and `path/tokenizer_config.json` (the latter may be absent)."""
        path = os.fspath(path)
        model = os.path.join(path, "tiktoken.model")
        if not os.path.isfile(model):
            raise ValueError(f"{path}: no tiktoken.model in this folder")
        cfg = os.path.join(path, "tokenizer_config.json")
        return cls.from_files(model, cfg if os.path.isfile(cfg) else None, **kwargs)

    def save(self, path: str) -> None:
        """Write `tiktoken.model` and `tokenizer_config.json` into folder `path` (created if needed)."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        write_tiktoken_ranks(os.path.join(path, "tiktoken.model"), self.ranks)
        cfg = tokenizer_config(self.special_ids, self.special_flags, self.config)
        text = json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"
        write_atomic(os.path.join(path, "tokenizer_config.json"), text.encode("utf-8"))

    # --------------------------------------------------------------------------------------- properties

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    @property
    def vocab_size(self) -> int:
        return len(self.ranks) + len(self.special_ids)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(ranks={self.n_ranks}, specials={len(self.special_ids)}, vocab_size={self.vocab_size}, "
                f"backend={self.backend!r})")

    def _named(self, key: str) -> int | None:
        value = self.config.get(key)
        if isinstance(value, dict):  # HF AddedToken serialisation
            value = value.get("content")
        return self.special_ids.get(value) if isinstance(value, str) else None

    @property
    def bos_id(self) -> int | None:
        return self._named("bos_token") if "bos_token" in self.config else self.special_ids.get("[BOS]")

    @property
    def eos_id(self) -> int | None:
        """tokenizer_config's eos ([EOS], the document terminator); chat turns end with `<|end_of_msg|>`."""
        return self._named("eos_token") if "eos_token" in self.config else self.special_ids.get("[EOS]")

    @property
    def pad_id(self) -> int | None:
        return self._named("pad_token") if "pad_token" in self.config else self.special_ids.get("[PAD]")

    @property
    def unk_id(self) -> int | None:
        return self._named("unk_token") if "unk_token" in self.config else self.special_ids.get("[UNK]")

    @property
    def stop_ids(self) -> list[int]:
        """Ids generation should stop on: `<|end_of_msg|>` and eos (spec §10.16: the files disagree)."""
        ids = [self.special_ids.get("<|end_of_msg|>"), self.eos_id]
        return sorted({i for i in ids if i is not None})

    def token_id(self, name: str | bytes) -> int:
        """Id of a special token by name (str), or of an ordinary token by its bytes."""
        table = self.ranks if isinstance(name, bytes) else self.special_ids
        try:
            return table[name]
        except KeyError:
            kind = "token bytes" if isinstance(name, bytes) else "special token"
            raise KeyError(f"no {kind} {name!r} in this tokenizer") from None

    def id_to_piece(self, token_id: int) -> bytes | str:
        """The bytes of an ordinary token, or the name (str) of a special one."""
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        if 0 <= token_id < len(self.ranks):
            return self._id_bytes[token_id]
        raise ValueError(f"token id {token_id} is outside the vocabulary 0..{self.vocab_size - 1}")

    def is_special(self, token_id: int) -> bool:
        """True for every id of the special block (control ids, whatever their HF `special` flag)."""
        return len(self.ranks) <= token_id < self.vocab_size

    # --------------------------------------------------------------------------------------- encoding

    def _tiktoken(self):
        if self._enc is None:
            import tiktoken

            self._enc = tiktoken.Encoding(name=self.name, pat_str=K3_PAT_STR, mergeable_ranks=self.ranks,
                                          special_tokens=self.special_ids)
        return self._enc

    def _chunks(self, text: str) -> Iterator[str]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return encode_chunks(text, self.max_encode_chars, self.max_run_chars)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. allow_special=False (the default, for all user/tool/content text): special
        names such as `<|open|>` are ordinary text; True (structural markers): they become their ids."""
        if self.backend == "python":
            return self.encode_slow(text, allow_special)
        enc = self._tiktoken()
        out: list[int] = []
        if allow_special:
            specials = self._special_regex()
            for chunk in self._chunks(text):
                # tiktoken matches the special names itself; naming only those present (not all 256) spares
                # it converting the whole set on every call, and gives the same ids: every match it can
                # make is one of them (no name is a prefix of another)
                found = set(specials.findall(chunk))
                out.extend(enc.encode(chunk, allowed_special=found, disallowed_special=()) if found
                           else enc.encode_ordinary(chunk))
        else:
            for chunk in self._chunks(text):
                out.extend(enc.encode_ordinary(chunk))
        return out

    def _special_regex(self) -> re.Pattern:
        if self._special_re is None:
            alternatives = sorted(self.special_ids, key=len, reverse=True)
            self._special_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        return self._special_re

    def encode_slow(self, text: str, allow_special: bool = False) -> list[int]:
        """The pure-Python twin of `encode` (regex V1 pieces + `bpe_encode_piece`); same ids, ~100x slower."""
        out: list[int] = []
        rx = _py_regex()
        ranks = self.ranks
        for chunk in self._chunks(text):
            if allow_special:
                segments = self._special_regex().split(chunk)
            else:
                segments = [chunk]
            for k, segment in enumerate(segments):
                if k % 2:  # captured special name
                    out.append(self.special_ids[segment])
                    continue
                for piece in rx.findall(segment):
                    out.extend(bpe_encode_piece(piece.encode("utf-8"), ranks))
        return out

    # --------------------------------------------------------------------------------------- decoding

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes of `ids` (special tokens as the UTF-8 of their names)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [ids] if isinstance(ids, int) else list(ids)
        table = self._id_bytes
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join([table[i] for i in ids])
        except (IndexError, TypeError):
            bad = next(i for i in ids if not isinstance(i, int) or not 0 <= i < len(table))
            raise ValueError(f"token id {bad!r} is outside the vocabulary 0..{len(table) - 1}") from None

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD. skip_special drops the ids whose
        HF `special` flag is true (so `<|open|>`, `<|close|>`, `<|sep|>` stay, as in K3)."""
        if skip_special:
            if hasattr(ids, "tolist"):
                ids = ids.tolist()
            ids = [i for i in ([ids] if isinstance(ids, int) else ids)
                   if i not in self._id_to_special or not self.special_flags.get(self._id_to_special[i], True)]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

