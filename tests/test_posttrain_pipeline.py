"""`openk3 posttrain` (issue 18 item 7): the whole pipeline, SFT data -> SFT -> teachers -> MOPD -> merge -> eval.

The `tiny` profile (a 4-layer cut of nano, its own BPE tokenizer, one or two steps per stage, n = 16 per cell)
runs end to end for the general domain and gives a report.json that follows the issue's contract for the
cells it ran, with checkpoints that `openk3.load` opens; a run stopped after a stage continues with the next
one on a rerun (done stages are skipped, their outputs untouched); bad arguments name the flag. One thread.
"""

from __future__ import annotations

import argparse
import json

import pytest

import openk3
from openk3.chat import THINKING_EFFORTS
from openk3.posttrain.evaluation.evaluate import MIN_N
from openk3.posttrain.pipeline import Pipeline, contract_problems, parse_domains

GENERAL = [f"general/{e}" for e in THINKING_EFFORTS]


def parser() -> argparse.ArgumentParser:
    from openk3.commands import posttrain as command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return p


def run_command(*argv: str) -> int:
    from openk3.commands import posttrain as command

    return command.main(parser().parse_args(list(argv)))


def stage_lines(printed: str) -> dict[str, str]:
    """{stage: "ran" | "skipped"} from the pipeline's progress lines."""
    out = {}
    for line in printed.splitlines():
        if line.startswith("[posttrain] stage ") and line.endswith((": running", ": done before, skipped")):
            name = line.split(" ", 3)[3].rsplit(":", 1)[0]
            out[name] = "skipped" if line.endswith("skipped") else "ran"
    return out


