"""Multi-head latent attention, two exact forms: naive (expanded K/V) and absorbed (latent).

Legend: B batch, T query tokens, S key tokens (cached + new), H heads, C latent width (kv_lora_rank),
Dn nope dims, Dr shared "rope" dims (never rotated in K3; a RoPE config's layer rotates them before these
functions, `openk3.model.mla`), Dv value dims.

Both forms take the *normalised* latent `ckv_BSC` and the shared key part `kpe_BSR` — exactly
what a decode cache stores (576 values per token and layer in K3) — so a cache can feed either.
`mla_attention_naive` expands per-head K/V with `kv_b_proj` (the HF reference, our training path);
`mla_attention_absorbed` folds `kv_b_proj` into the query and the output (DeepSeek's absorb trick,
spec §4.5), which is what makes decode read only the latent. Tests prove them equal.
"""

from __future__ import annotations

import torch

from openk3.common import upcast


def attention_mask(num_q: int, num_k: int, *, doc_q_BT: torch.Tensor | None = None,
                   doc_k_BS: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Boolean [B or 1, T, S] mask, True where query t may attend key s.

    Queries are the last `num_q` of the `num_k` positions (causal with an offset, as in chunked
    prefill or decode). With document ids, attention is block-diagonal: a token never sees another
    document of a packed row.
    """
    offset = num_k - num_q
    q_pos = torch.arange(num_q, device=device)[:, None] + offset
    k_pos = torch.arange(num_k, device=device)[None, :]
    mask_TS = (k_pos <= q_pos)[None]
    if doc_q_BT is not None:
        assert doc_k_BS is not None
        mask_TS = mask_TS & (doc_q_BT[:, :, None] == doc_k_BS[:, None, :])
    return mask_TS


def _softmax(scores_BHTS: torch.Tensor, mask_BTS: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    scores_BHTS = upcast(scores_BHTS)
    if mask_BTS is not None:
        scores_BHTS = scores_BHTS.masked_fill(~mask_BTS[:, None], float("-inf"))
    # fp32 softmax, probabilities back in the activation dtype (the eager reference, spec §4.8).
    return torch.softmax(scores_BHTS, dim=-1).to(out_dtype)


def expand_kv(ckv_BSC: torch.Tensor, kpe_BSR: torch.Tensor, w_kv_b: torch.Tensor, *, num_heads: int,
              v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys [B, S, H, Dn + Dr] (the latent's nope part through `kv_b_proj`, then the shared `kpe` part)
    and values [B, S, H, Dv] from the latent: what the naive and the fused causal forms attend over."""
    B, S, Dr = kpe_BSR.shape
    Dn = w_kv_b.shape[0] // num_heads - v_head_dim
    kv_BSHE = (ckv_BSC @ w_kv_b.t()).view(B, S, num_heads, Dn + v_head_dim)
    k_nope_BSHN, v_BSHV = kv_BSHE.split([Dn, v_head_dim], dim=-1)
    return torch.cat([k_nope_BSHN, kpe_BSR[:, :, None, :].expand(B, S, num_heads, Dr)], dim=-1), v_BSHV


def mla_attention_naive(q_BTHD: torch.Tensor, ckv_BSC: torch.Tensor, kpe_BSR: torch.Tensor, w_kv_b: torch.Tensor,
                        *, v_head_dim: int, scale: float, mask_BTS: torch.Tensor | None) -> torch.Tensor:
    """Reference MLA: expand the latent to per-head keys and values, then softmax attention.

    Args:
        q_BTHD: queries [B, T, H, Dn + Dr], nope part first.
        ckv_BSC: RMS-normalised KV latent of every key position [B, S, C].
        kpe_BSR: shared key dims [B, S, Dr] (un-rotated in K3; already rotated for RoPE), broadcast to all heads.
        w_kv_b: `kv_b_proj.weight` [H * (Dn + Dv), C]; per head Dn key rows then Dv value rows.
        v_head_dim: Dv.
        scale: softmax scale, (Dn + Dr) ** -0.5 in K3.
        mask_BTS: boolean mask (see `attention_mask`), or None for no masking.

    Returns:
        [B, T, H, Dv] in the dtype of `q_BTHD`.
    """
    k_BSHD, v_BSHV = expand_kv(ckv_BSC, kpe_BSR, w_kv_b, num_heads=q_BTHD.shape[2], v_head_dim=v_head_dim)
    scores_BHTS = torch.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD) * scale
    p_BHTS = _softmax(scores_BHTS, mask_BTS, q_BTHD.dtype)
    return torch.einsum("bhts,bshv->bthv", p_BHTS, v_BSHV)


