"""openk3.infer.sample: sampling params, filters, repetition penalty, seeded and batched sampling."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.infer import (
    SamplingParams,
    apply_repetition_penalty,
    filter_logits,
    make_generator,
    sample_batch,
    sample_next,
)
from openk3.infer.sample import sampling_logits, token_logprobs

NEG_INF = float("-inf")


def _logits_from_probs(p):
    return torch.tensor([math.log(v) for v in p], dtype=torch.float32)


def _kept(x: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


# ---- parameters ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.0),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("logprobs", -1),
        ("logprobs", True),
        ("logprobs", 1.0),
    ],
)
def test_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_frozen_kw_only():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (1.0, 0, 1.0, 0.0, 1.0)
    assert p.seed is None and p.max_tokens == 256 and p.stop == () and p.logprobs is None
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # kw_only
    with pytest.raises(AttributeError):
        p.temperature = 0.0  # frozen
    SamplingParams(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, max_tokens=1, stop=("</s>",))


# ---- greedy -------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_ties_lowest_and_consumes_no_rng():
    g = make_generator(0)
    state = g.get_state().clone()
    p = SamplingParams(temperature=0.0)
    assert sample_next(torch.tensor([1.0, 5.0, 5.0, 2.0]), p, g) == 1
    assert sample_next(torch.tensor([NEG_INF, -3.0, -3.0, -7.0]), p, g) == 1
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert sample_next(x, p, g) == int(torch.argmax(x))
    # greedy ignores the truncation knobs
    assert sample_next(x, SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5), g) == int(x.argmax())
    assert torch.equal(g.get_state(), state)


# ---- filters ------------------------------------------------------------------------------------------------


def test_temperature_scaling():
    x = torch.tensor([1.0, 2.0, 3.0, -4.0])
    torch.testing.assert_close(filter_logits(x, SamplingParams(temperature=2.0)), x / 2)
    torch.testing.assert_close(filter_logits(x, SamplingParams(temperature=0.5)), x * 2)
    torch.testing.assert_close(filter_logits(x, SamplingParams()), x)
    # softmax(x / T): T -> small sharpens, larger flattens
    p_sharp = torch.softmax(filter_logits(x, SamplingParams(temperature=0.25)), -1)
    p_flat = torch.softmax(filter_logits(x, SamplingParams(temperature=4.0)), -1)
    assert p_sharp[2] > torch.softmax(x, -1)[2] > p_flat[2]


def test_filter_is_fp32_and_does_not_mutate():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    before = x.clone()
    out = filter_logits(x, SamplingParams(temperature=0.5, top_k=2))
    assert out.dtype == torch.float32
    assert torch.equal(x, before)


def test_top_k_keeps_exactly_k():
    x = torch.tensor([0.1, 3.0, 2.0, -1.0, 5.0])
    assert _kept(filter_logits(x, SamplingParams(top_k=2))) == {1, 4}
    assert _kept(filter_logits(x, SamplingParams(top_k=1))) == {4}
    assert _kept(filter_logits(x, SamplingParams(top_k=10))) == set(range(5))
    y = torch.randn(500, generator=torch.Generator().manual_seed(2))
    for k in (1, 7, 50, 499):
        out = filter_logits(y, SamplingParams(top_k=k))
        assert len(_kept(out)) == k
        assert _kept(out) == set(torch.topk(y, k).indices.tolist())
        torch.testing.assert_close(out[torch.isfinite(out)], y[torch.isfinite(out)])  # survivors unchanged


def test_top_p_minimal_nucleus():
    x = _logits_from_probs([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (0), 0.05 (2)
    assert _kept(filter_logits(x, SamplingParams(top_p=0.45))) == {1}
    assert _kept(filter_logits(x, SamplingParams(top_p=0.75))) == {1, 3}
    assert _kept(filter_logits(x, SamplingParams(top_p=0.9))) == {1, 3, 0}
    assert _kept(filter_logits(x, SamplingParams(top_p=0.97))) == {0, 1, 2, 3}
    assert _kept(filter_logits(x, SamplingParams(top_p=1.0))) == {0, 1, 2, 3}
    # top_p applies after temperature: T -> large flattens to ~uniform, so 0.6 needs 3 of 4
    assert len(_kept(filter_logits(x, SamplingParams(top_p=0.6, temperature=1e4)))) == 3


def test_top_p_never_empties():
    x = _logits_from_probs([0.25, 0.25, 0.25, 0.25])
    assert len(_kept(filter_logits(x, SamplingParams(top_p=1e-9)))) == 1
    y = torch.tensor([NEG_INF, 2.0, NEG_INF])
    assert _kept(filter_logits(y, SamplingParams(top_p=1e-6))) == {1}
    z = torch.tensor([0.0, 100.0, 0.0])  # one token with all the mass
    assert _kept(filter_logits(z, SamplingParams(top_p=0.5))) == {1}
    g = make_generator(3)
    for _ in range(20):
        assert sample_next(z, SamplingParams(top_p=1e-9), g) == 1


def test_min_p_hand_example():
    x = _logits_from_probs([0.25, 0.6, 0.05, 0.1])
    # threshold 0.2 * 0.6 = 0.12: keep 0.6 and 0.25
    assert _kept(filter_logits(x, SamplingParams(min_p=0.2))) == {0, 1}
    # threshold 0.1 * 0.6 = 0.06: also 0.1
    assert _kept(filter_logits(x, SamplingParams(min_p=0.1))) == {0, 1, 3}
    assert _kept(filter_logits(x, SamplingParams(min_p=0.99))) == {1}  # the max always survives


def test_filters_compose_in_order():
    x = _logits_from_probs([0.4, 0.3, 0.2, 0.1])
    # top-k 3 -> renormalised [4/9, 3/9, 2/9]; top-p 0.7 -> {0, 1}; min-p 0.8 -> 3/7 < 0.8 * 4/7, keep {0}
    assert _kept(filter_logits(x, SamplingParams(top_k=3, top_p=0.7))) == {0, 1}
    assert _kept(filter_logits(x, SamplingParams(top_k=3, top_p=0.7, min_p=0.8))) == {0}


# ---- repetition penalty -------------------------------------------------------------------------------------


def test_repetition_penalty_hand_example():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    out = apply_repetition_penalty(x, [0, 1, 0, 4], 2.0)  # duplicates penalised once; 0.0 stays 0
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0]))
    assert torch.equal(x, torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0]))  # input untouched
    out = apply_repetition_penalty(x, torch.tensor([3, 1]), 0.5)  # < 1 encourages
    torch.testing.assert_close(out, torch.tensor([2.0, -0.5, 0.5, 6.0, 0.0]))
    torch.testing.assert_close(apply_repetition_penalty(x, [], 3.0), x)
    torch.testing.assert_close(apply_repetition_penalty(x, [0, 1], 1.0), x)


def test_repetition_penalty_changes_greedy_choice():
    x = torch.tensor([3.0, 2.0, -1.0])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_next(x, p, None) == 0
    assert sample_next(x, p, None, seen_ids=[0]) == 1  # 3 / 2 = 1.5 < 2


# ---- seeded sampling ----------------------------------------------------------------------------------------


def _draw(seed, n=64, params=None):
    params = params or SamplingParams(temperature=0.9, top_k=40)
    x = torch.randn(200, generator=torch.Generator().manual_seed(5))
    g = make_generator(seed)
    return [sample_next(x, params, g) for _ in range(n)]


def test_same_seed_same_sequence_different_seed_differs():
    assert _draw(1234) == _draw(1234)
    assert _draw(1234) != _draw(4321)
    a, b = make_generator(None), make_generator(None)
    assert a.initial_seed() != b.initial_seed()


def test_empirical_distribution_matches_filtered_softmax():
    x = torch.randn(12, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.95, min_p=0.02)
    expected = torch.softmax(filter_logits(x, params), -1).double()
    g = make_generator(2024)
    n = 20_000
    counts = torch.zeros(12, dtype=torch.float64)
    for _ in range(n):
        counts[sample_next(x, params, g)] += 1
    kept = expected > 0
    assert counts[~kept].sum() == 0  # filtered tokens are never drawn
    assert kept.sum() >= 3  # the test is not degenerate
    exp_counts = expected[kept] * n
    chi2 = float(((counts[kept] - exp_counts) ** 2 / exp_counts).sum())
    df = int(kept.sum()) - 1
    assert chi2 < 3 * df + 15, (chi2, df)  # well beyond the 99.99% quantile for df <= 7


# ---- batched ------------------------------------------------------------------------------------------------


def test_batched_equals_per_row_and_ignores_batch_composition():
    V = 300
    gen = torch.Generator().manual_seed(9)
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0, seed=2),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3, seed=4),
    ]
    steps = [torch.randn(len(params), V, generator=gen) for _ in range(16)]

    gens_b = [make_generator(p.seed) for p in params]
    seen_b = [[] for _ in params]
    gens_r = [make_generator(p.seed) for p in params]
    seen_r = [[] for _ in params]
    for logits in steps:
        toks = sample_batch(logits, params, gens_b, seen_b)
        for b, t in enumerate(toks):
            seen_b[b].append(t)
        for b, p in enumerate(params):
            t = sample_next(logits[b], p, gens_r[b], seen_r[b])
            seen_r[b].append(t)
    assert seen_b == seen_r

    # row 2 alone, with the same per-step logits, gets the same tokens as inside the batch
    g = make_generator(params[2].seed)
    alone = [sample_batch(logits[2:3], params[2:3], [g], None)[0] for logits in steps]
    assert alone == seen_b[2]


def test_batch_length_mismatch_raises():
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, 5), [SamplingParams()], [make_generator(0)] * 2)


# ---- log probabilities --------------------------------------------------------------------------------------


def test_token_logprobs_hand_example_ties_and_per_row_k():
    """Row 0: logits log([0.5, 0.25, 0.25]) -> exact log probabilities, the tie between ids 1 and 2 ordered by
    id; row 1 asks k=0 (the sampled token only); k beyond the vocabulary is cut to it."""
    logits = torch.tensor([[0.5, 0.25, 0.25], [1.0, 1.0, 1.0]]).log() + 3.0  # a shift changes nothing
    got = token_logprobs(logits, [2, 0], [5, 0])
    half, quarter, third = math.log(0.5), math.log(0.25), math.log(1 / 3)
    (lp0, top0), (lp1, top1) = got
    assert lp0 == pytest.approx(quarter, abs=1e-6) and lp1 == pytest.approx(third, abs=1e-6) and top1 == []
    assert [i for i, _ in top0] == [0, 1, 2]
    assert [v for _, v in top0] == pytest.approx([half, quarter, quarter], abs=1e-6)


def test_token_logprobs_are_raw_float64_and_shape_checked():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64) * 4
    ref = torch.log_softmax(logits, dim=-1)
    got = token_logprobs(logits, [7, 0, 49], [3, 1, 2])
    for row, (tok, (lp, top)) in enumerate(zip([7, 0, 49], got, strict=True)):
        assert lp == ref[row, tok].item()  # float64 logits stay float64: exact
        order = torch.argsort(ref[row], descending=True)[:len(top)].tolist()
        assert [i for i, _ in top] == order and [v for _, v in top] == ref[row, order].tolist()
    bf16 = token_logprobs(logits[:1].bfloat16(), [7], [0])  # low-precision logits are normalised in fp32
    assert bf16[0][0] == pytest.approx(torch.log_softmax(logits[:1].bfloat16().float(), -1)[0, 7].item(), abs=1e-6)
    with pytest.raises(ValueError, match="token_logprobs"):
        token_logprobs(logits, [1, 2], [0, 0])


def test_tiny_temperature_is_greedy_and_tiny_repetition_penalty_is_refused():
    """fp32 logits divided by ~1e-38 overflow to inf, and softmax makes NaN: a temperature below 1e-5 samples
    greedily (as vLLM), a repetition penalty below 0.01 is refused (the server's fuzz test found both stopping
    the engine)."""
    from openk3.infer.sample import sample_next

    for t in (1e-300, 1e-38, 9e-6):
        assert SamplingParams(temperature=t).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert sample_next(logits, SamplingParams(temperature=1e-300), torch.Generator().manual_seed(1)) == \
        int(logits.argmax())
    with pytest.raises(ValueError, match="repetition_penalty must be >= 0.01"):
        SamplingParams(repetition_penalty=0.005)
    SamplingParams(repetition_penalty=0.01)


@pytest.mark.parametrize("field, value", [("temperature", math.inf), ("repetition_penalty", math.inf),
                                          ("temperature", math.nan), ("repetition_penalty", math.nan),
                                          ("top_p", math.inf), ("min_p", -math.inf)])
def test_non_finite_sampling_values_are_refused_naming_the_field(field, value):
    """temperature=inf once sampled uniformly (logits / inf = 0), without a word."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*got {value!r}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=0.5, top_k=7, top_p=0.8, min_p=0.05,
                                                            repetition_penalty=1.3),
                                dict(temperature=1.0, min_p=0.2), dict(temperature=0, repetition_penalty=1.5),
                                dict(temperature=0)])
