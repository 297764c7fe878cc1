"""The model's forward in pieces (`K3Model.embed` / `run_layers` / `output`), pipeline stages built from them,
and activation checkpointing applied from outside (`openk3.parallel.ac`); one process, float64, exact."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import nano_cut, perturb

from openk3.model.model import K3ForCausalLM
from openk3.parallel.ac import apply_activation_checkpointing, checkpointed
from openk3.parallel.pipeline import StageModule, bank_rows, stage_bounds

B, T = 2, 13  # T odd and below KDA's chunk: the padded chunk path


def _model(attn_res: bool = True, layers: int = 6) -> K3ForCausalLM:
    """nano cut to `layers` (KDA + MLA, dense + MoE; two AttnRes blocks at 6), perturbed (`helpers.perturb`)."""
    cfg = nano_cut(layers)
    if not attn_res:
        cfg = cfg.replace(attn_res_block_size=None)
    return perturb(K3ForCausalLM.build(cfg, dtype=torch.float64, seed=0))


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _seg() -> torch.Tensor:
    """Document index of packed rows: row 0 holds three documents, row 1 one."""
    return torch.stack([torch.tensor([0] * 5 + [1] * 6 + [2] * 2), torch.zeros(T, dtype=torch.long)])


def _splits(model) -> list[list[int]]:
    """Every set of cuts: at the AttnRes block boundaries, or at any layer without AttnRes."""
    cfg = model.config
    allowed = [i for i in range(1, cfg.num_hidden_layers)
               if cfg.attn_res_block_size is None or i % cfg.attn_res_block_size == 0]
    return [list(c) for r in range(len(allowed) + 1) for c in itertools.combinations(allowed, r)]


# ---- the forward in pieces ------------------------------------------------------------------------

@pytest.mark.parametrize("attn_res", [True, False], ids=["attnres", "plain"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "seg"])
def test_pieces_over_any_split_equal_the_forward(attn_res, packed):
    model = _model(attn_res, layers=9 if attn_res else 6)  # AttnRes: three blocks, two boundaries
    k3, n = model.model, model.config.num_hidden_layers
    ids, seg = _ids(model.config.vocab_size), _seg() if packed else None
    with torch.no_grad():
        ref_BTD = k3(ids, seg_BT=seg)
        splits = _splits(model)
        assert len(splits) == (4 if attn_res else 32)
        for cuts in splits:
            x_BTD, blocks = k3.embed(ids), []
            for start, end in zip([0, *cuts], [*cuts, n]):
                x_BTD, blocks = k3.run_layers(start, end, x_BTD, blocks, seg_BT=seg)
                assert len(blocks) + 1 == bank_rows(model.config, end)  # what a stage boundary would carry
            assert torch.equal(k3.output(x_BTD, blocks), ref_BTD), cuts
    if packed:  # the document index matters here, or the test would prove nothing about passing it
        assert not torch.equal(ref_BTD, k3(ids))


@pytest.mark.parametrize("attn_res", [True, False], ids=["attnres", "plain"])
def test_stage_chains_reproduce_the_logits(attn_res):
    model = _model(attn_res, layers=9 if attn_res else 6)
    ids, seg = _ids(model.config.vocab_size, seed=1), _seg()
    everything = {id(p) for p in model.parameters()}
    layouts = [stage_bounds(model.config, pp) for pp in (2, 3)]
    layouts.append(stage_bounds(model.config, 2, (6,) if attn_res else (1,)))
    for bounds, use_seg in itertools.product(layouts, (False, True)):
        with torch.no_grad():
            ref = model(ids, seg_BT=seg if use_seg else None)
            stages = [StageModule(model, a, b) for a, b in bounds]
            x, seg_f = ids, seg.float()
            for stage, (_, end) in zip(stages[:-1], bounds):
                stage.use_seg = use_seg
                x, seg_f = stage(x, seg_f)
                assert x.shape == (bank_rows(model.config, end), B, T, model.config.hidden_size)
            stages[-1].use_seg = use_seg
            assert torch.equal(stages[-1](x, seg_f), ref), (bounds, use_seg)
        # each stage registers its own modules only (PipelineStage trains its `parameters()`); together, all
        owned = [{id(p) for p in s.parameters()} for s in stages]
        assert sum(map(len, owned)) == len(everything) and set().union(*owned) == everything, bounds
        for stage, own, (a, b) in zip(stages, owned, bounds):
            assert {id(p) for layer in model.model.layers[a:b] for p in layer.parameters()} <= own
            assert "body" not in dict(stage.named_children())  # the whole model is held, not registered


# ---- activation checkpointing ----------------------------------------------------------------------

def _loss_and_grads(model, ids, seg):
    logits = model(ids, seg_BT=seg)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_activation_checkpointing_same_loss_grads_and_names():
    plain, ac = _model(), _model()
    before = {k: v.clone() for k, v in ac.state_dict().items()}
    assert apply_activation_checkpointing(ac) is ac
    apply_activation_checkpointing(ac)  # idempotent
    assert list(ac.state_dict()) == list(before) == list(plain.state_dict())
    assert [n for n, _ in ac.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(torch.equal(v, before[k]) for k, v in ac.state_dict().items())
    assert all(layer.sublayer_wrapper is checkpointed for layer in ac.model.layers)
    ids, seg = _ids(ac.config.vocab_size), _seg()
    for s in (None, seg):
        loss0, g0 = _loss_and_grads(plain, ids, s)
        loss1, g1 = _loss_and_grads(ac, ids, s)
        assert torch.equal(loss0, loss1)
        assert sum(g is not None for g in g0.values()) > 20
        for n, g in g0.items():
            assert (g is None) == (g1[n] is None), n
            assert g is None or torch.equal(g, g1[n]), n
    assert all(torch.equal(v, before[k]) for k, v in ac.state_dict().items())


def _count_starts(module: torch.nn.Module, calls: dict, key: str) -> None:
    """calls[key] += 1 whenever `module`'s forward starts. A pre-hook: a recompute stops as soon as it has rebuilt
    what the backward needs (torch's early stop), before the module's forward hooks would run."""
    calls[key] = 0

    def hook(*_):
        calls[key] += 1

    module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("on", [False, True], ids=["plain", "ac"])
def test_activation_checkpointing_recomputes_in_the_backward(on):
    """With checkpointing a layer's attention and FFN start twice per training step (forward, then again in the
    backward), but once without grad and, for the attention, once with a decode state; without, once always."""
    model = _model()
    if on:
        apply_activation_checkpointing(model)
    calls: dict[str, int] = {}
    _count_starts(model.model.layers[1].self_attn, calls, "kda")
    _count_starts(model.model.layers[1].block_sparse_moe, calls, "moe")
    _count_starts(model.model.layers[3].self_attn, calls, "mla")
    ids = _ids(model.config.vocab_size)
    logits = model(ids)
    assert calls == {"kda": 1, "moe": 1, "mla": 1}
    logits.square().mean().backward()
    assert calls == ({"kda": 2, "moe": 2, "mla": 2} if on else {"kda": 1, "moe": 1, "mla": 1})
    calls.update(kda=0, moe=0, mla=0)
    with torch.no_grad():
        model(ids)
    assert calls == {"kda": 1, "moe": 1, "mla": 1}
    # a decode state is updated in place (MLA appends to its cache): the attention must not re-run
    calls.update(kda=0, moe=0, mla=0)
    model(ids, cache=model.new_cache()).square().mean().backward()
    assert calls == ({"kda": 1, "moe": 2, "mla": 1} if on else {"kda": 1, "moe": 1, "mla": 1})


def test_activation_checkpointing_refusals():
    with pytest.raises(ValueError, match="no decoder layers"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))
    model = _model(layers=4)
    model.model.layers[2].sublayer_wrapper = lambda fn, *args: fn(*args)
    with pytest.raises(ValueError, match="decoder layer 2 already"):
        apply_activation_checkpointing(model)
    assert all(layer.sublayer_wrapper is not checkpointed for layer in model.model.layers)