def fused_causal_ok(q_BTHD: torch.Tensor) -> bool:
    """Whether `mla_attention_causal` may take torch's fused attention: float32 or float64 queries on CPU outside
    autocast. Under bf16 (autocast or bf16 weights) the eager form's rounding points are the reference's
    (spec §4.8: fp32 softmax, probabilities rounded to bf16 before P V; tests/test_peer_bf16.py), which the
    fused kernel does not reproduce, so those keep the eager form. On CUDA the fused float32 kernel (memory-
    efficient attention) splits its backward across keys with atomic adds, so a run would no longer repeat bit
    for bit; GPU training is bf16 anyway, and nothing here measured it, so CUDA keeps the eager form too."""
    if q_BTHD.device.type != "cpu" or q_BTHD.dtype not in (torch.float32, torch.float64):
        return False
    return not torch.is_autocast_enabled("cpu")


def mla_attention_causal(q_BTHD: torch.Tensor, ckv_BTC: torch.Tensor, kpe_BTR: torch.Tensor, w_kv_b: torch.Tensor,
                         *, v_head_dim: int, scale: float) -> torch.Tensor:
    """`mla_attention_naive` with the causal mask of `attention_mask(T, T)` (every query sees the keys up to its
    own position: a training forward, and each document of a packed row; a prefill always has a cache, whose
    offset mask keeps the naive form), through `F.scaled_dot_product_attention` with `is_causal=True` when
    `fused_causal_ok`: the same function in fewer, fused operations, forward and backward. Same arguments and
    result as the naive form, which is its twin (tests/test_ops_mla.py: outputs and gradients in float64, odd
    lengths) and what runs otherwise.

    MLA's value heads are narrower than its query/key heads (Dv = 2/3 of Dn + Dr in every preset), and CPU torch
    takes its flash kernel only for equal widths; otherwise its math kernel, which holds the [B, H, T, T] scores
    and probabilities for the backward. So the values are zero-padded to the key width and the padding is cut
    off the output: the padded output columns are exactly 0, the real ones are untouched (each output column
    is its own sum over keys), and the padding's gradient is dropped by the pad's backward. The flash kernel
    then never holds a T x T tensor. fp32 fwd + bwd, one thread, padded flash against the math kernel
    (benchmarks/bench_mla.py): nano's shape (4 heads, 48 / 32) 1.2x at T = 256-512, 1.6x at 1,024, 3.2x at 2,048;
    small-kl's (6 heads, 96 / 64) 0.90-0.97x at 256-512, 1.3x at 1,024, 2.1x at 2,048."""
    T, H = q_BTHD.shape[1:3]
    if T == 1 or not fused_causal_ok(q_BTHD):
        return mla_attention_naive(q_BTHD, ckv_BTC, kpe_BTR, w_kv_b, v_head_dim=v_head_dim, scale=scale,
                                   mask_BTS=attention_mask(T, T, device=q_BTHD.device) if T > 1 else None)
    k_BTHD, v_BTHV = expand_kv(ckv_BTC, kpe_BTR, w_kv_b, num_heads=H, v_head_dim=v_head_dim)
    D = k_BTHD.shape[-1]
    if v_head_dim < D:
        v_BTHV = torch.nn.functional.pad(v_BTHV, (0, D - v_head_dim))
    o_BHTD = torch.nn.functional.scaled_dot_product_attention(
        q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2), v_BTHV.transpose(1, 2), is_causal=True, scale=scale)
    return o_BHTD.transpose(1, 2)[..., :v_head_dim]


#: below this mean document length a packed row is attended with the block-diagonal mask (see below)
MIN_MEAN_DOCUMENT = 32


