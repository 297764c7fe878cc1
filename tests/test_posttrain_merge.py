"""The merge ablation's methods (openk3/posttrain/merge.py): the identities of background §3.10, the
method definitions on hand-made task vectors, MXFP4 experts, and the errors."""

from __future__ import annotations

import pytest
import torch
from helpers import nano_cut

from openk3.posttrain.merge import METHODS, dare, linear, merge, model_stock, task_arithmetic, ties
from openk3.quant.mxfp4 import pack, unpack


def _sd(seed, scale=1.0, like=None):
    """A small state dict with the kinds of tensors a checkpoint holds (matrix, vector, an int buffer)."""
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(8, 16, generator=g) * scale, "b": torch.randn(16, generator=g) * scale,
          "steps": torch.tensor([3, 1], dtype=torch.int64)}
    if like is not None:
        sd = {k: like[k] + v if v.is_floating_point() else v for k, v in sd.items()}
    return sd


def _nano_sd(seed):
    from openk3.model.model import K3ForCausalLM

    return K3ForCausalLM.build(nano_cut(), dtype=torch.float32, seed=seed).state_dict()


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("method", METHODS)
def test_identical_inputs_give_identical_output(method):
    sd = _nano_sd(3)
    copies = [{k: v.clone() for k, v in sd.items()} for _ in range(3)]
    result = merge(sd, copies, method, density=0.3, lam=2.0, seed=1)
    assert _equal(result.state_dict, sd)


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "ties", "dare_ties", "dare_task_arithmetic",
                                    "model_stock"])
def test_identical_fine_tuned_models_merge_to_that_model(method):
    base, tuned = _sd(0), _sd(1, 0.1, like=_sd(0))
    result = merge(base, [tuned, dict(tuned), dict(tuned)], method, density=1.0)
    assert _equal(result.state_dict, tuned)
    if method == "model_stock":  # N identical task vectors: cos = 1 -> t = 1
        assert result.report["model_stock_t"] == {"w": pytest.approx(1.0), "b": pytest.approx(1.0)}


def test_linear_weights_select_and_average():
    a, b = _sd(1), _sd(2)
    assert _equal(linear([a, b], weights=[1, 0]), a)
    assert _equal(linear([a, b], weights=[0, 3]), b)
    mean = linear([a, b], weights=[2, 2])
    torch.testing.assert_close(mean["w"], (a["w"] + b["w"]) / 2)


def test_task_arithmetic_is_base_plus_lambda_mean_task_vector():
    base = _sd(0)
    models = [_sd(i, 0.1, like=base) for i in (1, 2, 3)]
    out = task_arithmetic(base, models, lam=2.0)
    want = base["w"].double() + 2.0 * sum(m["w"].double() - base["w"].double() for m in models) / 3
    assert torch.equal(out["w"], want.float())


def test_ties_trims_elects_the_sign_and_averages_only_agreeing_entries():
    base = {"x": torch.zeros(4)}
    taus = [torch.tensor([3.0, -1.0, 0.5, -2.0]), torch.tensor([1.0, 2.0, -0.1, -2.0]),
            torch.tensor([-1.0, 2.0, -0.1, 4.0])]
    models = [{"x": t} for t in taus]
    # density 1: signs sum to (+, +, +, 0) -> entry 0: mean(3, 1); 1: mean(2, 2); 2: 0.5 alone; 3: tie -> 0
    torch.testing.assert_close(ties(base, models, density=1.0)["x"], torch.tensor([2.0, 2.0, 0.5, 0.0]))
    # density 0.5 keeps each vector's top 2 magnitudes: [3, 0, 0, -2], [0, 2, 0, -2], [0, 2, 0, 4]
    torch.testing.assert_close(ties(base, models, density=0.5, lam=2.0)["x"], torch.tensor([6.0, 4.0, 0.0, 0.0]))
    # random task vectors: every merged entry has the elected sign (or is 0), never the minority's
    g = torch.Generator().manual_seed(0)
    models = [{"x": torch.randn(1000, generator=g)} for _ in range(5)]
    out = ties({"x": torch.zeros(1000)}, models, density=0.6)["x"]
    trimmed = []
    for m in models:
        t = m["x"].clone()
        t[t.abs().argsort(descending=True)[600:]] = 0
        trimmed.append(t)
    elected = torch.sign(torch.stack(trimmed).sum(0))
    assert bool(((torch.sign(out) == elected) | (out == 0)).all()) and bool((out != 0).any())


def test_dare_at_density_one_is_task_arithmetic_and_ties():
    base = _sd(0)
    models = [_sd(i, 0.1, like=base) for i in (1, 2, 3)]
    assert _equal(dare(base, models, density=1.0, then="task_arithmetic", lam=1.5),
                  task_arithmetic(base, models, lam=1.5))
    assert _equal(dare(base, models, density=1.0), ties(base, models, density=1.0))


