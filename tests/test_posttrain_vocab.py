"""The post-training pipeline's BPE tokenizer (openk3/posttrain/domains/vocab.py): trained on rendered train-split
conversations from its own seed stream, markers kept special, several times fewer tokens than bytes, exact
round trips."""

from __future__ import annotations

import pytest

from openk3.chat import render, render_text
from openk3.posttrain.domains.general import sft_dataset
from openk3.posttrain.domains.records import byte_tokenizer, render_record, render_request
from openk3.posttrain.domains.vocab import strip_markers, tokenizer_corpus, train_posttrain_tokenizer
from openk3.tokenizer.train import train_bpe


@pytest.fixture(scope="module")
def tok():
    return train_posttrain_tokenizer(("general",), 2048, seed=0)


def test_general_only_gives_the_ranks_its_corpus_supports(tok):
    # 2,048 asked; the general corpus supports fewer at min_frequency 2, so the vocabulary is smaller
    assert 1024 < tok.vocab_size < 2048 and tok.n_ranks == tok.vocab_size - 256
    with pytest.raises(ValueError, match="only supports"):
        train_bpe(["abc abd abe"] * 3, 600)
    assert train_bpe(["abc abd abe"] * 3, 600, allow_fewer=True).vocab_size < 600


def test_records_round_trip_and_shrink_about_fourfold(tok):
    records = sft_dataset(6, 1, "test", tokenizer=tok)  # other seed and split than the corpus
    byte = byte_tokenizer()
    ratios = []
    for r in records:
        text = render_text(render(render_request(r)))
        ids = render_record(r, tok).ids
        assert tok.decode(ids) == text  # exact, markers included
        ratios.append(len(render_record(r, byte).ids) / len(ids))
        for marker in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"):
            assert tok.special_ids[marker] in ids or marker not in text
    # general-only: ~1,370 ids; the three-domain vocabulary (2,048) measured 4-4.5x on general records
    assert min(ratios) > 2.0 and sum(ratios) / len(ratios) > 2.5, ratios


def test_the_corpus_is_its_own_seed_stream_without_markers():
    docs = tokenizer_corpus(("general",), seed=0, general_problems=12)
    assert docs == tokenizer_corpus(("general",), seed=0, general_problems=12)  # deterministic
    corpus_text = "\n".join(docs)
    # train split only: no evaluation (test split) problem is in it
    test_prompts = {r["messages"][0]["content"] for r in sft_dataset(30, 0, "test")}
    assert len(test_prompts) == 30 and not any(p in corpus_text for p in test_prompts)
    assert tokenizer_corpus(("general",), seed=1, general_problems=12) != docs
    cleaned = strip_markers(corpus_text)
    assert "<|open|>" in corpus_text and "<|open|>" not in cleaned and "<|end_of_msg|>" not in cleaned