def document_runs(seg_T: torch.Tensor) -> list[tuple[int, int]] | None:
    """[(start, end)] of the documents of one packed row (document ids non-decreasing along T), or None when
    the ids are not non-decreasing (then only the masked form is exact)."""
    step = seg_T[1:] - seg_T[:-1]
    if bool((step < 0).any()):
        return None
    cuts = [0, *(torch.nonzero(step).flatten() + 1).tolist(), seg_T.shape[0]]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def mla_attention_documents(q_BTHD: torch.Tensor, ckv_BTC: torch.Tensor, kpe_BTR: torch.Tensor, w_kv_b: torch.Tensor,
                            *, seg_BT: torch.Tensor, v_head_dim: int, scale: float) -> torch.Tensor:
    """`mla_attention_naive` over packed rows, one causal attention per document instead of a T x T masked one.

    The block-diagonal mask of `attention_mask(doc_q_BT=seg_BT, ...)` gives every key of another document a
    probability of exactly 0, so attending within each document is the same function; it costs the sum of
    the squared document lengths instead of T^2 (a 4,096-token SFT row of two conversations: ~half; of twenty
    short ones: a twentieth). Rows whose ids are not non-decreasing take the masked form, and so do rows whose
    documents average under `MIN_MEAN_DOCUMENT` tokens, where one call per document costs more than it saves
    (nano training step, one thread: T=256 with 12 documents 0.88x; T=512 with 12 1.14x; T=1024 with 3 or 12
    1.24x; one document 1.0x). The masked form is the twin (tests/test_ops_mla.py: outputs and gradients in
    float64).
    """
    rows = []
    for b in range(q_BTHD.shape[0]):
        runs = document_runs(seg_BT[b])
        if runs is None or len(runs) * MIN_MEAN_DOCUMENT > seg_BT.shape[1]:
            mask = attention_mask(seg_BT.shape[1], seg_BT.shape[1], doc_q_BT=seg_BT[b:b + 1], doc_k_BS=seg_BT[b:b + 1],
                                  device=seg_BT.device)
            rows.append(mla_attention_naive(q_BTHD[b:b + 1], ckv_BTC[b:b + 1], kpe_BTR[b:b + 1], w_kv_b,
                                            v_head_dim=v_head_dim, scale=scale, mask_BTS=mask))
            continue
        parts = [mla_attention_causal(q_BTHD[b:b + 1, s:e], ckv_BTC[b:b + 1, s:e], kpe_BTR[b:b + 1, s:e], w_kv_b,
                                      v_head_dim=v_head_dim, scale=scale)
                 for s, e in runs]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def mla_attention_absorbed(q_BTHD: torch.Tensor, ckv_BSC: torch.Tensor, kpe_BSR: torch.Tensor,
                           w_kv_b: torch.Tensor, *, v_head_dim: int, scale: float,
                           mask_BTS: torch.Tensor | None) -> torch.Tensor:
    """MLA with `kv_b_proj` absorbed: attention runs over the C + Dr latent, shared by all heads.

    Same arguments and result as `mla_attention_naive`. Cost per key is O(H * (C + Dr)) instead of
    expanding every cached key to H * (Dn + Dr + Dv) values, which is why decode uses it.

    In bf16 it rounds at other points than the naive form (the reference's): q_nope W_UK, the latent and
    the "rope" score parts, their sum and o_lat are each a bf16 result, where the naive form rounds the
    expanded keys and one 192-wide score. Mathematically equal; the MLA layer's output stays within 2 bf16
    ulps (of its largest element) of transformers' eager MLA (tests/test_peer_bf16.py).
    """
    B, T, H, D = q_BTHD.shape
    Dr = kpe_BSR.shape[-1]
    Dn = D - Dr
    C = ckv_BSC.shape[-1]
    w_HEC = w_kv_b.view(H, Dn + v_head_dim, C)
    w_uk_HNC, w_uv_HVC = w_HEC.split([Dn, v_head_dim], dim=1)
    q_nope_BTHN, q_pe_BTHR = q_BTHD.split([Dn, Dr], dim=-1)
    q_lat_BTHC = torch.einsum("bthn,hnc->bthc", q_nope_BTHN, w_uk_HNC)
    scores_BHTS = (torch.einsum("bthc,bsc->bhts", q_lat_BTHC, ckv_BSC)
                   + torch.einsum("bthr,bsr->bhts", q_pe_BTHR, kpe_BSR)) * scale
    p_BHTS = _softmax(scores_BHTS, mask_BTS, q_BTHD.dtype)
    o_lat_BTHC = torch.einsum("bhts,bsc->bthc", p_BHTS, ckv_BSC)
    return torch.einsum("bthc,hvc->bthv", o_lat_BTHC, w_uv_HVC)
