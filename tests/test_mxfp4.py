"""MXFP4 (spec §6): code table, nibble order, OCP MX rounding against a brute-force per-group
reference, exact round trips, errors; keep-packed experts equal to the dequantised model."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from openk3.config import nano
from openk3.model.layers import situ_glu, swiglu
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import Experts
from openk3.model.packed_experts import PackedExperts, experts_packed, pack_model_experts_, unpack_model_experts_
from openk3.ops.moe import experts_grouped, experts_loop
from openk3.quant import E2M1_VALUES, GROUP, bits_per_weight, pack, unpack

SPEC_TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------------------------------------- format


def test_e2m1_table_and_all_16_codes_decode():
    assert E2M1_VALUES.tolist() == SPEC_TABLE
    assert [math.copysign(1.0, v) for v in E2M1_VALUES.tolist()] == [1.0] * 8 + [-1.0] * 8  # code 8 is -0
    assert GROUP == 32 and bits_per_weight() == 4.25
    # one row of 32 elements = codes 0..15 twice; scale byte 127 (x1) and 128 (x2) in two rows
    codes = torch.arange(32, dtype=torch.uint8) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).expand(2, 16).contiguous()
    scale = torch.tensor([[127], [128]], dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        w = unpack(packed, scale, dtype)
        assert w.dtype == dtype and w.shape == (2, 32)
        assert w[0].tolist() == SPEC_TABLE * 2
        assert w[1].tolist() == [2 * v for v in SPEC_TABLE] * 2
        assert torch.equal(torch.signbit(w[0, :16]), torch.arange(16) >= 8)


def test_nibble_order_low_first():
    # byte 0x71: element 0 = code 1 (0.5), element 1 = code 7 (6); byte 0x9F: code 15 (-6) then code 9 (-0.5)
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0], packed[0, 1] = 0x71, 0x9F
    scale = torch.tensor([[126]], dtype=torch.uint8)  # 2^-1
    w = unpack(packed, scale, torch.float32)
    assert w[0, :4].tolist() == [0.25, 3.0, -3.0, -0.25]
    assert w[0, 4:].abs().sum() == 0
    # and pack writes the same bytes
    p, s = pack(w)
    assert p[0, 0].item() == 0x71 and p[0, 1].item() == 0x9F and s.item() == 126


def test_scale_bytes_decode_to_powers_of_two():
    b = torch.arange(255, dtype=torch.uint8).reshape(255, 1)
    packed = torch.full((255, 16), 0x22, dtype=torch.uint8)  # every element is code 2 (1.0)
    w = unpack(packed, b, torch.float64)
    assert w[:, 0].tolist() == [math.ldexp(1.0, k - 127) for k in range(255)]
    w32 = unpack(packed[2:253], b[2:253], torch.float32)  # normal range of float32 for every code
    assert torch.equal(w32.double(), w[2:253])


def test_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(torch.randn(4, 48))
    with pytest.raises(ValueError, match="floating"):
        pack(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="finite"):
        pack(torch.tensor([float("inf")] + [0.0] * 31))
    with pytest.raises(ValueError, match="finite"):
        pack(torch.tensor([float("nan")] + [0.0] * 31))
    packed = torch.zeros(2, 3, 16, dtype=torch.uint8)
    scale = torch.full((2, 3, 1), 127, dtype=torch.uint8)
    scale[1, 2, 0] = 255
    with pytest.raises(ValueError, match="255"):
        unpack(packed, scale)
    with pytest.raises(ValueError, match="shapes"):
        unpack(packed, scale[..., :0])
    with pytest.raises(ValueError, match="uint8"):
        unpack(packed.float(), scale)


# ------------------------------------------------------------------------------------ round trips


def _random_representable(shape, g):
    """Random codes times random per-group scales whose group max has exponent X + 2 (so `pack`'s rule
    picks exactly that scale back): each group gets at least one code of magnitude 4 or 6."""
    *lead, n = shape
    codes = torch.randint(0, 16, (*lead, n), generator=g, dtype=torch.uint8)
    grouped = codes.view(*lead, n // GROUP, GROUP)
    big = torch.randint(6, 8, grouped.shape[:-1], generator=g, dtype=torch.uint8)  # 4 or 6
    sign = torch.randint(0, 2, grouped.shape[:-1], generator=g, dtype=torch.uint8) << 3
    pos = torch.randint(0, GROUP, (*grouped.shape[:-1], 1), generator=g)
    grouped.scatter_(-1, pos, (big | sign).unsqueeze(-1))
    scale = torch.randint(100, 140, (*lead, n // GROUP), generator=g, dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale


@pytest.mark.parametrize("shape", [(8, 64), (3, 5, 96), (2, 1, 4, 32)])
def test_round_trip_of_representable_values_is_exact(shape):
    g = torch.Generator().manual_seed(len(shape))
    packed, scale = _random_representable(shape, g)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        w = unpack(packed, scale, dtype)
        assert w.shape == shape and w.dtype == dtype
        p, s = pack(w)
        assert torch.equal(s, scale) and torch.equal(p, packed)
        assert torch.equal(unpack(p, s, dtype), w)


def test_repacking_any_unpacked_bytes_keeps_the_values():
    """What `openk3.save` relies on for a model loaded (unpacked) from MXFP4 written by another encoder:
    any codes with any scale byte 2..252 (decoded exactly, spec §6) re-pack to the same values. The bytes
    come back too in pack's canonical form (a group's largest |code| 4 or 6, zero groups at byte 0) and
    differ otherwise: e.g. (1.5, scale 2^s) re-packs as (6, scale 2^(s-2))."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (64, 256), generator=g, dtype=torch.uint8)
    codes[:16] &= 0b1011  # small magnitudes only (|v| <= 1.5) in some rows: non-canonical groups
    codes[16, :32] = 8  # an all -0 group with a non-zero scale
    scale = torch.randint(2, 253, (64, 256 // GROUP), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    canonical = ((codes & 7).reshape(64, -1, GROUP).amax(-1) >= 6)  # magnitude index 6, 7 = 4.0, 6.0
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        w = unpack(packed, scale, dtype)
        p, s = pack(w)
        again = unpack(p, s, dtype)
        assert torch.equal(again, w) and torch.equal(torch.signbit(again), torch.signbit(w)), dtype
        assert torch.equal(s[canonical], scale[canonical]) and not torch.equal(s, scale)
        rows = canonical.all(-1)
        assert torch.equal(p[rows], packed[rows])


def test_zero_group_uses_byte_0_and_keeps_signed_zeros():
    w = torch.zeros(2, 64)
    w[0, 1] = -0.0
    w[1, 32:] = torch.linspace(-1, 1, 32)
    p, s = pack(w)
    assert s.tolist() == [[0, 0], [0, 125]]  # the second row's second group: amax 1 -> X = -2
    assert p[0, 0].item() == 0x80  # element 1 is -0 (code 8, high nibble)
    d = unpack(p, s, torch.float32)
    assert torch.equal(d[:, :32], w[:, :32]) and torch.equal(torch.signbit(d[0, :2]), torch.tensor([False, True]))


# ------------------------------------------------------------------ rounding vs a per-group reference


def _ref_group(vals: list[float]) -> tuple[list[int], int]:
    """Straightforward OCP MX quantiser of one group: brute-force nearest magnitude, ties to even."""
    amax = max(abs(v) for v in vals)
    if amax == 0:
        x = -127
    else:
        x = max(-127, min(127, math.floor(math.log2(amax)) - 2))
        # log2 of an exact power of two is exact in Python; guard frexp-consistency anyway
        m, e = math.frexp(amax)
        assert x == max(-127, min(127, e - 1 - 2))
    codes = []
    for v in vals:
        a = abs(v) / 2.0**x
        best, best_d = None, None
        for i, mag in enumerate(MAGS):
            d = abs(a - mag)
            if best is None or d < best_d or (d == best_d and i % 2 == 0):
                best, best_d = i, d
        codes.append(best | (8 if math.copysign(1.0, v) < 0 else 0))
    return codes, x + 127


def _ref_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = w.double().reshape(-1, GROUP).tolist()
    codes, scales = zip(*(_ref_group(r) for r in rows))
    codes = torch.tensor(codes, dtype=torch.uint8).reshape(*w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, torch.tensor(scales, dtype=torch.uint8).reshape(*w.shape[:-1], w.shape[-1] // GROUP)


def test_ties_go_to_the_even_code_and_saturate_at_6():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for x in (-5, 0, 3):
        vals = [4.0] + mids + [-m for m in mids] + [6.0, 6.5, 7.99, -7.0] + [0.0] * 13
        p, s = pack(torch.tensor([vals]) * 2.0**x)
        assert s.item() == 127 + x
        d = unpack(p, s, torch.float32)[0] / 2.0**x
        assert d[1:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # codes 0, 2, 2, 4, 4, 6, 6
        assert d[8:15].tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
        assert d[15:19].tolist() == [6.0, 6.0, 6.0, -6.0]
        assert p[0, 4].item() == 0xA8  # element 8 = -0.25 -> -0 (code 8, low nibble), element 9 = -0.75 -> code 10


def _tricky_groups(g) -> torch.Tensor:
    """Groups holding exact ties (every midpoint, both signs) and values beyond 6 * 2^X."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    groups = []
    for x in (-8, -3, 0, 4):
        s = 2.0**x
        for top in (4.0, 5.0, 6.0, 6.5, 7.0, 7.75, 7.999):  # the group max, in units of 2^X
            vals = [top] + mids + [-m for m in mids] + [6.25, -7.5 if top > 7.5 else -top, 0.0, -0.0]
            vals += torch.empty(GROUP - len(vals)).uniform_(-top, top, generator=g).tolist()
            groups.append([v * s for v in vals])
    return torch.tensor(groups, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pack_matches_reference_quantiser_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(7)
    normal = torch.randn(96, 64, generator=g) * torch.logspace(-6, 2, 96).unsqueeze(1)  # 192 groups
    tricky = _tricky_groups(g).reshape(-1, 64)  # 28 groups, exact ties survive bf16 (2-3 bit mantissas)
    mixed = torch.randn(4, 32, generator=g)
    mixed[1] = 0.0  # an all-zero group
    mixed[2, ::3] = -0.0
    mixed[3] = torch.randn(32, generator=g) * 1e-30  # tiny values (exponent clamps only in float64 below)
    for w in (normal, tricky, mixed.reshape(2, 64)):
        w = w.to(dtype)
        p, s = pack(w)
        rp, rs = _ref_pack(w)
        assert torch.equal(s, rs), (s - rs.int()).abs().max()
        assert torch.equal(p, rp)


def test_clamped_exponents_match_reference():
    w = torch.tensor([[1e-300] * 32, [2.0**-129 * 5] * 16 + [0.0] * 16, [1e45] * 16 + [2.0**130] * 16],
                     dtype=torch.float64)
    p, s = pack(w)
    rp, rs = _ref_pack(w)
    assert torch.equal(s, rs) and torch.equal(p, rp)
    assert s[:, 0].tolist() == [0, 0, 254]
    assert unpack(p, s, torch.float64)[2].tolist() == [6 * 2.0**127] * 32  # saturated at the top scale


def test_error_is_at_most_half_a_step_and_saturation_is_exact():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 16, 128, generator=g, dtype=torch.float64) * 0.02
    w[0, 0, :32] *= 100
    p, s = pack(w)
    deq = unpack(p, s, torch.float64)
    step = torch.ldexp(torch.ones(()), s.double() - 127).repeat_interleave(GROUP, -1)  # 2^X per element
    a = w.abs() / step
    half_step = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)) * step
    err = (w - deq).abs()
    inside = a <= 6
    assert (err[inside] <= half_step[inside]).all()
    assert torch.equal(deq[~inside], torch.sign(w[~inside]) * 6 * step[~inside])
    assert (a < 8).all() and (~inside).any()


# ---------------------------------------------------------------------------------- packed experts

GLUS = {"situ": functools.partial(situ_glu, beta=4.0, linear_beta=25.0), "swiglu": swiglu}


def _rounded_experts(E, C, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = Experts(E, C, I)
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            w = torch.randn(getattr(ex, name).shape, generator=g) * 0.1
            setattr(ex, name, torch.nn.Parameter(unpack(*pack(w), dtype)))
    return ex


def test_packed_experts_buffers_round_trip_and_state_dict():
    E, C, I = 5, 64, 96
    ex = _rounded_experts(E, C, I, torch.bfloat16)
    pe = PackedExperts.from_experts(ex)
    shapes = {k: tuple(v.shape) for k, v in pe.state_dict().items()}
    assert shapes == {"w1_packed": (E, I, C // 2), "w1_scale": (E, I, C // 32), "w3_packed": (E, I, C // 2),
                      "w3_scale": (E, I, C // 32), "w2_packed": (E, C, I // 2), "w2_scale": (E, C, I // 32)}
    assert all(v.dtype == torch.uint8 for v in pe.state_dict().values())
    assert list(pe.parameters()) == []
    back = pe.to_experts(torch.bfloat16)
    for name in ("w1", "w3", "w2"):
        assert torch.equal(getattr(back, name), getattr(ex, name))
    for e in (0, 4):
        for got, name in zip(pe.dequant(e, torch.float32), ("w1", "w3", "w2")):
            assert got.dtype == torch.float32 and torch.equal(got, getattr(ex, name)[e].float())
    assert pe.nbytes() * 64 == sum(p.numel() for p in ex.parameters()) * 2 * 17  # 4.25 / 16 of bf16
    fresh = PackedExperts(E, C, I)
    fresh.load_state_dict(pe.state_dict())
    assert torch.equal(fresh.to_experts(torch.float32).w2, ex.w2.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("glu", ["situ", "swiglu"])
def test_experts_packed_equals_experts_loop_exactly(dtype, glu):
    E, C, I, N, K = 12, 32, 64, 19, 3
    ex = _rounded_experts(E, C, I, dtype, seed=1)
    pe = PackedExperts.from_experts(ex)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, C, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(N)])  # last 2 experts unused
    w = (torch.rand(N, K, generator=g) + 0.1).to(torch.float64 if dtype == torch.float64 else torch.float32)
    ref = experts_loop(x, w, idx, ex.w1.detach(), ex.w3.detach(), ex.w2.detach(), GLUS[glu])
    got = experts_packed(x, w, idx, pe, GLUS[glu], dtype)
    assert got.dtype == dtype and torch.equal(got, ref)
    fast = experts_grouped(x, w, idx, ex.w1.detach(), ex.w3.detach(), ex.w2.detach(), GLUS[glu])
    torch.testing.assert_close(got, fast)


def _nano_rounded(dtype):
    model = K3ForCausalLM.build(nano(), dtype=dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Experts):
                for name in ("w1", "w3", "w2"):
                    p = getattr(m, name)
                    p.copy_(unpack(*pack(p), p.dtype))
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_nano_model_logits_identical(dtype):
    model = _nano_rounded(dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    experts_bytes = sum(p.numel() * 2 for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    with torch.no_grad():
        ref = model(ids, moe_impl="loop")
        fast = model(ids)
        pack_model_experts_(model)
        packed = [m for m in model.modules() if isinstance(m, PackedExperts)]
        assert len(packed) == sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers)) > 0
        assert not any(isinstance(m, Experts) for m in model.modules())
        assert sum(m.nbytes() for m in packed) * 64 == experts_bytes * 17  # 4.25 / 16 bits of bf16
        got = model(ids, moe_impl="loop")  # experts_packed: the loop's operations on dequantised experts
        assert torch.equal(got, ref)
        default = model(ids)  # float32: the MXFP4 CPU kernel (sums in another order); bfloat16: experts_packed
        if dtype == torch.float32:
            torch.testing.assert_close(default, fast, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(default, ref)
        unpack_model_experts_(model, dtype)
        assert not any(isinstance(m, PackedExperts) for m in model.modules())
        assert torch.equal(model(ids, moe_impl="loop"), ref)


def test_packed_model_counts_and_casts_like_unpacked():
    """Accounting counts logical expert weights whatever their storage; `cast` leaves uint8 codes alone."""
    from openk3.model.accounting import count_params

    model = K3ForCausalLM.build(nano(), dtype=torch.float32, seed=0)
    before = count_params(model)
    pack_model_experts_(model)
    assert count_params(model) == before
    model.cast(torch.bfloat16)
    packed = model.model.layers[1].block_sparse_moe.experts
    assert packed.w1_packed.dtype == torch.uint8 and packed.w2_scale.dtype == torch.uint8
