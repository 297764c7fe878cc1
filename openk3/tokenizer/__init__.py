"""K3's tokenizer (tiktoken rank-BPE + K3 regex + 256 special ids) and small ones trained offline.

    from openk3.tokenizer import Tokenizer
    tok = Tokenizer.from_dir("path")        # tiktoken.model + tokenizer_config.json
    ids = tok.encode("Hello", allow_special=False); tok.decode(ids)

    from openk3.tokenizer import train_bpe
    tok = train_bpe(texts, vocab_size=8192, out_dir="tok8k")   # 7936 ranks + K3's 256-id block

`train_bpe` needs HF `tokenizers` (imported when called); encoding needs `regex` and, for speed,
`tiktoken` (without it the pure-Python twin is used).
"""

from openk3.tokenizer.bpe import (
    K3_PAT_STR,
    MAX_ENCODE_CHARS,
    MAX_RUN_CHARS,
    Tokenizer,
    bpe_encode_piece,
    encode_chunks,
    load_tiktoken_ranks,
    pretokenize,
    split_long_runs,
    write_tiktoken_ranks,
)
from openk3.tokenizer.special import K3_NAMED_SPECIALS, K3_NUM_RANKS, NUM_RESERVED, k3_special_tokens
from openk3.tokenizer.train import train_bpe

__all__ = [
    "K3_NAMED_SPECIALS", "K3_NUM_RANKS", "K3_PAT_STR", "MAX_ENCODE_CHARS", "MAX_RUN_CHARS", "NUM_RESERVED",
    "Tokenizer", "bpe_encode_piece", "encode_chunks", "k3_special_tokens", "load_tiktoken_ranks", "pretokenize",
    "split_long_runs", "train_bpe", "write_tiktoken_ranks",
]