def test_sampling_logits_are_what_the_sampler_draws_from(dtype, kw):
    """The "processed" log-probs' logits equal the sampler's own composition, filter_logits after the repetition
    penalty (fp32), for every filter, in fp32 and bf16; greedy: after the penalty alone (raw without one)."""
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(97, generator=g)).to(dtype)
    seen = [1, 5, 5, 40, 96]
    params = SamplingParams(seed=1, **kw)
    got = sampling_logits(logits, params, seen)
    penalised = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    want = penalised if params.greedy else filter_logits(penalised, params)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if kw.get("top_k"):
        assert int(torch.isfinite(got).sum()) <= 7
    # every token the sampler draws has a finite processed log-prob
    drawn = {sample_next(logits, params, torch.Generator().manual_seed(s), seen) for s in range(40)}
    assert all(math.isfinite(torch.log_softmax(got, -1)[t].item()) for t in drawn)


def test_sampling_logits_keep_float64_values_and_the_fp32_kept_set():
    """A float64 row keeps float64 values (the penalty too), but which tokens survive the filters is decided
    in fp32 as the sampler decides it: two logits 1e-12 apart are one tie in fp32, and top_k=1 keeps the
    lower id there; in float64 the other is larger. The drawn token must not get -inf."""
    params = SamplingParams(temperature=0.7, top_k=1, seed=0)
    disagreements = 0
    for logits in (torch.tensor([1.0, 1.0 + 1e-12, -3.0, 0.25], dtype=torch.float64),
                   torch.tensor([1.0 + 1e-12, 1.0, -3.0, 0.25], dtype=torch.float64)):
        tok = sample_next(logits, params, torch.Generator().manual_seed(0))
        got = sampling_logits(logits, params)
        kept32 = torch.isfinite(filter_logits(logits.float(), params))
        assert got.dtype == torch.float64 and torch.equal(torch.isfinite(got), kept32)
        assert math.isfinite(got[tok].item()) and got[tok].item() == logits[tok].item() / 0.7
        disagreements += int(torch.argmax(logits).item() != tok)  # float64 alone would have kept the other
    assert disagreements == 1  # one of the two orders is the case float64 alone gets wrong
    pen = SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=0)
    x = torch.tensor([2.0, -1.0, 0.1], dtype=torch.float64) / 3
    got = sampling_logits(x, pen, [0, 1])
    want = torch.stack([x[0] / 1.3, x[1] * 1.3, x[2]]) / 0.7
    assert got.dtype == torch.float64 and torch.equal(got, want)
