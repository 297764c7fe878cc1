"""The tokenizer of a training run: the one given, the one a previous start trained into the run folder, or a
new byte-level BPE trained on the run's data; and the model config carrying that tokenizer's ids.

    tok, folder = get_tokenizer(cfg, out)                  # find_tokenizer(...) or train_tokenizer(...)
    model_cfg = with_tokenizer_ids(cfg.model, tok)          # vocab_size, eos / bos / pad of this tokenizer
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from openk3.fsutil import naming
from openk3.log import reporter
from openk3.train.config import TrainConfig


def find_tokenizer(cfg: TrainConfig, out_dir: Path):
    """(tokenizer, folder) of `cfg.tokenizer` if given, else of `<out>/tokenizer` when a previous start
    trained it; None when one has to be trained (`train_tokenizer`)."""
    from openk3.tokenizer import Tokenizer

    if cfg.tokenizer is not None:
        return Tokenizer.from_dir(cfg.tokenizer), Path(cfg.tokenizer)
    folder = out_dir / "tokenizer"
    if (folder / "tiktoken.model").is_file():
        return Tokenizer.from_dir(str(folder)), folder
    return None


def train_tokenizer(cfg: TrainConfig, out_dir: Path):
    """Train `<out>/tokenizer` on the run's data with `cfg.model.vocab_size` ids. Returns (tokenizer, folder)."""
    from openk3.data.sources import iter_texts
    from openk3.tokenizer import train_bpe

    reporter("train").info(f"training a tokenizer with vocab {cfg.model.vocab_size} on data {cfg.data.source!r}")
    folder = out_dir / "tokenizer"
    tmp = out_dir / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = train_bpe(iter_texts(cfg.data), cfg.model.vocab_size, str(tmp))
        os.replace(tmp, folder)
    except OSError as e:
        raise naming(e, folder, "writing the run's tokenizer") from e
    return tok, folder


def get_tokenizer(cfg: TrainConfig, out_dir: Path):
    """`find_tokenizer`, else `train_tokenizer`. Returns (tokenizer, folder)."""
    return find_tokenizer(cfg, out_dir) or train_tokenizer(cfg, out_dir)


def with_tokenizer_ids(model_cfg, tok):
    """`model_cfg` with the vocabulary size and the special ids of `tok` (spec §7.1: eos is the turn
    terminator `<|end_of_msg|>`; bos/pad are the tokenizer's `[BOS]`/`[PAD]`), so the checkpoint's
    config.json / generation_config.json name the ids this tokenizer really uses: a preset's ids are
    K3's layout (once the release's eos 163586 beside a 512-id vocabulary, where no other engine ever
    stopped), which a user's tokenizer need not follow. A tokenizer without `<|end_of_msg|>` gives its
    document eos."""
    eos = tok.special_ids.get("<|end_of_msg|>", tok.eos_id)
    extra = dict(model_cfg.extra, bos_token_id=tok.bos_id, pad_token_id=tok.pad_id)
    return model_cfg.replace(vocab_size=tok.vocab_size, eos_token_id=eos, extra=extra)
