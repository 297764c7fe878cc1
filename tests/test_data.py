"""Pretraining data: sources, the tokenised shard cache, packing with document boundaries, bits per byte."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from openk3.data import (
    DataConfig,
    PackedLoader,
    TokenSplit,
    bits_per_byte,
    build_dataset,
    builtin_corpus,
    dataset_key,
    eval_batches,
    evaluate_bpb,
    iter_texts,
)
from openk3.tokenizer import Tokenizer, train_bpe
from openk3.tokenizer.files import tokenizer_fingerprint

# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(builtin_corpus(300_000), 1024)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """~300 short documents: stdlib prose paragraphs, plus Unicode and special-token names as plain text."""
    paras = [p for p in "\n\n".join(builtin_corpus(400_000)).split("\n\n") if 20 <= len(p) <= 300]
    extra = ["héllo wörld ✓ 日本語のテキスト", "a literal [EOS] and <|im_end|> are just text", "x"]
    return extra + paras[:300]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, docs) -> str:
    path = tmp_path_factory.mktemp("src") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tok, jsonl):
    cfg = DataConfig(source=jsonl, val_fraction=0.1)
    return build_dataset(cfg, tok, tmp_path_factory.mktemp("cache"), progress=False)


def _cfg_hash_is_val(text: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") < fraction * 2.0**64


def _doc_of(split: TokenSplit, pos: np.ndarray) -> np.ndarray:
    return np.searchsorted(split.doc_offsets, pos, side="right") - 1


# ---------------------------------------------------------------------------------------------- sources


def test_config_is_validated():
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig(val_fraction=0.0)
    with pytest.raises(ValueError, match="max_bytes"):
        DataConfig(max_bytes=0)
    with pytest.raises(TypeError):
        DataConfig("builtin")  # keyword-only
    with pytest.raises(ValueError, match="no such file"):
        list(iter_texts(DataConfig(source="/nonexistent/data.txt")))


def test_sources_txt_jsonl_folder(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_bytes(b"line one\r\nline two\n\xff end")  # CRLF kept, bad byte -> U+FFFD
    (root / "sub" / "a.jsonl").write_text('{"text": "j1"}\n\n{"text": null}\n{"text": "j2 \\ud800"}\n'
                                          '{"text": ""}\n')
    (root / "sub" / "c.txt").write_text("c doc")
    (root / ".hidden.txt").write_text("never")
    (root / "notes.md").write_text("ignored kind")
    texts = list(iter_texts(DataConfig(source=str(root))))
    assert texts == ["line one\r\nline two\n\ufffd end", "j1", "j2 \ufffd", "c doc"]
    # comma-separated paths keep their order; a file and a folder mix
    texts = list(iter_texts(DataConfig(source=f"{root / 'sub' / 'c.txt'}, {root / 'b.txt'}")))
    assert texts[0] == "c doc" and texts[1].startswith("line one")
    # configurable field
    (tmp_path / "f.jsonl").write_text('{"body": "B1"}\n{"body": "B2"}\n')
    assert list(iter_texts(DataConfig(source=str(tmp_path / "f.jsonl"), text_field="body"))) == ["B1", "B2"]
    with pytest.raises(ValueError, match=r"f\.jsonl:1: .*'text'"):
        list(iter_texts(DataConfig(source=str(tmp_path / "f.jsonl"))))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        list(iter_texts(DataConfig(source=str(tmp_path / "bad.jsonl"))))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unknown kind"):
        list(iter_texts(DataConfig(source=str(tmp_path / "x.csv"))))


def test_max_bytes_cuts_the_stream(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["aaaa", "ééé", "zzzz"]))
    texts = list(iter_texts(DataConfig(source=str(tmp_path / "a.jsonl"), max_bytes=7)))
    assert texts == ["aaaa", "é"]  # 4 + 2 bytes; the next 'é' would make 8
    assert sum(len(t.encode()) for t in iter_texts(DataConfig(max_bytes=10_000))) == 10_000


def test_optional_packages_missing_give_clear_errors(tmp_path, monkeypatch, tok):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "state.json").write_text("{}")
    (hf / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"t\.parquet.*pip install pyarrow"):
        build_dataset(DataConfig(source=str(tmp_path / "t.parquet")), tok, tmp_path / "cache", progress=False)
    with pytest.raises(ImportError, match=r"save_to_disk.*pip install datasets"):
        build_dataset(DataConfig(source=str(hf)), tok, tmp_path / "cache", progress=False)
    assert not os.listdir(tmp_path / "cache") or all(e.endswith(".lock") for e in os.listdir(tmp_path / "cache"))


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["p1", None, "p2"], "n": [1, 2, 3]}), tmp_path / "t.parquet")
    assert list(iter_texts(DataConfig(source=str(tmp_path / "t.parquet")))) == ["p1", "p2"]


def test_hf_save_to_disk_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["h1", "h2"]}).save_to_disk(str(tmp_path / "hf"))
    assert list(iter_texts(DataConfig(source=str(tmp_path / "hf")))) == ["h1", "h2"]


# ---------------------------------------------------------------------------------------------- shards


def test_shards_decode_back_to_the_documents(built, tok, docs):
    ds = built
    assert ds.train.tokens.dtype == np.uint16 and isinstance(ds.train.tokens, np.memmap)
    assert ds.val.num_docs >= 1 and ds.train.num_docs >= 1
    want = {"train": [d for d in docs if not _cfg_hash_is_val(d, 0.1)],
            "val": [d for d in docs if _cfg_hash_is_val(d, 0.1)]}
    for split in (ds.train, ds.val):
        texts = want[split.name]
        assert split.num_docs == len(texts)
        assert split.doc_offsets[0] == 0 and split.doc_offsets[-1] == split.num_tokens
        for i, text in enumerate(texts):
            ids = split.document(i)
            assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
            assert tok.decode(ids) == text + "[EOS]"
            assert int(split.token_bytes[ids].sum()) == len(text.encode())  # exact byte accounting
        assert split.num_bytes == sum(len(t.encode()) for t in texts)
        assert split.bytes_per_token == split.num_bytes / split.num_tokens


def test_validation_split_never_empty(tmp_path, tok):
    (tmp_path / "two.jsonl").write_text('{"text": "first document"}\n{"text": "second document"}\n')
    ds = build_dataset(DataConfig(source=str(tmp_path / "two.jsonl"), val_fraction=1e-9), tok, tmp_path / "c",
                       progress=False)
    assert ds.train.num_docs == 1 and ds.val.num_docs == 1
    got = sorted(tok.decode(s.document(0)[:-1]) for s in (ds.train, ds.val))
    assert got == ["first document", "second document"]
    ds = build_dataset(DataConfig(source=str(tmp_path / "two.jsonl"), val_fraction=1 - 1e-12), tok, tmp_path / "c",
                       progress=False)  # the other way round: train keeps one
    assert ds.train.num_docs == 1 and ds.val.num_docs == 1
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(ValueError, match="at least 2"):
        build_dataset(DataConfig(source=str(tmp_path / "one.txt")), tok, tmp_path / "c", progress=False)
    assert not [e for e in os.listdir(tmp_path / "c") if ".tmp-" in e]


def test_builtin_source_builds(tmp_path, tok):
    ds = build_dataset(DataConfig(max_bytes=200_000), tok, tmp_path, progress=False)
    assert ds.train.num_bytes + ds.val.num_bytes == 200_000
    assert ds.val.num_docs >= 1


def test_cache_is_reused_without_tokenising(tmp_path, tok, jsonl, monkeypatch):
    cfg = DataConfig(source=jsonl, val_fraction=0.1)
    first = build_dataset(cfg, tok, tmp_path, progress=False)

    def boom(*a, **k):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(tok, "encode", boom)
    second = build_dataset(cfg, tok, tmp_path, progress=False, verify=True)
    assert second.path == first.path and np.array_equal(second.train.tokens, first.train.tokens)
    assert os.path.basename(first.path) == dataset_key(cfg, tok)
    # every ingredient of the key matters
    keys = {dataset_key(c, tok) for c in (cfg, DataConfig(source=jsonl, val_fraction=0.2),
                                         DataConfig(source=jsonl, val_fraction=0.1, max_bytes=1000),
                                         DataConfig(source=jsonl, val_fraction=0.1, text_field="id"))}
    assert len(keys) == 4
    ranks = dict(tok.ranks)
    a, b = (t for t, r in ranks.items() if r in (300, 301))
    ranks[a], ranks[b] = ranks[b], ranks[a]
    assert tokenizer_fingerprint(Tokenizer(ranks)) != tokenizer_fingerprint(tok)


def test_changed_input_is_rebuilt(tmp_path, tok, docs):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:50]))
    cfg = DataConfig(source=str(src), val_fraction=0.1)
    first = build_dataset(cfg, tok, tmp_path / "c", progress=False)
    with open(src, "a") as fh:
        fh.write(json.dumps({"text": "one more document"}) + "\n")
    second = build_dataset(cfg, tok, tmp_path / "c", progress=False)
    assert second.path != first.path
    assert second.train.num_docs + second.val.num_docs == first.train.num_docs + first.val.num_docs + 1


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_interrupted_or_damaged_builds_are_never_used(tmp_path, tok, jsonl, monkeypatch):
    cfg = DataConfig(source=jsonl, val_fraction=0.1)
    cache = tmp_path / "c"
    key = dataset_key(cfg, tok)
    real_encode = tok.encode
    calls = []
    armed = [True]

    def dies_midway(text, *a, **k):
        calls.append(1)
        if armed[0] and len(calls) == 40:
            raise KeyboardInterrupt
        return real_encode(text, *a, **k)

    monkeypatch.setattr(tok, "encode", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(cfg, tok, cache, progress=False)
    armed[0] = False
    assert [e for e in os.listdir(cache) if not e.endswith(".lock")] == []  # no final folder, temp removed
    # a killed builder's temp folder (dead pid) is cleared by the next build
    stale = cache / f".{key}.tmp-{_dead_pid()}-deadbeef"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\0" * 10)
    calls.clear()
    good = build_dataset(cfg, tok, cache, progress=False)
    assert len(calls) > 0 and not stale.exists()
    reference = np.array(good.train.tokens)
    final = good.path
    del good

    def damage_then_rebuild(damage, verify=False):
        damage()
        calls.clear()
        ds = build_dataset(cfg, tok, cache, progress=False, verify=verify)
        assert len(calls) > 0, "a damaged cache was used"
        assert np.array_equal(np.array(ds.train.tokens), reference)

    def truncate():
        with open(os.path.join(final, "train.bin"), "r+b") as fh:
            fh.truncate(os.path.getsize(fh.name) - 2)

    def flip_last_eos():  # same size, a document no longer ends in EOS
        with open(os.path.join(final, "val.bin"), "r+b") as fh:
            fh.seek(-2, os.SEEK_END)
            fh.write(b"\x00\x00")

    def flip_middle():  # same size, caught only by the checksums
        with open(os.path.join(final, "train.bin"), "r+b") as fh:
            fh.seek(20)
            byte = fh.read(1)
            fh.seek(20)
            fh.write(bytes([byte[0] ^ 1]))

    damage_then_rebuild(truncate)
    damage_then_rebuild(lambda: os.remove(os.path.join(final, "meta.json")))
    damage_then_rebuild(lambda: open(os.path.join(final, "meta.json"), "w").write("{"))
    damage_then_rebuild(flip_last_eos)
    damage_then_rebuild(flip_middle, verify=True)
    assert sorted(e for e in os.listdir(cache) if not e.endswith(".lock")) == [key]


# ---------------------------------------------------------------------------------------------- packing


def _check_rows(split: TokenSplit, batch, starts, T):
    ids, labels, seg = batch["input_ids"].numpy(), batch["labels"].numpy(), batch["seg"].numpy()
    assert ids.shape == labels.shape == seg.shape == (len(starts), T)
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["seg"].dtype == torch.long
    stream = np.asarray(split.tokens, dtype=np.int64)
    for b, s in enumerate(starts):
        n = min(T + 1, split.num_tokens - s)  # real ids in the window
        window = stream[s:s + n]
        assert np.array_equal(ids[b, :n - 1], window[:n - 1])
        assert np.all(np.diff(seg[b]) >= 0) and seg[b, 0] == 0
        doc = _doc_of(split, np.arange(s, s + n))
        m = min(n, T)
        assert np.array_equal(seg[b, :m], doc[:m] - doc[0])
        assert np.all(seg[b, m:] == doc[-1] - doc[0] + 1)  # padding of a partial window: a segment of its own
        for t in range(T):
            if t + 1 < n and doc[t + 1] == doc[t]:
                assert labels[b, t] == window[t + 1]
            else:
                assert labels[b, t] == -100
                if t + 1 < n:  # a true boundary: the input is the EOS ending a document
                    assert window[t] == split.tokens[split.doc_offsets[doc[t] + 1] - 1]
        # -100 exactly at the boundaries inside the window
        boundaries = int(np.sum(np.isin(np.arange(s + 1, s + n), split.doc_offsets)))
        assert int(np.sum(labels[b] == -100)) == boundaries + (T - (n - 1))


def test_packed_rows_carry_document_boundaries(built):
    split, B, T = built.train, 4, 32
    loader = PackedLoader(split, B, T, seed=3)
    crossings = 0
    for step in range(6):
        windows = loader.order(0)[step * B:(step + 1) * B]
        batch = loader.next()
        _check_rows(split, batch, (windows * T).tolist(), T)
        crossings += int((batch["seg"][:, -1] > 0).sum())
    assert crossings > 0, "short documents: some rows must pack several"


def test_epochs_are_permutations_and_deterministic(built):
    split, B, T = built.train, 8, 16
    loader = PackedLoader(split, B, T, seed=5)
    W = loader.num_windows
    steps = W // B
    seen = [loader.next()["input_ids"] for _ in range(steps)]
    rows = torch.cat(seen)
    assert loader.epoch == 0 and rows.shape[0] == steps * B
    starts = (loader.order(0)[:steps * B] * T).tolist()
    assert len(set(starts)) == len(starts)
    loader.next()
    assert loader.epoch == 1 and loader.position == B
    again = PackedLoader(split, B, T, seed=5)
    assert all(torch.equal(again.next()["input_ids"], x) for x in seen[:5])
    other = PackedLoader(split, B, T, seed=6)
    assert not torch.equal(other.next()["input_ids"], seen[0])
    assert not np.array_equal(loader.order(0), loader.order(1))


@pytest.mark.parametrize("stop", [3, 100])  # mid-epoch, and across the epoch boundary
def test_exact_resume(built, stop):
    split, B, T = built.train, 8, 16
    a = PackedLoader(split, B, T, seed=1)
    for _ in range(stop):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))
    assert {"epoch", "position", "seed"} <= set(state)
    expected = [a.next() for _ in range(5)]
    b = PackedLoader(split, B, T, seed=999)
    b.load_state_dict(state)
    for want in expected:
        got = b.next()
        assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="seq_len"):
        PackedLoader(split, B, T + 1).load_state_dict(state)


def test_ranks_are_disjoint_and_cover_the_global_batch(built):
    split, B, T, world = built.train, 3, 16, 3
    single = PackedLoader(split, B * world, T, seed=2)
    ranks = [PackedLoader(split, B, T, seed=2, rank=r, world_size=world) for r in range(world)]
    for _ in range(4):
        whole = single.next()
        parts = [r.next() for r in ranks]
        for k in whole:
            assert torch.equal(torch.cat([p[k] for p in parts]), whole[k])
    with pytest.raises(ValueError, match="rank"):
        PackedLoader(split, B, T, rank=3, world_size=3)


def test_eval_batches_cover_the_split_once(built):
    split, B, T = built.val, 3, 16
    batches = list(eval_batches(split, B, T))
    N = split.num_tokens
    windows = math.ceil((N - 1) / T)
    assert len(batches) == math.ceil(windows / B)
    for i, batch in enumerate(batches):
        real = [w * T for w in range(i * B, min((i + 1) * B, windows))]
        assert batch["input_ids"].shape == (B, T)
        _check_rows(split, {k: v[:len(real)] for k, v in batch.items()}, real, T)
        assert torch.all(batch["labels"][len(real):] == -100)
    labels = torch.cat([b["labels"] for b in batches])
    scored = int((labels != -100).sum())
    assert scored == (N - 1) - (split.num_docs - 1)  # every position once, minus the document starts
    assert len(list(eval_batches(split, B, T, max_batches=2))) == 2
    split_ranks = [list(eval_batches(split, B, T, rank=r, world_size=2)) for r in range(2)]
    interleaved = [split_ranks[i % 2][i // 2] for i in range(len(batches))]
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(interleaved, batches))


# ---------------------------------------------------------------------------------------------- bits per byte


def test_bits_per_byte_arithmetic():
    assert bits_per_byte(8 * math.log(2), 8) == pytest.approx(1.0)
    assert bits_per_byte(3.0, 2) == pytest.approx(3.0 / math.log(2) / 2)
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)


class _Uniform(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids, *, seg_BT=None):
        assert seg_BT is not None and seg_BT.shape == ids.shape
        return torch.zeros(*ids.shape, self.vocab, dtype=torch.float64) + self.w


def test_evaluate_bpb_counts_exactly_the_scored_bytes(built, tok):
    split = built.val
    out = evaluate_bpb(_Uniform(tok.vocab_size), split, 4, 16)
    labels = torch.cat([b["labels"] for b in eval_batches(split, 4, 16)])
    scored = labels[labels != -100].numpy()
    assert out["tokens"] == len(scored)
    assert out["bytes"] == int(split.token_bytes[scored].sum())
    assert out["loss"] == pytest.approx(math.log(tok.vocab_size))
    assert out["bpb"] == pytest.approx(len(scored) * math.log(tok.vocab_size) / math.log(2) / out["bytes"])
    # without the per-id table the average bytes per token stands in
    plain = TokenSplit(split.name, split.tokens, split.doc_offsets, split.num_bytes)
    approx = evaluate_bpb(_Uniform(tok.vocab_size), plain, 4, 16, max_batches=2)
    assert approx["bytes"] == pytest.approx(plain.bytes_per_token * approx["tokens"])


def test_packed_loss_equals_separate_documents(built, tok):
    """End to end: the loss of a packed batch equals the documents' losses computed one by one."""
    from openk3.config import nano
    from openk3.model.model import K3ForCausalLM

    model = K3ForCausalLM.build(nano().replace(vocab_size=tok.vocab_size), dtype=torch.float64, seed=0).eval()
    split, B, T = built.train, 2, 48
    loader = PackedLoader(split, B, T, seed=0)
    batch = next(b for b in (loader.next() for _ in range(200)) if int(b["seg"][:, -1].min()) >= 1)
    # (both rows pack at least two documents)
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        logits = model(batch["input_ids"], seg_BT=batch["seg"])
        packed = ce(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="none").view(B, T)
        leaky = model(batch["input_ids"])  # no seg: attention/state cross documents
        separate = torch.zeros(B, T, dtype=torch.float64)
        for b in range(B):
            for d in batch["seg"][b].unique().tolist():
                cols = (batch["seg"][b] == d).nonzero().flatten()
                alone = model(batch["input_ids"][b:b + 1, cols])[0]
                separate[b, cols] = ce(alone, batch["labels"][b, cols], reduction="none")
    torch.testing.assert_close(packed, separate, rtol=1e-9, atol=1e-9)
    assert packed.sum() > 0
    assert not torch.allclose(leaky, logits, atol=1e-6), "seg must matter for the check to mean anything"
