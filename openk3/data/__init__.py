"""Pretraining data: the built-in corpus (no download), user files, token shards, packed batches.

    from openk3.data import DataConfig, build_dataset, PackedLoader, eval_batches, evaluate_bpb
    ds = build_dataset(DataConfig(source="builtin", max_bytes=20_000_000), tokenizer, "cache/data")
    loader = PackedLoader(ds.train, batch_size=8, seq_len=1024, seed=0)
    batch = loader.next()   # input_ids, labels (-100 across documents), seg (document index per token)
    logits = model(batch["input_ids"], seg_BT=batch["seg"])
    evaluate_bpb(model, ds.val, 8, 1024)["bpb"]

See `corpus` (built-in corpus), `sources` (user data), `shards` (tokenised cache), `loader` (packing).
"""

from openk3.data.corpus import Document, builtin_corpus, describe, iter_documents
from openk3.data.loader import IGNORE_INDEX, PackedLoader, bits_per_byte, eval_batches, evaluate_bpb, make_rows
from openk3.data.shards import TokenDataset, TokenSplit, build_dataset, dataset_key
from openk3.data.sources import DataConfig, iter_texts, resolve_sources, source_identity

__all__ = [
    "IGNORE_INDEX", "DataConfig", "Document", "PackedLoader", "TokenDataset", "TokenSplit", "bits_per_byte",
    "build_dataset", "builtin_corpus", "dataset_key", "describe", "eval_batches", "evaluate_bpb", "iter_documents",
    "iter_texts", "make_rows", "resolve_sources", "source_identity",
]
