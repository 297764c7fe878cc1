"""Engine prefix snapshots (openk3/infer/prefix.py): a request that starts from a stored prefix, or from the
state a finished turn left, computes what a fresh prefill computes (float64: log-probs to 1e-10, the same
tokens); the store's limits, lookup rules and argument checks."""

from __future__ import annotations

import pytest
import torch

from openk3.config import preset
from openk3.infer.engine import Engine
from openk3.infer.prefix import PrefixCache, clone_cache
from openk3.infer.sample import SamplingParams
from openk3.model.model import K3ForCausalLM

F64 = torch.float64


@pytest.fixture(scope="module")
def model64():
    # nano's layout (KDA and MLA layers) in float64: no near-tie can flip a greedy token
    return K3ForCausalLM.build(preset("nano"), dtype=F64, seed=0).eval()


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, prompt: list[int], n: int = 6, **kw):
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=0)
    engine.add_request(prompt, params, ignore_eos=True, **kw)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == 1
    return outs[0]


def logprobs(out) -> list[float]:
    return [lp for lp, _ in out.logprobs]


def assert_same(got, ref) -> None:
    assert got.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(logprobs(got), logprobs(ref), strict=True)) < 1e-10


def test_a_shared_prefix_is_prefilled_once_and_continues_exactly(model64):
    head = ids(23, 0)
    plain = Engine(model64, max_num_seqs=2, prefill_chunk=8)
    cached = Engine(model64, max_num_seqs=2, prefill_chunk=8, prefix_cache=4)
    tails = (ids(9, 1), ids(1, 2), ids(14, 3))
    for k, tail in enumerate(tails):
        prompt = head + tail
        got = run(cached, prompt, cache_prefix=len(head))
        assert_same(got, run(plain, prompt))
        assert cached.stats["prompt_tokens"] == len(head) + sum(len(t) for t in tails[:k + 1])  # the head once
    assert cached.stats["cached_prompt_tokens"] == 2 * len(head)
    assert cached.prefix.stats["hits"] == 2 and len(cached.prefix) == 1


def test_prompts_that_branch_like_a_tree_snapshot_at_every_branch_point(model64):
    """Several cache_prefix lengths (the rollout's branch points: tool declarations shared by all, an effort's
    system message shared by a cell): each request starts from the deepest stored one it passes, prefills the
    rest exactly, and a point its own hit passed or one already stored is not stored again."""
    from openk3.posttrain.trainers.rollout import shared_prefixes

    tools, low, high = ids(19, 50), ids(7, 51), ids(5, 52)
    prompts = [tools + low + ids(4, 53), tools + low + ids(6, 54), tools + high + ids(3, 55), tools + high + ids(9, 56)]
    points = shared_prefixes(prompts)
    assert points == [(19, 26), (19, 26), (19, 24), (19, 24)]
    plain = Engine(model64, max_num_seqs=2, prefill_chunk=8)
    cached = Engine(model64, max_num_seqs=2, prefill_chunk=8, prefix_cache=8)
    for p, k in zip(prompts, points, strict=True):
        assert_same(run(cached, p, cache_prefix=k), run(plain, p))
    # the tools once, each effort's message once, each problem's own tail
    assert cached.stats["prompt_tokens"] == 19 + 7 + 4 + 6 + 5 + 3 + 9
    assert cached.stats["cached_prompt_tokens"] == 26 + 19 + 24
    assert len(cached.prefix) == 3 and cached.prefix.stats["stored"] == 3
    # with one snapshot per prompt at its longest shared prefix the high prompts miss the low ones' snapshot
    one = Engine(model64, max_num_seqs=2, prefill_chunk=8, prefix_cache=8)
    for p, k in zip(prompts, points, strict=True):
        run(one, p, cache_prefix=k[-1])
    assert one.stats["prompt_tokens"] == 19 + 7 + 4 + 6 + 19 + 5 + 3 + 9
    assert shared_prefixes([[1, 2, 3], [1, 2, 3], [4, 5], [1, 2, 9]]) == [(2, 3), (2, 3), (), (2,)]
    assert shared_prefixes([[1]]) == [()] and shared_prefixes([]) == []


