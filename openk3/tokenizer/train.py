"""Train a small byte-level BPE tokenizer offline, in K3's file format and special-token layout.

The trainer is HF `tokenizers` (Rust): pre-tokenizer = K3's regex (`Split`, isolated) followed by
`ByteLevel(use_regex=False)` (bytes -> GPT-2's printable stand-ins), model BPE, `BpeTrainer` seeded with
all 256 bytes. The learned vocabulary is then written as tiktoken ranks:

* the 256 single bytes get ranks 0..255 in byte order;
* every learned token gets the next rank in the order the trainer created it (HF gives each new
  token the next id, so id order is merge order);
* the 256-id special block follows the ranks with K3's offsets (`[BOS]` at +0, `<|open|>` at +3,
  ..., `[PAD]` at +255; others `<|reserved_token_{id}|>`), so XTML works at every size.

`vocab_size` is the total: ranks = vocab_size - 256 (8192 -> 7936 ranks, ids 7936..8191 special).
Rank order = merge order makes tiktoken's rank-BPE reproduce the trainer's merges: a merge learned
earlier has a lower rank, and a token is only ever created from two lower-ranked tokens. (The two
could still disagree in principle when a token is reachable by two splits, e.g. `ab`+`c` and
`a`+`bc`; on held-out stdlib text an 8192-vocab tokenizer agreed on all 213k regex pieces, and the
tests check held-out documents.) The training documents are cut like text at encode
time (400k-char slices, 25k-char runs) so the trainer sees the same segments the encoder will.
"""

from __future__ import annotations

import codecs
import os
import time
from collections.abc import Callable, Iterable, Iterator

from openk3.tokenizer.bpe import K3_PAT_STR, Tokenizer, encode_chunks
from openk3.tokenizer.special import NUM_RESERVED, k3_special_flags, k3_special_tokens

__all__ = ["byte_level_decoder", "hf_ranks", "read_text_files", "train_bpe", "train_hf_bpe"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table used by HF's ByteLevel pre-tokenizer."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_decoder() -> dict[str, int]:
    """Printable stand-in character -> byte (inverse of ByteLevel's table)."""
    return {c: b for b, c in _bytes_to_unicode().items()}


def _as_documents(texts: str | Iterable[str]) -> Iterator[str]:
    if isinstance(texts, str):
        texts = [texts]
    for doc in texts:
        if not isinstance(doc, str):
            raise TypeError(f"training texts must be str, got {type(doc).__name__}")
        yield from encode_chunks(doc)


def train_hf_bpe(texts: str | Iterable[str], n_ranks: int, min_frequency: int = 2):
    """Train HF `tokenizers` byte-level BPE with the K3 pre-tokenizer to `n_ranks` tokens (256 bytes + merges)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(K3_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_ranks, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    hf.train_from_iterator(_as_documents(texts), trainer=trainer)
    return hf


def hf_ranks(hf) -> dict[bytes, int]:
    """tiktoken ranks of a trained byte-level HF BPE: single bytes 0..255, then tokens in id (= merge) order."""
    decoder = byte_level_decoder()
    vocab = hf.get_vocab()
    singles, learned = {}, []
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        try:
            raw = bytes(decoder[c] for c in token)
        except KeyError:
            raise ValueError(f"token {token!r} is not byte-level (character outside the ByteLevel alphabet)") from None
        if len(raw) == 1:
            singles[raw] = raw[0]
        else:
            learned.append(raw)
    if len(singles) != 256:
        raise ValueError(f"the trained vocabulary has {len(singles)} single bytes, expected 256")
    ranks = dict(singles)
    for raw in learned:
        if raw in ranks:
            raise ValueError(f"token {raw!r} appears twice in the trained vocabulary")
        ranks[raw] = len(ranks)
    return ranks


def train_bpe(texts: str | Iterable[str], vocab_size: int, out_dir: str | None = None, *, min_frequency: int = 2,
              progress: Callable[[str], None] | None = None, allow_fewer: bool = False) -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` ids in all (ranks + K3's 256-id special block).

    texts: a string, or an iterable of document strings (consumed once). out_dir: if given, the
    tokenizer is saved there (`tiktoken.model` + `tokenizer_config.json`). Raises ValueError if
    `vocab_size` leaves fewer than 256 ranks or the corpus is too small to learn the requested number
    of tokens with `min_frequency` (with `allow_fewer`, the tokenizer then has the ranks the corpus
    supports, and a smaller vocabulary).
    """
    n_ranks = vocab_size - NUM_RESERVED
    if n_ranks < 256:
        raise ValueError(f"vocab_size {vocab_size} is too small: it must hold 256 byte ranks + {NUM_RESERVED} "
                         f"special ids (>= {256 + NUM_RESERVED})")
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    say(f"training byte-level BPE: {n_ranks} ranks + {NUM_RESERVED} special ids = vocab {vocab_size}")
    hf = train_hf_bpe(texts, n_ranks, min_frequency)
    ranks = hf_ranks(hf)
    if len(ranks) < n_ranks and not allow_fewer:
        raise ValueError(f"the corpus only supports {len(ranks)} ranks at min_frequency={min_frequency} "
                         f"(asked for {n_ranks}); give more text or a smaller vocab_size")
    say(f"trained {len(ranks)} ranks in {time.perf_counter() - t0:.1f} s")
    tok = Tokenizer(ranks, k3_special_tokens(len(ranks)), special_flags=k3_special_flags())
    if out_dir is not None:
        tok.save(out_dir)
        say(f"wrote {os.path.join(out_dir, 'tiktoken.model')} and tokenizer_config.json")
    return tok


def read_text_files(paths: Iterable[str], max_bytes: int | None = None) -> Iterator[str]:
    """Documents from files (folders: every file below, sorted), UTF-8 with bad bytes replaced; with
    `max_bytes`, stop after that many bytes of text (the last document is cut to fit)."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                files.extend(os.path.join(dirpath, f) for f in sorted(filenames))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"{path}: no such file or folder")
    used = 0
    for f in files:
        if max_bytes is not None and used >= max_bytes:
            return
        with open(f, "rb") as fh:
            raw = fh.read() if max_bytes is None else fh.read(max_bytes - used)
        used += len(raw)
        # final=False drops a character cut in half by the byte budget instead of turning it into U+FFFD
        text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=max_bytes is None)
        if text:
            yield text