@pytest.mark.slow(seconds=22)  # about 35 s on one thread: nine cells' worth of evaluation (6 models x 3 cells x 16)
def test_tiny_profile_end_to_end_follows_the_contract_and_reruns_as_a_no_op(tmp_path, capsys):
    out = tmp_path / "pt"
    assert run_command("--preset", "nano", "--out", str(out), "--profile", "tiny", "--domains", "general",
                       "--threads", "1") == 0
    printed = capsys.readouterr().out
    assert set(stage_lines(printed).values()) == {"ran"}
    assert list(stage_lines(printed)) == ["base", "data", "sft", "teacher general/max", "teacher general/high",
                                          "teacher general/low", "mopd", "merge", "eval"]
    assert "[posttrain] done" in printed
    for name in ("sft", "student", "merged"):  # the summary says whether thinking is ordered by effort
        assert f"[posttrain] {name} general: accuracy low " in printed
    assert printed.count("(ordered low < high < max: ") == 3

    report = json.loads((out / "report.json").read_text())
    assert contract_problems(report, ("general",)) == []
    models, checkpoints = report["models"], report["checkpoints"]
    assert set(models) == {"sft", "student", "merged", "teachers"} and set(models["teachers"]) == set(GENERAL)
    for m in [models[k] for k in ("sft", "student", "merged")] + list(models["teachers"].values()):
        assert set(m) == {"general"} and set(m["general"]) == set(THINKING_EFFORTS)
        assert all(c["n"] >= MIN_N and 0 <= c["accuracy"] <= 1 for c in m["general"].values())
    # every checkpoint opens, and each is the stage's own (the teachers differ from SFT after their RL step)
    folders = [checkpoints[k] for k in ("sft", "student", "merged")] + list(checkpoints["teachers"].values())
    assert len(set(folders)) == 6
    weights = {}
    for folder in folders:
        model = openk3.load(folder)
        weights[folder] = model.model.embed_tokens.weight.detach().clone()
    assert str(out / "sft") in checkpoints["sft"] and str(out / "merged") == checkpoints["merged"]
    assert not weights[checkpoints["sft"]].equal(weights[checkpoints["teachers"]["general/max"]])

    state = json.loads((out / "pipeline.json").read_text())
    assert state["settings"] == {"preset": "nano", "profile": "tiny", "domains": ["general"], "base": None, "seed": 0}
    assert state["profile"]["eval_n"] >= MIN_N
    assert all(s["status"] == "done" for s in state["stages"].values()) and len(state["stages"]) == 9
    # the chain: max from SFT with its own budget, high from max and low from high with annealed budgets
    chain = {c: state["stages"][f"teacher {c}"]["settings"]["config"] for c in GENERAL}
    assert chain["general/max"]["model"].endswith("sft/checkpoints/step_000002")
    assert chain["general/max"]["budget_from_effort"] is None
    for cell, start, budget_from in (("general/high", "general-max", "max"), ("general/low", "general-high", "high")):
        assert f"teachers/{start}/" in chain[cell]["model"] and chain[cell]["budget_from_effort"] == budget_from
    # the run's tokenizer was trained on its domains and sized the model (posttrain/domains/vocab.py)
    base = state["stages"]["base"]["settings"]
    assert base["tokenizer"].startswith("bpe-") and 1024 < base["vocab_size"] <= 2048
    assert openk3.load(out / "base").config.vocab_size == base["vocab_size"]
    # SFT saw all three verbosities, longest at max
    think = state["stages"]["data"]["settings"]["think_tokens_mean"]
    assert think["general/low"] < think["general/high"] < think["general/max"]
    assert (out / "eval" / "report.md").is_file() and (out / "eval" / "teacher_rl.png").is_file()

    # item 8 through the chat API on the trained student (scripts/effort_demo.py): every effort answers,
    # thinking off ("none") gives no reasoning at all
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("effort_demo",
                                                  Path(__file__).parents[1] / "scripts" / "effort_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    think = demo.main([checkpoints["student"], "--n", "2", "--max-tokens", "8"])
    assert set(think) == {"low", "high", "max", "none"} and think["none"] == [0, 0]
    assert all(len(v) == 2 and max(v) <= 8 for v in think.values()), think

    # a rerun of a finished pipeline does nothing and leaves the report as it was
    before = (out / "report.json").read_bytes()
    assert run_command("--preset", "nano", "--out", str(out), "--profile", "tiny", "--domains", "general",
                       "--threads", "1") == 0
    assert set(stage_lines(capsys.readouterr().out).values()) == {"skipped"}
    assert (out / "report.json").read_bytes() == before


@pytest.mark.slow(seconds=70)  # 60-75 s, ~30 of them evaluation: 6 models x 3 cells x 16 sandboxed episodes
def test_tiny_profile_on_the_coding_domain_runs_every_stage_in_sandboxes(tmp_path, capsys):
    from openk3.agent import unavailable_reason

    if unavailable_reason():
        pytest.skip(f"no sandbox on this host: {unavailable_reason()}")
    out = tmp_path / "pt"
    assert run_command("--preset", "nano", "--out", str(out), "--profile", "tiny", "--domains", "coding",
                       "--threads", "1") == 0
    assert list(stage_lines(capsys.readouterr().out)) == ["base", "data", "sft", "teacher coding/max",
                                                          "teacher coding/high", "teacher coding/low", "mopd",
                                                          "merge", "eval"]
    report = json.loads((out / "report.json").read_text())
    assert contract_problems(report, ("coding",)) == []
    models = report["models"]
    assert set(models["teachers"]) == {f"coding/{e}" for e in THINKING_EFFORTS}
    for m in [models[k] for k in ("sft", "student", "merged")] + list(models["teachers"].values()):
        assert set(m) == {"coding"} and set(m["coding"]) == set(THINKING_EFFORTS)
        assert all(c["n"] >= MIN_N and "invalid_tool_calls" in c and c["turns"] >= 1 for c in m["coding"].values())
    for folder in [report["checkpoints"][k] for k in ("sft", "student", "merged")]:
        assert openk3.load(folder).config.vocab_size <= 2048
    state = json.loads((out / "pipeline.json").read_text())
    # the coding records (tool declarations alone ~1,200 tokens) fit the profile's agentic context with their
    # first assistant turn: at 1,024 every one of them was cut before it and SFT had nothing to learn
    assert state["stages"]["sft"]["settings"]["conversations"] == state["stages"]["data"]["settings"]["records"]
    think = state["stages"]["data"]["settings"]["think_tokens_mean"]
    assert think["coding/low"] < think["coding/high"] < think["coding/max"]
    # scripts/effort_probe.py on the student: the three renderings of a coding problem, each scored
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("effort_probe",
                                                  Path(__file__).parents[1] / "scripts" / "effort_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    (row,) = probe.main([report["checkpoints"]["student"], "--domains", "coding", "--n", "1"])
    assert row["no tools"]["length"] < row["short instruction"]["length"] < row["as evaluated"]["length"]
    assert row["short instruction"]["length"] < row["short + filler"]["length"]
    assert all(0 <= v <= 1 for name in probe.RENDERINGS for v in row[name]["tv"].values())


def test_smoke_eval_ends_agentic_episodes_after_the_first_turn(tmp_path, monkeypatch):
    """Smoke's eval runs agent / coding episodes for one turn (`eval_max_turns`), its RL and MOPD for up to
    `max_turns`: the evaluation settings the pipeline hands on, and the teacher and student configs."""
    from openk3.posttrain import pipeline as pl
    from openk3.posttrain.evaluation import report

    seen = {}

    class Stop(Exception):
        pass

    def capture(models, out, **options):
        seen.update(options, models=models)
        raise Stop

    monkeypatch.setattr(report, "evaluate_models", capture)
    run = pl.Pipeline(tmp_path / "pt", preset="nano", profile="smoke", domains=("general",))
    with pytest.raises(Stop):
        run.eval()
    assert seen["max_turns"] == 1 == pl.PROFILES["smoke"].eval_max_turns
    assert sorted(seen["models"]) == ["general/high", "general/low", "general/max", "merged", "sft", "student"]
    assert pl.PROFILES["smoke"].max_turns == 4  # what RL and MOPD use (the configs below)
    import openk3.posttrain.trainers.mopd as mopd_module
    import openk3.posttrain.trainers.rl as rl_module

    configs = []
    monkeypatch.setattr(rl_module, "rl", lambda cfg, out: configs.append(cfg) or {})
    monkeypatch.setattr(mopd_module, "distill", lambda cfg, out: configs.append(cfg) or {})
    import importlib

    # no checkpoints exist here: each stage names its starting folder
    monkeypatch.setattr(importlib.import_module("openk3.checkpoint.load"), "resolve_checkpoint", lambda path: path)
    run.teacher("general/max")
    run.mopd()
    assert [c.max_turns for c in configs] == [4, 4]
    for name in ("tiny", "full", "overnight"):  # the other profiles evaluate as many turns as they train
        assert pl.PROFILES[name].eval_max_turns == pl.PROFILES[name].max_turns


def test_a_stopped_run_continues_with_the_next_stage(tmp_path, capsys):
    out = tmp_path / "pt"
    # "killed" after SFT: the next run must not redo base, data or SFT
    assert Pipeline(out, preset="nano", profile="tiny", domains=("general",), threads=1).run(stop_after="sft") is None
    assert stage_lines(capsys.readouterr().out) == {"base": "ran", "data": "ran", "sft": "ran"}
    assert not (out / "teachers").exists()
    sft_weights = next((out / "sft" / "checkpoints").glob("step_*/*.safetensors"))
    stamp = sft_weights.stat().st_mtime_ns
    data_stamp = (out / "data" / "sft_train.jsonl").stat().st_mtime_ns

    Pipeline(out, preset="nano", profile="tiny", domains=("general",), threads=1).run(stop_after="teacher general/max")
    assert stage_lines(capsys.readouterr().out) == {"base": "skipped", "data": "skipped", "sft": "skipped",
                                                    "teacher general/max": "ran"}
    assert sft_weights.stat().st_mtime_ns == stamp
    assert (out / "data" / "sft_train.jsonl").stat().st_mtime_ns == data_stamp
    openk3.load(out / "teachers" / "general-max")
    state = json.loads((out / "pipeline.json").read_text())
    assert set(state["stages"]) == {"base", "data", "sft", "teacher general/max"} and len(state["runs"]) == 2

    # a stage marked done whose output is gone runs again
    (out / "data" / "sft_train.jsonl").unlink()
    Pipeline(out, preset="nano", profile="tiny", domains=("general",), threads=1).run(stop_after="data")
    assert stage_lines(capsys.readouterr().out) == {"base": "skipped", "data": "ran"}

    # the folder's run is kept: other settings are refused, naming them
    with pytest.raises(ValueError, match=r"other settings \(profile: 'tiny' -> 'smoke'\)"):
        Pipeline(out, preset="nano", profile="smoke", domains=("general",))
    with pytest.raises(ValueError, match="stop_after: no stage 'teacher agent/max'"):
        Pipeline(out, preset="nano", profile="tiny", domains=("general",)).run(stop_after="teacher agent/max")


def test_bad_arguments_name_the_flag(tmp_path):
    out = str(tmp_path / "pt")
    with pytest.raises(ValueError, match="--profile: expected one of tiny, smoke, full, overnight, got 'huge'"):
        run_command("--preset", "nano", "--out", out, "--profile", "huge")
    with pytest.raises(ValueError, match="--domains: expected a comma-separated subset of general,agent,coding, "
                                         "got 'general,robots'"):
        run_command("--preset", "nano", "--out", out, "--domains", "general,robots")
    with pytest.raises(ValueError, match="--domains"):
        parse_domains(",")
    with pytest.raises(ValueError, match="--preset: unknown preset 'nanoo'"):
        run_command("--preset", "nanoo", "--out", out, "--domains", "general")
    with pytest.raises(ValueError, match="--base: no checkpoint or run folder"):
        run_command("--preset", "nano", "--out", out, "--domains", "general", "--base", str(tmp_path / "none"))
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        run_command("--preset", "nano", "--out", out, "--domains", "general", "--threads", "0")
    with pytest.raises(SystemExit):  # argparse: --preset and --out are required
        parser().parse_args(["--out", out])
    assert not (tmp_path / "pt").exists()  # nothing was started


def test_sandbox_domains_are_refused_with_the_reason_not_skipped(tmp_path, monkeypatch):
    import openk3.agent

    monkeypatch.setattr(openk3.agent, "unavailable_reason", lambda: "bubblewrap (bwrap) is not installed")
    for domains in ("general,agent,coding", "coding"):
        with pytest.raises(ValueError, match=r"sandboxes, which cannot run here \(bubblewrap \(bwrap\) is not "
                                             r"installed\); pass --domains general"):
            run_command("--preset", "nano", "--out", str(tmp_path / "pt"), "--domains", domains)
    # general alone needs no sandbox
    assert Pipeline(tmp_path / "pt", preset="nano", profile="tiny", domains=("general",)).domains == ("general",)


def test_a_folder_whose_profile_numbers_differ_is_refused_naming_them(tmp_path):
    """Same profile name, other numbers (a Profile passed in, or a newer openk3's profile): the stages done
    were computed with the recorded ones, so the run is not continued with these."""
    import dataclasses

    import openk3.posttrain.pipeline as pl

    out = tmp_path / "pt"
    out.mkdir()
    Pipeline(out, preset="nano", profile="tiny", domains=("general",))._save_state()  # as a run's first start does
    assert Pipeline(out, preset="nano", profile="tiny", domains=("general",)).state["profile"]  # same numbers: fine
    before = (out / "pipeline.json").read_text()
    changed = dataclasses.replace(pl.PROFILES["tiny"], sft_lr=pl.PROFILES["tiny"].sft_lr * 2, rl_steps=7)
    with pytest.raises(ValueError, match=r"profile 'tiny' with other numbers.*rl_steps: \d+ -> 7; sft_lr: ") as e:
        Pipeline(out, preset="nano", profile=changed, domains=("general",))
    assert str(out / "pipeline.json") in str(e.value)
    assert (out / "pipeline.json").read_text() == before


def test_contract_is_checked_on_the_cells_that_ran():
    cell = {"accuracy": 0.5, "thinking_tokens": 3.0, "n": 16}
    m = {"general": {e: dict(cell) for e in THINKING_EFFORTS}}
    report = {"models": {"sft": m, "student": m, "merged": m, "teachers": {c: m for c in GENERAL}},
              "checkpoints": {"sft": "a", "student": "b", "merged": "c", "teachers": {c: "t" for c in GENERAL}}}
    assert contract_problems(report, ("general",)) == []
    assert contract_problems(report, ("general", "agent"))  # the agent cells are missing
    report["models"]["student"] = {"general": {"low": cell, "high": cell, "max": {**cell, "n": 15}}}
    assert contract_problems(report, ("general",)) == ["models.student.general/max: n = 15 < 16"]
    del report["checkpoints"]["teachers"]["general/low"]
    assert "checkpoints: no folder for teachers/general/low" in contract_problems(report, ("general",))
