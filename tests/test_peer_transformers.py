"""openk3 against transformers' KimiLinear (an independent implementation) with identical weights.

The model is `nano` in Kimi-Linear form cut to 5 layers: KDA, KDA, KDA, MLA, MLA (1-idx full-attention
layers 4 and 5, so it ends with two MLA layers like K3), a dense layer 0 and plain MoE in layers 1..4.
Weights are drawn at O(1) scales (not the 0.02 init) so every sub-layer moves the logits, and a
sensitivity test proves that a wrong mapping would be caught far above the 1e-4 tolerance.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")

from helpers import rel_rms_error  # noqa: E402

from openk3.config import as_kimi_linear, kimi_linear_48b, nano  # noqa: E402
from openk3.model.model import K3ForCausalLM  # noqa: E402
from openk3.peers import to_transformers, to_transformers_state_dict, transformers_config  # noqa: E402

TOL = 1e-4


def small_config(**changes):
    cfg = as_kimi_linear(nano()).replace(num_hidden_layers=5, **{"linear_attn_config.full_attn_layers": [4, 5],
                                                                 "linear_attn_config.kda_layers": None})
    return cfg.replace(**changes) if changes else cfg


@torch.no_grad()
def randomize(model: K3ForCausalLM, seed: int) -> K3ForCausalLM:
    """O(1)-scale random weights: matrices ~ N(0, 1/fan_in), norm gains 1 +- 0.2, a router bias that matters."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if name.endswith(("A_log", "dt_bias")):
            continue  # keep the FLA-style init: a realistic decay range
        if name.endswith("conv1d.weight"):
            t.copy_(noise * 0.5)
        elif name.endswith("e_score_correction_bias"):
            t.copy_(noise * 0.05)
        elif t.dim() == 1:  # RMSNorm gains, o_norm
            t.copy_(1 + 0.2 * noise)
        elif name.endswith("embed_tokens.weight"):
            t.copy_(noise)
        else:
            t.copy_(noise / math.sqrt(t.shape[-1]))
    return model


def build_pair(seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = randomize(K3ForCausalLM.build(small_config(**changes), seed=seed), seed + 1).eval()
    return model, to_transformers(model)


def test_config_layout():
    cfg = small_config()
    hf = transformers_config(cfg)
    assert hf.layer_types == ["linear_attention"] * 3 + ["full_attention"] * 2
    assert hf.mlp_layer_types == ["dense"] + ["sparse"] * 4
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.n_shared_experts) == (32, 4, 2)
    assert (hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim) == (4, 32, 4)


def test_config_48b_matches_transformers_defaults():
    """transformers' KimiLinearConfig defaults are the 48B's; ours must agree on every shape and routing field."""
    from transformers import KimiLinearConfig

    ours, theirs = transformers_config(kimi_linear_48b()).to_dict(), KimiLinearConfig().to_dict()
    # layer_types: transformers' fallback puts full attention at 0-idx 4, 8, ...; the 48B file says 1-idx
    # 4, 8, ..., 24, 27, which we pass explicitly. pad_token_id: we drop it (an embedding padding_idx).
    skip = {"layer_types", "linear_attn_config", "first_k_dense_replace", "pad_token_id"}
    diff = {k: (ours.get(k), theirs.get(k)) for k in (set(ours) | set(theirs)) - skip if ours.get(k) != theirs.get(k)}
    assert not diff
    assert [i + 1 for i, t in enumerate(ours["layer_types"]) if t == "full_attention"] == [4, 8, 12, 16, 20, 24, 27]


@pytest.mark.parametrize("q_lora_rank, T", [(64, 37), (None, 37), (64, 131)], ids=["qlora", "no-qlora", "3-chunks"])
def test_logits_match(q_lora_rank, T):
    model, hf = build_pair(q_lora_rank=q_lora_rank)
    assert (hf.model.layers[3].self_attn.q_proj is None) == (q_lora_rank is not None)
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    err = rel_rms_error(theirs, ours)
    assert err < TOL, f"logits differ from transformers: relative error {err:.2e}"


