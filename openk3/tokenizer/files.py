"""A tokenizer as files beside a checkpoint: which files, reading them back with their paths, and the
fingerprint that says whether two tokenizers give the same ids.

    tok, files = checkpoint_tokenizer("runs/sft/checkpoints/step_000200", "SFT encodes the data with it")
    save(model, out, extra_files=files)          # the same tokenizer travels with every checkpoint
    tokenizer_fingerprint(tok)                   # keys the token cache and the reference-length memo
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

#: The files a saved tokenizer is (`Tokenizer.save`): the rank table and the special-token config.
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


def tokenizer_files(folder: str | os.PathLike) -> dict[str, str]:
    """{name: path} of the tokenizer files present in `folder` (what a checkpoint copies beside its weights)."""
    folder = Path(folder)
    return {name: str(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}


def checkpoint_tokenizer(folder: str | os.PathLike, why: str):
    """The tokenizer saved in checkpoint `folder` and its files; a ValueError naming the folder and `why` the
    model's own tokenizer is needed when it has none."""
    from openk3.tokenizer.bpe import Tokenizer

    folder = Path(folder)
    if not (folder / TOKENIZER_FILES[0]).is_file():
        raise ValueError(f"{folder}: the checkpoint has no tokenizer ({TOKENIZER_FILES[0]}); {why}")
    return Tokenizer.from_dir(str(folder)), tokenizer_files(folder)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (hex) of what decides the ids: the `tiktoken.model` bytes the tokenizer would write, its special
    ids, eos id and the encode slicing limits. Kept on the object after the first call (a K3 table hashes in
    ~0.2 s); the token cache's keys are this value, so it must not change for a given tokenizer."""
    key = getattr(tokenizer, "_openk3_fingerprint", None)
    if key is not None:
        return key
    h = hashlib.sha256()
    for tok, rank in sorted(tokenizer.ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")
    extra = {"special_ids": sorted(tokenizer.special_ids.items(), key=lambda kv: kv[1]), "eos_id": tokenizer.eos_id,
             "max_encode_chars": getattr(tokenizer, "max_encode_chars", None),
             "max_run_chars": getattr(tokenizer, "max_run_chars", None)}
    h.update(json.dumps(extra, sort_keys=True).encode())
    key = h.hexdigest()
    try:
        tokenizer._openk3_fingerprint = key
    except AttributeError:  # a tokenizer that refuses attributes is hashed each time
        pass
    return key
