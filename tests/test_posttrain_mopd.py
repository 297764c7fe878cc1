"""`openk3 distill` (issue 18 item 4): multi-teacher on-policy distillation.

What MOPD relies on: every sample is scored by the teacher of its own (domain, effort) cell and by no other
(sentinel teachers record what they scored); a teacher equal to the student gives ~0 advantages and a step
that leaves the weights unchanged; alpha and ppo_epochs reach the loss; the MOPD gradient descends the exact
reverse KL, and distilling toward a sharper teacher halves it; a killed run resumes to the uninterrupted run's
numbers; the command runs end to end on tiny checkpoints.
One thread; the 4-layer cut of nano and the byte tokenizer of tests/test_posttrain_rl.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import math

import pytest
import torch
from helpers import Killed, nano_cut, torn_write_at

import openk3
from openk3.chat import OPEN, SEP
from openk3.checkpoint import runs
from openk3.infer.engine import Engine
from openk3.posttrain.domains.records import byte_tokenizer
from openk3.posttrain.trainers.mopd import MOPDConfig, distill, draw_cells, floor_gaps, mopd_step, read_teacher_map
from openk3.posttrain.trainers.rollout import Problem, RolloutConfig
from openk3.train.metrics import read_metrics
from openk3.train.optim import OptimConfig, build_optimizer

TOK = byte_tokenizer()
THINK_OPEN = [TOK.special_ids[OPEN], *TOK.encode("think"), TOK.special_ids[SEP]]


def tiny_model(seed: int = 0) -> openk3.K3ForCausalLM:
    cfg = nano_cut()
    return openk3.K3ForCausalLM.build(cfg, seed=seed).eval()


def problems(cells: list[str], budget: int = 7) -> list[Problem]:
    """One short prompt per cell; `budget` cuts each trajectory at budget + 1 think tokens (kept short)."""
    return [Problem(f"p{i}", TOK.encode(f"q{i}") + THINK_OPEN, budget=budget, score=lambda turn: 0.0,
                    meta={"domain": c.split("/")[0], "effort": c.split("/")[1]}) for i, c in enumerate(cells)]


def optimizer(model, lr: float):
    return build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0, qk_clip_tau=None))


class Sentinel(torch.nn.Module):
    """A teacher that records the rows it scored and answers with its own constant log-prob per token, so a
    sample scored by the wrong teacher shows the wrong value."""

    def __init__(self, value: float):
        super().__init__()
        self.value, self.seen = value, []

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        self.seen += [row.tolist() for row in ids_BT]
        # log-softmax = `value` at every real id (512): an extra column, never a target, holds the rest
        logits = torch.full((*ids_BT.shape, 513), self.value)
        logits[..., 512] = math.log1p(-512 * math.exp(self.value))
        return logits


# ---- routing --------------------------------------------------------------------------------------------


def test_each_cell_is_scored_by_its_own_teacher_only():
    model = tiny_model()
    cells = ["general/low", "coding/max", "general/high", "general/low", "agent/high", "coding/max"]
    teachers = {c: Sentinel(-7.0 - k) for k, c in enumerate(dict.fromkeys(cells))}
    teachers["agent/low"] = Sentinel(-20.0)  # a cell with no samples: never called
    cfg = MOPDConfig(lr=1e-3, group_size=2)
    records, metrics = mopd_step(cfg, model, optimizer(model, 1e-3), Engine(model, None, max_num_seqs=12),
                                 problems(cells, budget=3), teachers, TOK,
                                 RolloutConfig(group_size=2, response_cap=4, seed=0), 0)
    assert [r["teacher_cell"] for r in records] == [c for c in cells for _ in range(2)]
    for cell, teacher in teachers.items():
        mine = [r for r in records if r["teacher_cell"] == cell]
        # exactly its samples' full sequences (prompt + generated, right-padded to their longest), each once
        n = max((len(r["token_ids"]) for r in mine), default=0)
        assert sorted(teacher.seen) == sorted(r["token_ids"] + [0] * (n - len(r["token_ids"])) for r in mine)
        for r in mine:
            assert len(r["teacher_logprobs"]) == len(r["behaviour_logprobs"]) == sum(r["gen_mask"])
            assert r["teacher_logprobs"] == pytest.approx([teacher.value] * len(r["teacher_logprobs"]), abs=1e-5)
    assert teachers["agent/low"].seen == []
    assert set(metrics["cells"]) == set(cells) and metrics["cells"]["general/low"]["n"] == 4
    for cell, stats in metrics["cells"].items():  # per-cell reverse KL uses that cell's teacher
        rows = [r for r in records if r["teacher_cell"] == cell]
        behaviour = [x for r in rows for x in r["behaviour_logprobs"]]
        assert stats["reverse_kl"] == pytest.approx(sum(behaviour) / len(behaviour) - teachers[cell].value, abs=1e-4)


def test_a_sample_without_a_teacher_is_refused_by_name():
    model = tiny_model()
    with pytest.raises(ValueError, match="sample 1: no teacher for cell coding/low"):
        mopd_step(MOPDConfig(group_size=1), model, optimizer(model, 1e-3), Engine(model, None),
                  problems(["general/low", "coding/low"], budget=2), {"general/low": Sentinel(-7.0)}, TOK,
                  RolloutConfig(group_size=1, response_cap=2), 0)


def test_cells_are_drawn_uniformly_and_reproducibly():
    cells = ["general/low", "general/high", "agent/max"]
    drawn = [c for step in range(300) for c in draw_cells(cells, 8, seed=0, step=step)]
    assert draw_cells(cells, 8, 0, 5) == draw_cells(cells, 8, 0, 5) != draw_cells(cells, 8, 1, 5)
    for c in cells:
        assert abs(drawn.count(c) / len(drawn) - 1 / 3) < 0.03


# ---- student == teacher ---------------------------------------------------------------------------------


def test_a_teacher_equal_to_the_student_gives_no_update():
    """The gap is only sampler/trainer numerics (~1e-6): advantages ~0. By default (adv_floor 0, steps scaled by
    the gradient norm) the weights move ~1e-6 of a step; with the floor the step is skipped (weights and
    optimizer state untouched); without the scaling (update_ref None) Muon turns the noise into a full
    learning-rate step, the reason both exist."""
    for floor, ref, moves in ((0.0, 1.0, "tiny"), (1e-3, 1.0, "none"), (0.0, None, "full")):
        model = tiny_model()
        before = copy.deepcopy(model).requires_grad_(False)
        cfg = MOPDConfig(lr=1e-3, adv_floor=floor, update_ref=ref)
        opt = optimizer(model, cfg.lr)
        records, metrics = mopd_step(cfg, model, opt, Engine(model, None, max_num_seqs=4),
                                     problems(["general/low"] * 4, budget=20), {"general/low": before}, TOK,
                                     RolloutConfig(group_size=1, response_cap=4, seed=1), 0)
        gaps = [abs(t - b) for r in records
                for t, b in zip(r["teacher_logprobs"], r["behaviour_logprobs"], strict=True)]
        assert len(gaps) >= 40 and max(gaps) < 1e-4
        assert abs(metrics["reverse_kl"]) < 1e-5 and metrics["clipped_frac"] == 0
        moved = max(float((p.detach() - before.get_parameter(n)).abs().max()) for n, p in model.named_parameters())
        if moves == "none":
            assert metrics["floored_frac"] == 1.0 and metrics["grad_norm"] == 0.0 and moved == 0.0
            assert metrics["skipped"] == 1 and all(not o.state for o in opt.optimizers)
            assert metrics["cells"]["general/low"]["floored_frac"] == 1.0
        else:
            assert 0 < metrics["grad_norm"] < 1e-4 and metrics["skipped"] == 0
            if moves == "full":
                assert metrics["update_scale"] == 1.0 and moved > 0.1 * cfg.lr  # noise, amplified to ~lr
            else:
                assert metrics["update_scale"] == metrics["grad_norm"] and 0 < moved < 1e-5 * cfg.lr


def test_floor_gaps_closes_only_the_small_gaps():
    teacher = torch.tensor([[-1.0, -2.0005, -3.5, -4.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -3.0, -4.0009]])
    out = floor_gaps(teacher, behaviour, 1e-3)
    assert torch.equal(out, torch.tensor([[-1.0, -2.0, -3.5, -4.0009]]))
    assert floor_gaps(teacher, behaviour, 0.0) is teacher


def test_alpha_and_ppo_epochs_reach_the_loss():
    """alpha mixes the group-centred task reward (rewards differ by the first token's parity here), and a
    second pass over the batch is PPO-clipped (its clip fraction is logged)."""
    losses = {}
    for alpha, epochs in ((0.0, 1), (0.5, 1), (0.0, 2)):
        model = tiny_model()
        probs = [dataclasses.replace(p, score=lambda turn: float(turn["ids"][0] % 2))
                 for p in problems(["general/low"] * 2, budget=5)]
        cfg = MOPDConfig(lr=1e-2, group_size=4, alpha=alpha, ppo_epochs=epochs)
        records, metrics = mopd_step(cfg, model, optimizer(model, cfg.lr), Engine(model, None, max_num_seqs=8),
                                     probs, {"general/low": tiny_model(1)}, TOK,
                                     RolloutConfig(group_size=4, response_cap=4, seed=2,
                                                   extra_stop_ids=tuple(range(512))), 0)
        assert len({r["reward"] for r in records}) == 2  # both parities: a non-zero outcome advantage
        losses[alpha, epochs] = metrics["loss"], metrics["grad_norm"]
        assert ("ratio_clip_frac_last" in metrics) == (epochs > 1)
    # one-token trajectories: the centred outcome term sums to 0 in the loss's value, not in its gradient
    assert losses[0.5, 1][1] != pytest.approx(losses[0.0, 1][1], rel=1e-3)
    assert losses[0.0, 2] == losses[0.0, 1]  # the logged loss and gradient are the first (on-policy) pass's


def test_the_mopd_gradient_descends_the_full_vocabulary_reverse_kl():
    """The dense sampled-token reward is an estimate of -grad KL(student || teacher): a small step against the
    MOPD loss's gradient lowers the exact (full-vocabulary) reverse KL at the sampled positions, a step along
    it raises it. A sign error or a teacher scored one position off fails here. The student is a flatter
    copy of the teacher (lm_head x10 vs x30) so 512 samples carry a clear signal."""
    from openk3.posttrain.trainers import losses
    from openk3.posttrain.trainers.mopd import teacher_logprobs
    from openk3.posttrain.trainers.rl import make_batch, token_logprobs
    from openk3.posttrain.trainers.rollout import rollout

    torch.manual_seed(0)
    model = tiny_model()
    teacher = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        teacher.lm_head.weight.mul_(30)
    records = rollout(Engine(model, None, max_num_seqs=64), problems(["general/low"] * 64, budget=7), TOK,
                      RolloutConfig(group_size=1, response_cap=8, seed=0))
    batch = make_batch(records)
    ids, mask = batch["ids_BT"], batch["mask_BT"]
    teacher_BT, _ = teacher_logprobs(records, ids, {"general/low": teacher})
    # scored in chunks of rows (the full profile's memory bound): the same log-probs
    chunked, _ = teacher_logprobs(records, ids, {"general/low": teacher}, micro_tokens=3 * ids.shape[1])
    assert torch.allclose(chunked, teacher_BT, atol=1e-6) and teacher_BT[mask].abs().min() > 0
    with torch.no_grad():
        teacher_all = torch.log_softmax(teacher(ids)[:, :-1].float(), -1)

    def exact_kl() -> float:
        with torch.no_grad():
            student_all = torch.log_softmax(model(ids)[:, :-1].float(), -1)
            return float((student_all.exp() * (student_all - teacher_all)).sum(-1)[mask].mean())

    logp, _ = token_logprobs(model, ids)
    loss, _ = losses.mopd_loss(logp, batch["behaviour_BT"], teacher_BT, mask)
    loss.backward()
    start = exact_kl()
    change = {}
    for sign in (-1, 1):
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(sign * 1e-5 * p.grad)
        change[sign] = exact_kl() - start
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(sign * 1e-5 * p.grad)
    assert change[-1] < -1e-3 and change[1] > 1e-3, (start, change)


def test_distilling_toward_a_sharper_teacher_halves_the_reverse_kl():
    """A learning signal at tiny scale: the student is a flatter copy of its teacher (lm_head x10 vs x30, an
    under-trained student); one-token episodes (every id ends the turn) put 32 samples on each of 2 contexts,
    so each step's sampled gradient is informative at a 512-id vocabulary. With many contexts and few samples
    each, 10 steps do not move a random-init student (the sampled-token signal drowns in noise there).
    Fixed seeds; the real optimizer (Muon + AdamW). 6 steps: the exact KL is at 0.26 x its start after two,
    0.16 x after four; the estimates fall from 2.9 to 0.36-1.1 (their last four average 0.65)."""
    torch.manual_seed(0)
    model = tiny_model()
    teacher = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        teacher.lm_head.weight.mul_(30)
    cfg = MOPDConfig(lr=1e-4, group_size=32)
    opt, engine = optimizer(model, cfg.lr), Engine(model, None, max_num_seqs=64)
    prompts = torch.tensor([p.prompt_ids for p in problems(["general/low"] * 2)])

    def exact_kl() -> float:  # full-vocabulary KL(student || teacher) at the two contexts
        with torch.no_grad():
            s, t = (torch.log_softmax(m(prompts)[:, -1].float(), -1) for m in (model, teacher))
            return float((s.exp() * (s - t)).sum(-1).mean())

    start, estimates = exact_kl(), []
    for step in range(6):
        _, metrics = mopd_step(cfg, model, opt, engine, problems(["general/low"] * 2), {"general/low": teacher}, TOK,
                               RolloutConfig(group_size=32, seed=step, extra_stop_ids=tuple(range(512))), step)
        estimates.append(metrics["reverse_kl"])
    assert sum(estimates[-4:]) / 4 <= 0.5 * estimates[0], estimates
    assert exact_kl() <= 0.5 * start, (start, exact_kl())


# ---- the run and the command --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A student and two different teachers saved with the byte tokenizer, as `openk3 distill` reads them."""
    root = tmp_path_factory.mktemp("mopd")
    for name, seed in (("student", 0), ("t_low", 1), ("t_high", 2)):
        openk3.save(tiny_model(seed), root / name, dtype=torch.float32)
        TOK.save(str(root / name))
    (root / "teachers.json").write_text(json.dumps({"general/low": "t_low", "general/high": "t_high"}))
    return root


def test_teachers_score_at_the_temperature_they_were_trained_at(ckpts, tmp_path):
    """A teacher inside an RL run folder scores at that run's temperature (the run folder or its checkpoint
    named), one outside any at 1, and `teacher_temperature` overrides both; the log-probs are the teacher's
    softmax at that temperature."""
    import shutil

    from openk3.posttrain.trainers.mopd import teacher_logprobs, teacher_temperatures, training_temperature

    run = tmp_path / "rl-run"
    shutil.copytree(ckpts / "t_low", run / "checkpoints" / "step_000002")
    (run / "checkpoints" / "step_000002" / runs.STATE_FILE).write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    (run / "rl_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert training_temperature(run) == 0.7 == training_temperature(run / "checkpoints" / "step_000002")
    assert training_temperature(ckpts / "t_high") == 1.0
    teachers = {"general/low": str(run), "general/high": str(ckpts / "t_high")}
    assert teacher_temperatures(MOPDConfig(teachers=teachers)) == {"general/low": 0.7, "general/high": 1.0}
    assert set(teacher_temperatures(MOPDConfig(teachers=teachers, teacher_temperature=1.0)).values()) == {1.0}
    (run / "rl_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="rl_config.json: temperature must be a number > 0, got 'hot'"):
        training_temperature(run)

    teacher = tiny_model(1).eval()
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    records = [{"domain": "general", "effort": "low", "token_ids": ids[0].tolist()}]
    got, _ = teacher_logprobs(records, ids, {"general/low": teacher}, temperatures={"general/low": 0.7})
    with torch.no_grad():
        want = torch.log_softmax(teacher(ids)[:, :-1].float() / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(got, want, atol=1e-6)
    cold, _ = teacher_logprobs(records, ids, {"general/low": teacher})
    assert not torch.allclose(cold, got, atol=1e-3)


RUN = dict(steps=3, prompts_per_step=3, response_cap=4, think_cap=6, save_every=1, lr=1e-3, clip=3.0,
           cells=("general/low", "general/high"))
RUN_FLAGS = ["--steps", "3", "--prompts-per-step", "3", "--response-cap", "4", "--think-cap", "6", "--save-every", "1",
             "--lr", "1e-3", "--clip", "3", "--cells", "general/low,general/high", "--threads", "1"]
TIMINGS = ("rollout_s", "teacher_s", "train_s")


@pytest.fixture(scope="module")
def command_run(ckpts, tmp_path_factory):
    """`openk3 distill` through its main with RUN's settings, run once: the end-to-end test checks it, and it is
    the uninterrupted run the resume test compares with. Returns (parsed args, out folder, what it printed)."""
    from openk3.commands import distill as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path_factory.mktemp("mopd-command") / "run"
    args = parser.parse_args(["--student", str(ckpts / "student"), "--teachers", str(ckpts / "teachers.json"),
                              "--out", str(out), *RUN_FLAGS])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert command.main(args) == 0
    return args, out, printed.getvalue()


def test_a_killed_run_resumes_to_the_uninterrupted_run(ckpts, command_run, tmp_path, monkeypatch):
    teachers = str(ckpts / "teachers.json")
    _, whole, _ = command_run
    saved = MOPDConfig.from_dict(json.loads((whole / "mopd_config.json").read_text()))
    assert saved == dataclasses.replace(MOPDConfig(student=str(ckpts / "student"), teachers=teachers, **RUN),
                                        student=saved.student, teachers=saved.teachers)  # the flags are RUN

    seen = []
    with pytest.raises(Killed), torn_write_at(monkeypatch, 2):  # inside step 2's checkpoint: resume redoes step 2
        distill(MOPDConfig(student=str(ckpts / "student"), teachers=teachers, **RUN), tmp_path / "killed",
                on_step=lambda step, m: seen.append(step))
    assert seen == [1, 2] and [s for s, _ in runs.list_checkpoints(tmp_path / "killed")] == [1]
    last = distill(MOPDConfig(student=str(ckpts / "student"), teachers=teachers, **RUN), tmp_path / "killed")
    assert last["step"] == 3

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]

    rows = strip(read_metrics(str(tmp_path / "killed" / "metrics.jsonl")))
    assert rows == strip(read_metrics(str(whole / "metrics.jsonl")))
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in rows)
    a = openk3.load(whole, dtype=torch.float32).state_dict()
    b = openk3.load(tmp_path / "killed", dtype=torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert distill(MOPDConfig(student=str(ckpts / "student"), teachers=teachers, **RUN), tmp_path / "killed") == {}
    with pytest.raises(ValueError, match=r"changed settings \(clip: 3.0 -> 2.0\)"):
        distill(MOPDConfig(student=str(ckpts / "student"), teachers=teachers, **{**RUN, "clip": 2.0}),
                tmp_path / "killed")


def test_the_command_runs_end_to_end(ckpts, command_run, capsys):
    from openk3.commands import distill as command

    args, out, printed = command_run
    assert "[distill] done: step 3" in printed
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reverse_kl", "clipped_frac", "entropy", "mismatch_kl", "think_mean", "loss", "grad_norm"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(abs(r["mismatch_kl"]) < 1e-4 for r in rows)  # sampler and trainer share the code
    cells = {c for r in rows for c in r["cells"]}
    assert cells <= {"general/low", "general/high"} and cells
    for r in rows:
        for stats in r["cells"].values():
            assert {"n", "reverse_kl", "clipped_frac", "floored_frac", "entropy", "mismatch_kl",
                    "think_mean"} <= set(stats)
    records = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert r["teacher_cell"] == f"{r['domain']}/{r['effort']}" and r["think_tokens"] <= 7
        assert len(r["teacher_logprobs"]) == sum(r["gen_mask"])
    saved = json.loads((out / "mopd_config.json").read_text())
    assert saved["clip"] == 3.0 and saved["teachers"]["general/low"] == str(ckpts / "t_low")
    trained = openk3.load(out, dtype=torch.float32)
    start = openk3.load(ckpts / "student", dtype=torch.float32)
    assert [n for n, p in trained.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    for n, b in trained.named_buffers():  # Quantile Balancing's router bias stays frozen
        if n.endswith("e_score_correction_bias"):
            assert torch.equal(b, start.get_buffer(n))
    assert command.main(args) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_bad_settings_are_named(ckpts, tmp_path):
    with pytest.raises(ValueError, match="alpha=0.5 .* needs group_size >= 2"):
        MOPDConfig(alpha=0.5)
    with pytest.raises(ValueError, match="mopd cells: no teacher for cell agent/low"):
        MOPDConfig(teachers={"general/low": "x"}, cells=("agent/low",))
    with pytest.raises(ValueError, match="teachers: 'general/medium' is not a cell"):
        read_teacher_map({"general/medium": "x"})
    bad = tmp_path / "t.json"
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="t.json: the teacher map must be a JSON object"):
        read_teacher_map(bad)
    other = tmp_path / "other"
    openk3.save(tiny_model(3), other, dtype=torch.float32)
    with pytest.raises(ValueError, match="teacher general/low .*: no tokenizer"):
        distill(MOPDConfig(student=str(ckpts / "student"), teachers={"general/low": str(other)},
                           **{**RUN, "cells": ("general/low",)}),
                tmp_path / "run")