def test_top1_routing_matches():
    """Top-1 routing keeps the raw sigmoid score as the weight (spec §4.6), as the release's code does; the
    peer is told not to renormalise then (transformers would make the weight 1)."""
    model, hf = build_pair(seed=5, num_experts_per_token=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        err = rel_rms_error(hf(ids).logits, model(ids))
    assert err < TOL, f"top-1 logits differ from transformers: relative error {err:.2e}"


def test_gradients_match():
    model, hf = build_pair(seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    loss_of(model(ids)).backward()
    loss_of(hf(ids).logits).backward()
    grads = copy.deepcopy(model)
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not no_grad, f"parameters without a gradient: {no_grad}"
    for (_, p), (_, g) in zip(model.named_parameters(), grads.named_parameters()):
        g.data = p.grad
    ours = to_transformers_state_dict(grads)
    for name, p in hf.named_parameters():
        err = rel_rms_error(p.grad, ours[name])
        assert err < 10 * TOL, f"gradient of {name} differs from transformers: relative error {err:.2e}"


def test_comparison_is_sensitive():
    """Mistakes of the kind a mapping could make (head order of A_log, gate/up order) are caught loudly."""
    model, hf = build_pair(seed=6)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(7))
    I = model.config.moe_intermediate_size
    with torch.no_grad():
        ref = model(ids)
        a_log = hf.model.layers[1].self_attn.forget_gate.A_log
        a_log.copy_(a_log.flip(2))
        assert rel_rms_error(ref, hf(ids).logits) > 100 * TOL
        a_log.copy_(a_log.flip(2))
        gate_up = hf.model.layers[2].mlp.experts.gate_up_proj
        gate_up.copy_(torch.cat([gate_up[:, I:], gate_up[:, :I]], dim=1))
        assert rel_rms_error(ref, hf(ids).logits) > 100 * TOL


def test_greedy_generation_with_cache():
    model, hf = build_pair(seed=8)
    prompt = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(9))
    steps = 8
    with torch.no_grad():
        cache = model.new_cache()
        nxt = model(prompt, cache=cache)[:, -1].argmax(-1)
        ours = [nxt]
        for _ in range(steps - 1):
            nxt = model(nxt[:, None], cache=cache)[:, -1].argmax(-1)
            ours.append(nxt)
        theirs = hf.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, use_cache=True,
                             pad_token_id=0)
    assert torch.equal(torch.stack(ours, dim=1), theirs[:, prompt.shape[1]:])


@pytest.mark.parametrize("field, value", [
    ("attn_res_block_size", 2),
    ("routed_expert_hidden_size", 64),
    ("linear_attn_config.gate_lower_bound", -5.0),
    ("linear_attn_config.use_full_rank_gate", True),
    ("mla_use_output_gate", True),
    ("hidden_act", "situ"),
])
def test_rejects_k3_only_features(field, value):
    cfg = small_config(**{field: value})
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        transformers_config(cfg)


def test_rejects_k3_form_model():
    model = K3ForCausalLM.build(nano(), device="meta")
    with pytest.raises(ValueError, match="attn_res_block_size"):
        to_transformers(model)


def test_the_peer_is_transformers_pytorch_path_with_fla_installed():
    """With fla and triton installed (the `triton` test tier), transformers would run KDA through fla's kernels on
    CPU tensors; `to_transformers` imports its modeling module with fla hidden, even after fla itself was
    imported, and refuses a module that some other import already bound to fla's kernels."""
    import subprocess
    import sys
    from pathlib import Path

    check = ("import sys; from openk3.peers import _reference_kimi_linear as ref\n"
             "{before}\n"
             "try:\n    ref(); print('TORCH')\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    root = Path(__file__).resolve().parents[1]
    results = {}
    for name, before in [("fla first", "import fla.ops.kda"),
                         ("transformers first", "from transformers import KimiLinearForCausalLM")]:
        out = subprocess.run([sys.executable, "-c", check.format(before=before)], cwd=root, capture_output=True,
                             text=True, timeout=300)
        results[name] = out.stdout + out.stderr[-2000:]
    assert "TORCH" in results["fla first"], results["fla first"]
    assert "REFUSED" in results["transformers first"] and "PyTorch path" in results["transformers first"], \
        results["transformers first"]
