"""openk3.hf: K3 checkpoints in transformers (AutoConfig / AutoModelForCausalLM / generate), Trainer and PEFT LoRA.

Every comparison is against openk3 itself (`openk3.load`, `K3ForCausalLM`, `openk3.LLM`) on a 4-layer nano model
(3 KDA + 1 MLA, dense FFN then MoE, two AttnRes blocks) with perturbed O(1) weights, float32.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers import nano_cut, perturb  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import openk3  # noqa: E402
import openk3.hf  # noqa: E402
from openk3.model.model import K3ForCausalLM  # noqa: E402
from openk3.ops.loss import cross_entropy_sum  # noqa: E402

V = 512


def _model(seed: int = 0) -> K3ForCausalLM:
    m = K3ForCausalLM.build(nano_cut(4), dtype=torch.float64, seed=seed)
    perturb(m, seed)
    return m.cast(torch.float32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "ck"
    openk3.save(_model(), d, dtype=torch.float32)
    return d


@pytest.fixture(scope="module")
def ckpt_mxfp4(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "ck-mxfp4"
    openk3.save(_model(), d, dtype=torch.float32, experts_format="mxfp4")
    return d


def _ids(B: int = 2, T: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V - 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _hf(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


def _greedy(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)[
        :, ids.shape[1]:]


def test_import_openk3_stays_free_of_transformers():
    code = "import sys, openk3, openk3.model.model; sys.exit('transformers' in sys.modules or 'peft' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- loading and saving -----------------------------------------------------------------------------------------

def test_autoconfig_round_trips_the_k3_config(ckpt, tmp_path):
    cfg = AutoConfig.from_pretrained(ckpt)
    assert type(cfg).__name__ == "KimiK3Config" and cfg.text_config.model_type == "kimi_linear"
    assert cfg.to_k3() == openk3.checkpoint.read_config(ckpt)
    cfg.save_pretrained(tmp_path)
    back = openk3.checkpoint.read_config(tmp_path)
    assert back.extra["_wrapper"].pop("transformers_version") == __import__("transformers").__version__
    assert back == openk3.checkpoint.read_config(ckpt)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "kimi_k3" and saved["text_config"]["model_type"] == "kimi_linear"


def test_a_wrong_k3_field_is_named(ckpt, tmp_path):
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["text_config"]["attn_res_block_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="attn_res_block_size"):
        AutoConfig.from_pretrained(tmp_path)


def test_from_pretrained_reads_every_tensor_as_openk3_does(ckpt):
    hf, info = _hf(ckpt, output_loading_info=True)
    assert type(hf).__name__ == "KimiK3ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ref = openk3.load(ckpt, dtype=torch.float32)
    got = hf.language_model.state_dict()
    assert got.keys() == ref.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    bf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    for name, p in list(bf.named_parameters()) + list(bf.named_buffers()):
        island = any(s in name for s in ("conv1d", "A_log", "dt_bias", "o_norm", "e_score_correction_bias"))
        assert p.dtype == (torch.float32 if island else torch.bfloat16), name


def test_save_pretrained_writes_the_release_format(ckpt, tmp_path):
    hf = _hf(ckpt)
    hf.save_pretrained(tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"] and "auto_map" not in cfg
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert names == set(f.keys())
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    back = openk3.load(tmp_path / "out", dtype=torch.float32)
    ref = openk3.load(ckpt, dtype=torch.float32)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_the_release_wrapper_with_remote_code_fields_opens_here(ckpt, tmp_path):
    """The release's config.json names Moonshot's remote code (`auto_map`) and carries a vision tower: after
    `import openk3.hf` the local classes win without trust_remote_code, the vision tensors are set aside, and a
    save drops the stale `auto_map` but keeps the other towers' config."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "release"
    shutil.copytree(ckpt, d)
    raw = json.loads((d / "config.json").read_text())
    raw["auto_map"] = {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                       "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"}
    raw["vision_config"] = {"model_type": "moonvit", "hidden_size": 32}
    raw["media_placeholder_token_id"] = 300
    (d / "config.json").write_text(json.dumps(raw))
    tensors = load_file(d / "model.safetensors")
    tensors["vision_tower.patch_embed.weight"] = torch.ones(4, 4)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    hf, info = _hf(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, openk3.load(ckpt, dtype=torch.float32)(ids))
    hf.save_pretrained(tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "auto_map" not in out and out["vision_config"] == raw["vision_config"]
    assert out["media_placeholder_token_id"] == 300


def test_mxfp4_experts_load_exactly(ckpt_mxfp4):
    hf = _hf(ckpt_mxfp4)
    ref = openk3.load(ckpt_mxfp4, dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref(ids))
    llm = openk3.LLM(ref)
    want = [o.token_ids for o in llm.generate([r.tolist() for r in ids], temperature=0, max_tokens=6,
                                                         ignore_eos=True)]
    assert _greedy(hf, ids, 6).tolist() == want


# ---- forward, loss, generate ---------------------------------------------------------------------------------

def test_logits_and_loss_equal_openk3(ckpt):
    hf, ref = _hf(ckpt), openk3.load(ckpt, dtype=torch.float32)
    ids = _ids(T=13)
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        out = hf(input_ids=ids, labels=labels)
        logits = ref(ids)
    assert torch.equal(out.logits, logits) and out.past_key_values is None
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    total, count = cross_entropy_sum(logits, shifted)
    torch.testing.assert_close(out.loss, total / count, rtol=1e-6, atol=0)
    emb = hf.get_input_embeddings()(ids)
    with torch.no_grad():
        assert torch.equal(hf(inputs_embeds=emb).logits, logits)


def test_greedy_generate_equals_openk3_llm(ckpt):
    hf = _hf(ckpt)
    ids = _ids(T=9)
    llm = openk3.LLM(openk3.load(ckpt, dtype=torch.float32))
    want = [o.token_ids for o in llm.generate([r.tolist() for r in ids], temperature=0, max_tokens=12,
                                                         ignore_eos=True)]
    assert _greedy(hf, ids, 12).tolist() == want  # a batch of 2 rows, cached
    assert _greedy(hf, ids[:1], 12).tolist() == want[:1]
    assert _greedy(hf, ids, 12, use_cache=False).tolist() == want
    # and each step is the argmax of a full forward over everything so far
    seq = ids
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert seq[:, 9:].tolist() == [w[:4] for w in want]


def test_a_passed_cache_continues_and_beam_search_runs(ckpt):
    hf = _hf(ckpt)
    ids = _ids(T=10)
    with torch.no_grad():
        full = hf(ids).logits
        first = hf(ids[:, :7], use_cache=True)
        cache = first.past_key_values
        assert type(cache).__name__ == "K3Cache" and cache.get_seq_length() == 7
        torch.testing.assert_close(first.logits, full[:, :7], rtol=1e-5, atol=1e-5)
        for t in range(7, 10):
            step = hf(ids[:, t:t + 1], past_key_values=cache).logits
            torch.testing.assert_close(step[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="K3Cache"):
            from transformers import DynamicCache

            hf(ids, past_key_values=DynamicCache())
        with pytest.raises(ValueError, match="rolled back"):
            cache.crop(1)
    beams = hf.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert beams.shape == (2, 15)
    # with one beam, beam search is greedy search
    one = hf.generate(ids, max_new_tokens=5, num_beams=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(one[:, 10:], _greedy(hf, ids, 5))


def test_padding_is_exact_without_a_cache_and_refused_with_one(ckpt):
    hf = _hf(ckpt)
    a, b = _ids(1, 9, seed=1), _ids(1, 6, seed=2)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    with torch.no_grad():
        logits = hf(batch, attention_mask=mask).logits
        torch.testing.assert_close(logits[1, 3:], hf(b).logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[0], hf(a).logits[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="padded batch"):
        hf.generate(batch, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                      eos_token_id=None, use_cache=False)
    assert out[1, 9:].tolist() == _greedy(hf, b, 3)[0].tolist()


def test_packed_rows_by_position_ids_are_separate_documents(ckpt):
    hf = _hf(ckpt)
    a, b = _ids(1, 5, seed=3), _ids(1, 7, seed=4)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = hf(torch.cat([a, b], 1), position_ids=pos).logits
        torch.testing.assert_close(packed[:, 5:], hf(b).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, :5], hf(a).logits, rtol=1e-5, atol=1e-5)


# ---- PEFT LoRA ---------------------------------------------------------------------------------------------------

def _lora(model, r: int = 4):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                     target_modules=openk3.hf.lora_target_modules(model.config),
                     target_parameters=openk3.hf.lora_target_parameters(model.config))
    torch.manual_seed(0)  # (PEFT draws lora_A from the global generator)
    return get_peft_model(model, cfg)


def _randomise_lora_b(pm, seed: int = 0, scale: float = 0.05, only: str | None = None):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name and (only is None or name.startswith(only + ".lora_B")):
                p.copy_(scale * torch.randn(p.shape, generator=g))


def _lora_owners(pm) -> list[str]:
    return sorted({n.split(".lora_B")[0] for n, _ in pm.named_parameters() if "lora_B" in n})


def test_lora_targets_cover_the_model_and_every_lora_b_gets_a_gradient(ckpt):
    hf = _hf(ckpt)
    linears = {n for n, m in hf.language_model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = openk3.hf.lora_target_modules(hf.config)
    assert set(targets) == linears - {"lm_head", "model.layers.0.self_attention_res_proj"}
    pm = _lora(hf)
    kinds = {o.rsplit(".", 1)[-1] for o in _lora_owners(pm)}
    for kind in ("kv_b_proj", "self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj", "q_proj",
                 "g_proj", "routed_expert_up_proj", "gate_proj"):
        assert kind in kinds, kind
    assert any("experts" in o for o in _lora_owners(pm))
    ids = _ids()
    pm.train()
    pm(input_ids=ids, labels=ids).loss.backward()
    dead = [n for n, p in pm.named_parameters() if "lora_B" in n and (p.grad is None or not p.grad.abs().sum())]
    assert not dead, dead


def test_each_lora_target_changes_the_logits_in_training_and_in_cached_decode(ckpt):
    pm = _lora(_hf(ckpt))
    pm.eval()
    ids = _ids(T=8)
    with torch.no_grad():
        base = pm(input_ids=ids).logits
    owners = _lora_owners(pm)
    for i, owner in enumerate(owners):
        _randomise_lora_b(pm, seed=i, only=owner)
        with torch.no_grad():
            full = pm(input_ids=ids).logits
            assert not torch.equal(full, base), f"{owner}: LoRA did not change the logits"
            prefix = pm(input_ids=ids[:, :6], use_cache=True)
            cache = prefix.past_key_values
            steps = [pm(input_ids=ids[:, t:t + 1], past_key_values=cache).logits[:, 0] for t in (6, 7)]
        for t, step in zip((6, 7), steps):
            torch.testing.assert_close(step, full[:, t], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, o=owner: f"{o}: cached decode ignores the adapter: {m}")
        _randomise_lora_b(pm, scale=0.0, only=owner)


def test_merge_and_unload_keeps_logits_and_tokens(ckpt):
    pm = _lora(_hf(ckpt))
    _randomise_lora_b(pm, seed=7)
    pm.eval()
    ids = _ids(T=9)
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    tokens = _greedy(pm, ids, 8)
    merged = pm.merge_and_unload()
    assert not any(hasattr(m, "base_layer") for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(_greedy(merged, ids, 8), tokens)
    # and decode with merged weights equals the merged full forward's argmax (no stale decode caches)
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, merged(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq[:, 9:], tokens)


def test_linear_weight_of_a_lora_layer_is_base_plus_delta_without_a_probe(ckpt):
    from openk3.model.layers import linear_weight

    pm = _lora(_hf(ckpt))
    _randomise_lora_b(pm, seed=2)
    kv_b = pm.base_model.model.language_model.model.layers[3].self_attn.kv_b_proj
    res = pm.base_model.model.language_model.model.layers[2].mlp_res_proj
    for m in (kv_b, res):
        eye = torch.eye(m.in_features)
        called = []
        handle = m.register_forward_hook(lambda *a, seen=called: seen.append(1))
        w = linear_weight(m)
        handle.remove()
        assert not called  # (no identity-matrix probe: at K3's width it would be 7168 x 7168 per AttnRes site)
        torch.testing.assert_close(w, m(eye).t(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(w, m.base_layer.weight)
    from peft import LoraConfig, get_peft_model

    biased = get_peft_model(_hf(ckpt), LoraConfig(r=2, lora_bias=True, target_modules=["kv_b_proj"]))
    with pytest.raises(ValueError, match="lora_bias"):
        biased(input_ids=_ids())


def test_expert_adapters_leave_no_copy_of_the_experts_behind(ckpt):
    pm = _lora(_hf(ckpt))
    _randomise_lora_b(pm, seed=4)
    moe = pm.base_model.model.language_model.model.layers[1].block_sparse_moe
    ids = _ids(1, 3)
    with torch.no_grad():
        pm(input_ids=ids)
        z = torch.randn(2, moe.experts.get_base_layer().w1.shape[2])
        w, idx = torch.full((2, 2), 0.5), torch.tensor([[0, 1], [2, 3]])
        lora_out = moe.experts(z, w, idx, moe.glu, moe.act, "sparse")
        base = moe.experts.get_base_layer()
        assert "expert_views" not in base.__dict__.get("_decode_cache", {})  # (views of W + delta: a 2nd copy)
        plain = base(z, w, idx, moe.glu, moe.act, "sparse")  # (the base alone caches views of its parameters)
    assert not torch.equal(lora_out, plain)  # the adapter is on in the sparse (decode) path


def test_from_pretrained_arguments(ckpt, tmp_path):
    hf = _hf(ckpt, use_cache=False)
    assert hf.config.use_cache is False
    other = AutoConfig.from_pretrained(ckpt)
    other.text_config.num_experts_per_token = 1
    with pytest.raises(ValueError, match="another model"):
        _hf(ckpt, config=other)
    with pytest.raises(ValueError, match="unsupported arguments"):
        _hf(ckpt, num_experts_per_token=1)
    import shutil

    shutil.copytree(ckpt, tmp_path / "sub")
    assert _hf(tmp_path, subfolder="sub").language_model.config == openk3.checkpoint.read_config(ckpt)
    with pytest.raises(ValueError, match="output_hidden_states"):
        hf(_ids(), output_hidden_states=True)


def test_resized_embeddings_save_and_load(ckpt, tmp_path):
    hf = _hf(ckpt)
    hf.resize_token_embeddings(V + 64)
    assert hf.language_model.config.vocab_size == V + 64 and hf.config.text_config.vocab_size == V + 64
    hf.save_pretrained(tmp_path / "big")
    back = openk3.load(tmp_path / "big", dtype=torch.float32)
    assert back.lm_head.weight.shape[0] == V + 64
    assert back.config.eos_token_id == openk3.checkpoint.read_config(ckpt).eos_token_id  # ids do not move


def test_saving_a_model_with_adapter_layers_is_refused(ckpt, tmp_path):
    pm = _lora(_hf(ckpt))
    with pytest.raises(ValueError, match="adapter"):
        pm.base_model.model.save_pretrained(tmp_path / "x")


# ---- Trainer -------------------------------------------------------------------------------------------------------

class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, T: int = 16) -> None:
        g = torch.Generator().manual_seed(5)
        base = torch.randint(0, 64, (4,), generator=g)
        self.rows = [base.repeat(T // 4) for _ in range(n)]  # a pattern the model can learn in a few steps

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=4, learning_rate=1e-2, max_steps=5,
                report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                lr_scheduler_type="constant", dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def _eval_loss(model) -> float:
    batch = _Rows()[0]
    with torch.no_grad():
        return model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.item()


def test_trainer_lora_lowers_the_loss_and_leaves_the_base_alone(ckpt, tmp_path):
    from transformers import Trainer

    hf = _hf(ckpt)
    base = {k: v.clone() for k, v in hf.language_model.state_dict().items()}
    pm = _lora(hf)
    before = _eval_loss(pm)
    Trainer(model=pm, args=_args(tmp_path), train_dataset=_Rows()).train()
    after = _eval_loss(pm)
    assert after < before - 0.05, (before, after)
    base_now = {k.replace(".base_layer", ""): v for k, v in pm.base_model.model.language_model.state_dict().items()
                if "lora_" not in k}
    for k, v in base.items():
        assert torch.equal(base_now[k], v), k
    # the adapter as PEFT saves it, on a fresh base: the same model
    from peft import PeftModel

    pm.save_pretrained(tmp_path / "adapter")
    again = PeftModel.from_pretrained(_hf(ckpt), tmp_path / "adapter")
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, pm.eval()(input_ids=ids).logits)


def test_gradient_checkpointing_gives_the_same_gradients(ckpt):
    grads = []
    for checkpointing in (False, True):
        pm = _lora(_hf(ckpt))
        _randomise_lora_b(pm, seed=3)
        pm.train()
        if checkpointing:
            pm.base_model.model.activation_checkpointing_enable()
            assert pm.base_model.model.is_gradient_checkpointing
        ids = _ids()
        pm(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_trainer_resume_restores_stacked_experts_exactly(ckpt, tmp_path):
    from transformers import Trainer

    hf = _hf(ckpt)
    args = _args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, learning_rate=1e-3)
    Trainer(model=hf, args=args, train_dataset=_Rows()).train()
    trained = {k: v.clone() for k, v in hf.state_dict().items()}
    saved = tmp_path / "checkpoint-2"
    assert (saved / "config.json").is_file()
    fresh = _hf(ckpt)
    expert = "language_model.model.layers.1.block_sparse_moe.experts.w1"
    assert not torch.equal(fresh.state_dict()[expert], trained[expert])  # training moved the experts
    Trainer(model=fresh, args=args, train_dataset=_Rows())._load_from_checkpoint(str(saved))
    for k, v in trained.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # sharded (a layer's experts split across shards, read shard by shard): the same
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size=3_000_000)  # (few shards: transformers collects garbage after each)
    where = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({f for k, f in where.items() if ".layers.1.block_sparse_moe.experts." in k}) > 1  # split
    fresh = _hf(ckpt)
    Trainer(model=fresh, args=args, train_dataset=_Rows())._load_from_checkpoint(str(sharded))
    for k, v in trained.items():
        assert torch.equal(fresh.state_dict()[k], v), k


# ---- the documented example -----------------------------------------------------------------------------------

def test_the_lora_example_in_docs_runs(ckpt, tmp_path, monkeypatch, capsys):
    text = (Path(__file__).parent.parent / "docs" / "ecosystem.md").read_text()
    code = text.split("<!-- lora-example -->")[1].split("```python")[1].split("```")[0]
    assert len(code.strip().splitlines()) <= 20
    monkeypatch.setattr(sys, "argv", ["example", str(ckpt), str(tmp_path / "adapter")])
    exec(compile(code, "docs/ecosystem.md", "exec"), {"__name__": "__main__"})  # (in process: no second start-up)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    losses = [float(line.split("'loss': '")[1].split("'")[0]) for line in capsys.readouterr().out.splitlines()
              if "'loss': '" in line]
    assert len(losses) == 2 and losses[1] < losses[0], losses