def test_dare_drops_and_rescales_reproducibly():
    base = {"x": torch.zeros(20000)}
    tau = torch.full((20000,), 0.5)
    out = dare(base, [{"x": tau}], density=0.25, seed=7, then="task_arithmetic")["x"]
    kept = out != 0
    assert abs(float(kept.float().mean()) - 0.25) < 0.02
    assert bool((out[kept] == 2.0).all())  # 0.5 / 0.25
    assert torch.equal(out, dare(base, [{"x": tau}], density=0.25, seed=7, then="task_arithmetic")["x"])
    assert not torch.equal(out, dare(base, [{"x": tau}], density=0.25, seed=8, then="task_arithmetic")["x"])


def test_model_stock_t_from_the_cosine():
    base = {"x": torch.zeros(2)}
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])  # cos 45 degrees
    c = 2 ** -0.5
    t = 2 * c / (1 + c)
    result = merge(base, [{"x": a}, {"x": b}], "model_stock")
    assert result.report["model_stock_t"]["x"] == pytest.approx(t)
    torch.testing.assert_close(result.state_dict["x"], t * (a + b) / 2)
    # opposite task vectors: the mean cosine is negative, clamped to 0 -> t = 0 -> the base
    assert torch.equal(model_stock(base, [{"x": a}, {"x": -a}])["x"], base["x"])


def test_mxfp4_experts_are_dequantised_merged_and_requantised_with_the_error_recorded():
    g = torch.Generator().manual_seed(0)
    w0, w1, w2 = (torch.randn(4, 8, 64, generator=g) * 0.02 for _ in range(3))

    def sd(w):
        p, s = pack(w)
        return {"experts.w1_packed": p, "experts.w1_scale": s, "norm": torch.ones(3)}

    base, m1, m2 = sd(w0), sd(w1), sd(w2)
    for method in METHODS:  # the same bytes (the -0 codes included), no quantisation error
        same = merge(base, [dict(base), dict(base)], method, density=0.5)
        assert _equal(same.state_dict, base) and same.report["quant_error"]["experts.w1"]["max_abs"] == 0
    result = merge(base, [m1, m2], "linear")
    deq = [unpack(d["experts.w1_packed"], d["experts.w1_scale"], torch.float32) for d in (m1, m2)]
    merged = ((deq[0].double() + deq[1].double()) / 2).float()
    p, s = pack(merged)
    # the requantised mean (bytes may differ only by the sign of a zero: -0 == +0)
    assert torch.equal(unpack(result.state_dict["experts.w1_packed"], result.state_dict["experts.w1_scale"]),
                       unpack(p, s))
    assert torch.equal(result.state_dict["experts.w1_scale"], s)
    assert result.state_dict["experts.w1_packed"].dtype == torch.uint8
    err = result.report["quant_error"]["experts.w1"]
    want = (merged - unpack(p, s, torch.float32)).abs().max()
    assert err["max_abs"] == pytest.approx(float(want)) and 0 < err["rel_rms"] < 0.2


def test_mismatched_state_dicts_and_bad_arguments_are_value_errors():
    base = _sd(0)
    other = _sd(1)
    with pytest.raises(ValueError, match="model 2 has no tensor 'b'"):
        merge(base, [other, {k: v for k, v in other.items() if k != "b"}], "linear")
    with pytest.raises(ValueError, match="model 1 has a tensor 'extra'"):
        merge(base, [{**other, "extra": torch.zeros(1)}], "linear")
    with pytest.raises(ValueError, match=r"tensor 'w' has shape \(16, 8\) in model 1"):
        merge(base, [{**other, "w": other["w"].t()}], "task_arithmetic")
    with pytest.raises(ValueError, match="tensor 'b' is torch.float64 in model 1"):
        merge(base, [{**other, "b": other["b"].double()}], "task_arithmetic")
    with pytest.raises(ValueError, match="non-float tensor 'steps' differs"):
        merge(base, [{**other, "steps": torch.tensor([3, 2])}], "linear")
    with pytest.raises(ValueError, match="method must be one of"):
        merge(base, [other], "slerp")
    with pytest.raises(ValueError, match="density must be in"):
        merge(base, [other], "ties", density=0.0)
    with pytest.raises(ValueError, match="2 weights for 1 models"):
        merge(base, [other], "linear", weights=[1, 1])
    with pytest.raises(ValueError, match="weights must be finite"):
        merge(base, [other, other], "linear", weights=[1, -1])
    with pytest.raises(ValueError, match="model_stock needs at least 2"):
        merge(base, [other], "model_stock")
    with pytest.raises(ValueError, match="model_stock takes no weights"):
        merge(base, [other, other], "model_stock", weights=[1, 2])


# --- `openk3 merge` (openk3/commands/merge.py), through its main ------------------------------------


