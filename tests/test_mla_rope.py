"""RoPE MLA (`mla_use_nope: false`, the scaling lab's K2-style baseline; openk3/ops/rope.py).

K3's MLA is NoPE: every preset must run exactly as before, the rotation never entered. With RoPE the last
Dr dims of each query head and the shared `kpe` are rotated by position before attention and before
caching; these tests check the rotation's relative-position property, cached decode (dense and slot
caches, rows of different lengths) against one full forward, packed documents against separate runs,
the config rules, and a checkpoint round trip. Float64 throughout.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_close, perturb

import openk3
from openk3.config import K3Config, nano, preset
from openk3.infer.graph import DecodeGraph
from openk3.model.cache import SlotCache
from openk3.model.mla import GatedMLA
from openk3.model.model import K3ForCausalLM
from openk3.ops import mla as mla_ops
from openk3.ops import rope

F64 = torch.float64
EXACT = 1e-10  # float64 relative RMS error allowed for "the same computation, reorganised"


def rope_config(**changes) -> K3Config:
    """nano with every layer MLA and RoPE on the rope dims (the K2-style attention)."""
    return preset("nano").replace(**{"mla_use_nope": False, "linear_attn_config.full_attn_layers": list(range(1, 10)),
                                     "linear_attn_config.kda_layers": None, **changes})


@pytest.fixture(scope="module")
def model64():
    return perturb(K3ForCausalLM.build(rope_config(), dtype=F64, seed=0)).eval()


def _ids(B, T, seed=0):
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- the rotation ------------------------------------------------------------------------------

def test_rotation_scores_depend_only_on_position_differences():
    g = torch.Generator().manual_seed(0)
    q_1TR, k_1TR = (torch.randn(1, 7, 16, generator=g, dtype=F64) for _ in range(2))
    pos = torch.arange(7)[None]
    scores = torch.einsum("btr,bsr->bts", rope.rotate(q_1TR, pos, 10000.0), rope.rotate(k_1TR, pos, 10000.0))
    for shift in (1, 5, 1000, 123457):
        moved = torch.einsum("btr,bsr->bts", rope.rotate(q_1TR, pos + shift, 10000.0),
                             rope.rotate(k_1TR, pos + shift, 10000.0))
        assert_close(f"shift {shift}", scores, moved, 1e-9)
    # position 0 is the identity; a rotation keeps norms; other positions do change the scores
    assert torch.equal(rope.rotate(q_1TR, torch.zeros(1, 7, dtype=torch.long), 10000.0), q_1TR)
    assert torch.allclose(rope.rotate(q_1TR, pos + 3, 500.0).norm(dim=-1), q_1TR.norm(dim=-1))
    assert not torch.allclose(scores, torch.einsum("btr,bsr->bts", q_1TR, k_1TR))


def test_rotation_is_the_half_split_convention():
    """Dim i pairs with dim i + R/2 and turns by pos * theta^(-2i/R) (GPT-NeoX / transformers' rotate_half)."""
    R, theta, p = 8, 100.0, 3
    x = torch.arange(1.0, R + 1, dtype=F64)[None, None]
    got = rope.rotate(x, torch.tensor([[p]]), theta)[0, 0]
    for i in range(R // 2):
        a = torch.tensor(p * theta ** (-2 * i / R), dtype=F64)
        x1, x2 = x[0, 0, i], x[0, 0, i + R // 2]
        assert torch.allclose(got[i], x1 * a.cos() - x2 * a.sin())
        assert torch.allclose(got[i + R // 2], x2 * a.cos() + x1 * a.sin())


def test_document_positions_restart_at_each_document():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert rope.document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


def test_layer_attention_is_invariant_to_a_shift_of_all_positions(model64):
    """A RoPE layer's attention sees relative positions only: shifting every position changes nothing."""
    layer = model64.model.layers[0].self_attn
    x_BTD = torch.randn(2, 9, model64.config.hidden_size, generator=torch.Generator().manual_seed(1), dtype=F64)
    pos = torch.arange(9)[None]

    def attend(pos_BT):
        q_BTHD, ckv_BTC, kpe_BTR = layer.project(x_BTD, pos_BT)
        return mla_ops.mla_attention_naive(q_BTHD, ckv_BTC, kpe_BTR, layer.kv_b_proj.weight, v_head_dim=layer.dv,
                                           scale=layer.scale, mask_BTS=mla_ops.attention_mask(9, 9))

    with torch.no_grad():
        ref = attend(pos)
        assert_close("shift 17", ref, attend(pos + 17), 1e-9)
        assert (ref - attend(None)).abs().max() > 1e-3  # NoPE scores differ: the rotation is really there


def test_qk_clip_max_logits_see_the_rotation(model64):
    """QK-Clip's S_max (train/qk_clip.py) scores a RoPE layer as its forward does: rotated q_pe and kpe, at
    positions within each document. Reference written from the weights."""
    from openk3.train.qk_clip import mla_max_logits

    layer = model64.model.layers[0].self_attn
    H, dn, dr = layer.num_heads, layer.dn, layer.dr
    x_1TD = torch.randn(1, 10, model64.config.hidden_size, generator=torch.Generator().manual_seed(6), dtype=F64)
    seg_1T = torch.tensor([[0] * 4 + [1] * 6])
    pos_1T = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        q_1THD = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x_1TD))).view(1, 10, H, dn + dr)
        latent_1TC, kpe_1TR = layer.kv_a_proj_with_mqa(x_1TD).split([layer.kv_lora_rank, dr], dim=-1)
        k_nope_1THN = (layer.kv_a_layernorm(latent_1TC) @ layer.kv_b_proj.weight.t()).view(1, 10, H, -1)[..., :dn]
        q_pe_1THR = rope.rotate(q_1THD[..., dn:], pos_1T, layer.rope_theta)
        kpe_1TR = rope.rotate(kpe_1TR, pos_1T, layer.rope_theta)
        scores_HTS = (torch.einsum("bthn,bshn->hts", q_1THD[..., :dn], k_nope_1THN)
                      + torch.einsum("bthr,bsr->hts", q_pe_1THR, kpe_1TR)) * layer.scale
        allowed_TS = (torch.arange(10)[None, :] <= torch.arange(10)[:, None]) & (seg_1T[0, :, None] == seg_1T[0])
        ref_H = scores_HTS.masked_fill(~allowed_TS, float("-inf")).amax(dim=(1, 2))
        assert_close("S_max", ref_H, mla_max_logits(layer, x_1TD, seg_1T), 1e-12)


# ---- NoPE is untouched -------------------------------------------------------------------------

def test_nope_presets_never_enter_the_rope_path(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the RoPE path ran for a NoPE model")

    for name in ("cos_sin", "apply_rope", "rotate", "document_positions"):
        monkeypatch.setattr(rope, name, boom)
    model = K3ForCausalLM.build(nano(), dtype=F64, seed=0).eval()
    assert all(layer.self_attn.rope_theta is None for layer in model.model.layers if layer.is_mla)
    ids = _ids(2, 11)
    seg = torch.tensor([[0] * 5 + [1] * 6, [0] * 11])
    with torch.no_grad():
        model(ids)
        model(ids, seg_BT=seg)
        model(ids, mla_impl="absorbed")
        cache = model.new_cache()
        model(ids[:, :6], cache=cache)
        model(ids[:, 6:7], cache=cache)
    assert "rope_theta" not in nano().to_dict()


def test_rope_changes_every_position_but_the_first(model64):
    """The same weights without the rotation: position 0 (rotated by 0) agrees, later positions do not."""
    nope = K3ForCausalLM.build(rope_config(mla_use_nope=True), dtype=F64, seed=0).eval()
    nope.load_state_dict(model64.state_dict())
    ids = _ids(1, 8, seed=2)
    with torch.no_grad():
        a, b = model64(ids), nope(ids)
    assert_close("position 0", b[:, 0], a[:, 0], 1e-13)
    assert ((a[:, 1:] - b[:, 1:]).abs().amax(dim=-1) > 1e-6).all()


# ---- cache and documents -----------------------------------------------------------------------

@pytest.mark.parametrize("mla_impl", ["naive", "absorbed"])
def test_prefill_and_decode_equal_full_forward(model64, mla_impl):
    n = 13  # 4 + 3 prefilled in two chunks, 6 decoded one by one
    ids = _ids(2, n, seed=3)
    with torch.no_grad():
        full = model64(ids)
        cache = model64.new_cache()
        parts = [model64(ids[:, lo:hi], cache=cache, mla_impl=mla_impl) for lo, hi in ((0, 4), (4, 7))]
        parts += [model64(ids[:, t:t + 1], cache=cache, mla_impl=mla_impl) for t in range(7, n)]
    got = torch.cat(parts, dim=1)
    for t in range(n):
        assert_close(f"{mla_impl} position {t}", full[:, t], got[:, t], EXACT)


@pytest.mark.parametrize("graph", [False, True], ids=["slot-view", "graph-step"])
def test_slot_decode_rows_of_different_lengths(model64, graph):
    """Each row of a slot cache decodes at its own position (the row's length, as its mask counts)."""
    lengths = (5, 11, 1)
    seqs = [_ids(1, n + 3, seed=10 + n)[0] for n in lengths]
    slots = SlotCache(model64, 3)
    step = DecodeGraph(model64, compile=False) if graph else None
    with torch.no_grad():
        for slot, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            dense = model64.new_cache()
            model64(seq[None, :n], cache=dense)
            slots.install(slot, dense)
        for k in range(3):
            ids_n1 = torch.stack([seq[n + k] for seq, n in zip(seqs, lengths, strict=True)])[:, None]
            got = step(ids_n1, slots, 3) if graph else model64(ids_n1, cache=slots.view(3))[:, -1]
            for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
                assert_close(f"row {i} step {k}", model64(seq[None, :n + k + 1])[0, -1], got[i], EXACT)


@pytest.mark.parametrize("docs", [(6, 7), (29, 40)], ids=["masked", "per-document"])
@pytest.mark.parametrize("mla_impl", ["naive", "absorbed"])
def test_packed_documents_restart_positions(model64, docs, mla_impl):
    """A row of two documents: the second gives the outputs it gives alone (its positions restart at 0).
    (6, 7): the masked form (short documents); (29, 40): one causal attention per document. (Attention sees
    relative positions only, so outputs cannot tell a restart from an offset; `document_positions` is
    checked on its own above.)"""
    T = sum(docs)
    ids = _ids(1, T, seed=4)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model64(ids, seg_BT=seg, mla_impl=mla_impl)
        start = 0
        for n in docs:
            alone = model64(ids[:, start:start + n], mla_impl=mla_impl)
            assert_close(f"doc [{start}, {start + n})", alone[0], packed[0, start:start + n], EXACT)
            start += n


# ---- config and checkpoints --------------------------------------------------------------------

def test_config_rules():
    cfg = rope_config()
    assert not cfg.mla_use_nope and cfg.rope_theta == 10000.0
    d = cfg.to_dict()
    assert d["mla_use_nope"] is False and d["rope_theta"] == 10000.0
    for rope_dim in (15, 0):
        with pytest.raises(ValueError, match="qk_rope_head_dim"):
            rope_config(qk_rope_head_dim=rope_dim)
    nano().replace(qk_rope_head_dim=15)  # NoPE: any width
    for theta in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rope_theta"):
            rope_config(rope_theta=theta)
    with pytest.raises(ValueError, match="rope_theta"):
        K3Config.from_dict({**d, "rope_theta": "big"})
    # round trips through the dict; NoPE writes the field only when changed (K3 release files have none)
    assert K3Config.from_dict(d) == cfg
    moved = rope_config(rope_theta=500000.0)
    assert K3Config.from_dict(moved.to_dict()).rope_theta == 500000.0
    assert nano().replace(rope_theta=2.0).to_dict()["rope_theta"] == 2.0
    assert all("rope_theta" not in preset(p).to_dict() for p in ("nano", "k3", "kimi-linear-48b", "small-kl"))


def test_transformers_peer_refuses_rope():
    """transformers' KimiLinear (the peer of tests/test_peer_transformers.py) implements NoPE MLA only."""
    from openk3.config import as_kimi_linear
    from openk3.peers import check_kimi_linear_form

    check_kimi_linear_form(as_kimi_linear(nano()))
    with pytest.raises(ValueError, match="mla_use_nope"):
        check_kimi_linear_form(as_kimi_linear(rope_config()))


def test_nope_file_keeps_its_rope_theta_key():
    """Kimi-Linear's config.json carries rope_theta 10000.0 (unused: NoPE); a save writes it back."""
    d = nano().to_dict() | {"rope_theta": 10000.0}
    cfg = K3Config.from_dict(d)
    assert cfg.rope_theta == 10000.0 and cfg.to_dict()["rope_theta"] == 10000.0
    assert cfg.replace(rope_theta=7.0).to_dict()["rope_theta"] == 7.0


def test_checkpoint_round_trip_keeps_rope(tmp_path):
    model = perturb(K3ForCausalLM.build(rope_config(rope_theta=50000.0), dtype=F64, seed=1)).eval()
    openk3.save(model, tmp_path / "ck", dtype=torch.float64)
    written = json.loads((tmp_path / "ck" / "config.json").read_text())
    text = written.get("text_config", written)
    assert text["mla_use_nope"] is False and text["rope_theta"] == 50000.0
    back = openk3.load(tmp_path / "ck", dtype=torch.float64).eval()
    assert not back.config.mla_use_nope and back.config.rope_theta == 50000.0
    assert all(isinstance(layer.self_attn, GatedMLA) and layer.self_attn.rope_theta == 50000.0
               for layer in back.model.layers)
    ids = _ids(1, 9, seed=5)
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