def test_a_finished_turn_continues_with_only_the_new_tokens_prefilled(model64):
    prompt = ids(17, 4)
    plain = Engine(model64, max_num_seqs=2, prefill_chunk=16)
    cached = Engine(model64, max_num_seqs=2, prefill_chunk=16, prefix_cache=4)
    first = run(cached, prompt, n=7, keep_cache=True)
    assert_same(first, run(plain, prompt, n=7))
    # the next turn: the whole sequence so far (the last sampled token was never fed) plus tool output
    turn2 = prompt + first.token_ids + ids(11, 5)
    before = cached.stats["prompt_tokens"]
    second = run(cached, turn2, n=5, keep_cache=True)
    assert_same(second, run(plain, turn2, n=5))
    assert cached.stats["prompt_tokens"] - before == 1 + 11  # the last sampled token and the tool output
    turn3 = turn2 + second.token_ids + ids(3, 6)
    assert_same(run(cached, turn3, n=4), run(plain, turn3, n=4))


def test_snapshots_in_a_busy_batch_equal_fresh_prefills(model64):
    """Requests join a batch that is decoding, slots move, some share a head and some continue a turn."""
    head = ids(13, 7)
    prompts = [head + ids(k + 2, 10 + k) for k in range(5)]
    plain = Engine(model64, max_num_seqs=3, prefill_chunk=5)
    cached = Engine(model64, max_num_seqs=3, prefill_chunk=5, prefix_cache=8)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    for k, p in enumerate(prompts):
        cached.add_request(p, params, request_id=f"r{k}", ignore_eos=True, cache_prefix=len(head), keep_cache=True)
    got = {}
    while cached.has_unfinished():
        got.update({o.request_id: o for o in cached.step() if o.finished})
    for k, p in enumerate(prompts):
        assert_same(got[f"r{k}"], run(plain, p))
        follow = p + got[f"r{k}"].token_ids + ids(4, 20 + k)
        assert_same(run(cached, follow, n=3), run(plain, follow, n=3))


def test_the_store_keeps_limits_and_never_returns_the_whole_prompt(model64):
    eng = Engine(model64, max_num_seqs=1, prefix_cache=2)
    a, b, c = ids(6, 30), ids(6, 31), ids(6, 32)
    for p in (a, b, c):
        run(eng, p + [1, 2], n=1, cache_prefix=len(p))
    assert len(eng.prefix) == 2 and a not in eng.prefix and b in eng.prefix and c in eng.prefix
    assert eng.prefix.stats["evicted"] == 1
    assert eng.prefix.lookup(b) is None  # a prompt equal to a key leaves nothing to prefill
    k, snap = eng.prefix.lookup(b + [9])
    assert k == len(b) and snap.seq_len == len(b)
    snap.layers[0].tensors()[1].add_(1.0)  # lookups hand out copies: the stored state is untouched
    k2, again = eng.prefix.lookup(b + [9])
    assert not torch.equal(again.layers[0].tensors()[1], snap.layers[0].tensors()[1])
    small = PrefixCache(max_entries=8, max_bytes=1)
    small.put(b, clone_cache(snap))  # larger than the whole budget: not stored
    assert len(small) == 0


def test_arguments_are_checked_and_hints_are_free_without_a_cache(model64):
    with pytest.raises(ValueError, match="prefix_cache must be >= 0"):
        Engine(model64, prefix_cache=-1)
    cached = Engine(model64, prefix_cache=2)
    for bad in (0, 5, 9, [2, 5], [True], ["3"]):
        with pytest.raises(ValueError, match="cache_prefix must be in 1..4"):
            cached.add_request(ids(5, 40), cache_prefix=bad)
    with pytest.raises(ValueError, match="max_entries"):
        PrefixCache(max_entries=0)
    off = Engine(model64)
    out = run(off, ids(9, 41), cache_prefix=4, keep_cache=True)
    assert out.finished and off.prefix is None and off.stats["cached_prompt_tokens"] == 0