def _run(argv):
    import argparse

    from openk3.commands import merge as cmd

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    return cmd.main(p.parse_args(argv))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A (4-layer) nano base and two fine-tuned copies (small random task vectors), saved in fp32 with float
    experts and with MXFP4 experts; the base carries an extra (tokenizer-like) file."""
    import openk3
    from openk3.model.model import K3ForCausalLM

    root = tmp_path_factory.mktemp("merge")
    (root / "tokenizer_config.json").write_text("{}")
    paths = {}
    for i, name in enumerate(("base", "m1", "m2")):
        model = K3ForCausalLM.build(nano_cut(), dtype=torch.float32, seed=3)
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.01)
        extra = {"tokenizer_config.json": str(root / "tokenizer_config.json")} if name == "base" else None
        for fmt in ("bf16", "mxfp4"):
            paths[name, fmt] = root / f"{name}-{fmt}"
            openk3.save(model, paths[name, fmt], dtype=torch.float32, experts_format=fmt, extra_files=extra)
    return root, paths


def _loaded_sd(path, packed=False):
    import openk3

    return openk3.load(path, dtype=torch.float32, keep_packed=packed).state_dict()


def test_merge_command_linear_one_zero_writes_the_first_model_with_report_and_base_files(ckpts, capsys):
    import json

    root, paths = ckpts
    out = root / "soup"
    rc = _run(["--base", str(paths["base", "bf16"]), "--models", str(paths["m1", "bf16"]), str(paths["m2", "bf16"]),
               "--method", "linear", "--weights", "1", "0", "--out", str(out)])
    assert rc == 0 and "[merge] linear of 2 models" in capsys.readouterr().out
    assert _equal(_loaded_sd(out), _loaded_sd(paths["m1", "bf16"]))
    report = json.loads((out / "merge_report.json").read_text())
    assert report["method"] == "linear" and report["weights"] == [1.0, 0.0] and report["dtype"] == "float32"
    assert (out / "tokenizer_config.json").is_file()


def test_merge_command_equals_the_library_merge(ckpts):
    root, paths = ckpts
    out = root / "ties"
    _run(["--base", str(paths["base", "bf16"]), "--models", str(paths["m1", "bf16"]), str(paths["m2", "bf16"]),
          "--method", "ties", "--density", "0.4", "--lam", "1.5", "--out", str(out)])
    want = merge(_loaded_sd(paths["base", "bf16"]), [_loaded_sd(paths[m, "bf16"]) for m in ("m1", "m2")], "ties",
                 density=0.4, lam=1.5).state_dict
    assert _equal(_loaded_sd(out), want)
    assert not _equal(want, _loaded_sd(paths["base", "bf16"]))


def test_merge_command_on_mxfp4_checkpoints_requantises_and_records_the_error(ckpts):
    import json

    from openk3.checkpoint import read_config

    root, paths = ckpts
    out = root / "ta-mxfp4"
    _run(["--base", str(paths["base", "mxfp4"]), "--models", str(paths["m1", "mxfp4"]), str(paths["m2", "mxfp4"]),
          "--method", "task_arithmetic", "--lam", "2", "--out", str(out)])
    assert "quantization_config" in read_config(out).extra  # written in the base's expert format
    want = merge(_loaded_sd(paths["base", "mxfp4"], True), [_loaded_sd(paths[m, "mxfp4"], True) for m in ("m1", "m2")],
                 "task_arithmetic", lam=2.0)
    assert _equal(_loaded_sd(out, packed=True), want.state_dict)
    errors = json.loads((out / "merge_report.json").read_text())["quant_error"]
    assert set(errors) == set(want.report["quant_error"]) and len(errors) == 3 * 3  # w1/w3/w2 of the 3 MoE layers
    assert all(0 < e["rel_rms"] < 0.2 for e in errors.values())


def test_merge_command_rejects_other_configs_formats_and_overwriting_an_input(ckpts):
    import dataclasses

    import openk3
    from openk3.model.model import K3ForCausalLM

    root, paths = ckpts
    other = root / "other-eps"
    openk3.save(K3ForCausalLM.build(dataclasses.replace(nano_cut(), rms_norm_eps=1e-6), dtype=torch.float32, seed=3),
                other, dtype=torch.float32)
    base = ["--base", str(paths["base", "bf16"]), "--method", "linear"]
    with pytest.raises(ValueError, match=r"other-eps/config.json: config differs from the base .*rms_norm_eps"):
        _run([*base, "--models", str(paths["m1", "bf16"]), str(other), "--out", str(root / "x")])
    with pytest.raises(ValueError, match="routed experts are mxfp4, the base's are float"):
        _run([*base, "--models", str(paths["m1", "mxfp4"]), "--out", str(root / "x")])
    with pytest.raises(ValueError, match="is one of the inputs"):
        _run([*base, "--models", str(paths["m1", "bf16"]), "--out", str(paths["m1", "bf16"])])
    with pytest.raises(ValueError, match="3 weights for 1 models"):
        _run([*base, "--models", str(paths["m1", "bf16"]), "--weights", "1", "2", "3", "--out", str(root / "x")])
    assert not (root / "x").exists()
