"""Run folders over time: the special ids a trained checkpoint carries, resume past a damaged checkpoint,
temp folders of a killed save, refused/allowed config changes, the free-space check, and `openk3 train`
building its config from a file, flags and overrides in any order. One thread, nano cut to 4 layers (every
layer kind) at seq 32 x batch 2."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Killed

from openk3.checkpoint import runs, steps
from openk3.train.config import RESUME_FREE, TrainConfig, apply_overrides
from openk3.train.metrics import losses_by_step, read_metrics
from openk3.train.trainer import train

BASE = ["model.vocab_size=512", "model.num_hidden_layers=4", "data.max_bytes=200000", "seq_len=32", "batch_size=2",
        "max_steps=4", "eval_every=0", "save_every=2", "eval_batches=1", "warmup=1", "optim.lr=3e-3", "samples=0",
        "threads=1"]


def tiny(**changes) -> TrainConfig:
    return dataclasses.replace(apply_overrides(TrainConfig(), BASE), **changes)


def train_losses(out: Path) -> dict[int, float]:
    return losses_by_step(read_metrics(str(out / "metrics.jsonl")))




_REFERENCE_RUNS: dict[Path, Path] = {}


def reference_run(tmp_path_factory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (trains its own 512-id tokenizer), trained once per test
    process: tests/test_run_safety.py resumes copies of the same run. Tests only read it (or copy it)."""
    base = tmp_path_factory.getbasetemp()
    if base not in _REFERENCE_RUNS:
        out = tmp_path_factory.mktemp("resume") / "ref"
        train(tiny(), out, progress=False)
        _REFERENCE_RUNS[base] = out
    return _REFERENCE_RUNS[base]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference_run(tmp_path_factory)


def copy_run(ref: Path, dst: Path) -> tuple[Path, TrainConfig]:
    """A copy of the reference run folder (its tokenizer included), and the config that resumes it
    (reading the reference's data cache: `cache_dir` may change freely)."""
    shutil.copytree(ref, dst)
    return dst, tiny(cache_dir=str(ref.parent / ".cache"))


def ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / runs.step_dir_name(step)


# ---- B5: the checkpoint's special ids are the tokenizer's ---------------------------------------------

def test_checkpoint_config_carries_the_tokenizers_special_ids(ref):
    from openk3.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(str(ref / "tokenizer"))
    assert tok.vocab_size == 512
    end_of_msg = tok.special_ids["<|end_of_msg|>"]
    config = json.loads((ckpt(ref, 4) / "config.json").read_text())
    generation = json.loads((ckpt(ref, 4) / "generation_config.json").read_text())
    text = config.get("text_config", config)
    assert text["vocab_size"] == 512
    for d in (config, generation):
        assert d["eos_token_id"] == end_of_msg  # spec §7.1: the turn terminator, not the release's 163586
        assert d["bos_token_id"] == tok.bos_id and d["pad_token_id"] == tok.pad_id
        assert all(0 <= d[k] < 512 for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    saved = json.loads((ref / "train_config.json").read_text())["model"]
    assert (saved["eos_token_id"], saved["bos_token_id"], saved["pad_token_id"]) == (end_of_msg, tok.bos_id,
                                                                                    tok.pad_id)


# ---- C10: damaged checkpoints and temp folders ---------------------------------------------------------

def test_truncated_trainer_state_falls_back_to_the_previous_checkpoint(ref, tmp_path, capsys):
    out, cfg = copy_run(ref, tmp_path / "run")
    state = ckpt(out, 4) / runs.STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a disk that filled mid-write
    capsys.readouterr()
    summary = train(cfg, out, progress=False)
    err = capsys.readouterr().err
    assert summary["resumed_from"] == 2
    assert "warning" in err and str(state) in err and "step_000002" in err
    assert train_losses(out) == train_losses(ref)  # steps 3-4 retrained exactly
    assert steps.load_trainer_state(ckpt(out, 4))["step"] == 4  # and the damaged one rewritten


def test_truncated_weights_fall_back_to_the_previous_checkpoint(ref, tmp_path, capsys):
    out, cfg = copy_run(ref, tmp_path / "run")
    weights = ckpt(out, 4) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 1000])
    capsys.readouterr()
    summary = train(dataclasses.replace(cfg, max_steps=2), out, progress=False)
    err = capsys.readouterr().err
    assert summary["resumed_from"] == 2 and "step_000004" in err and "weights" in err


def test_no_loadable_checkpoint_is_an_error_listing_each(ref, tmp_path):
    out, cfg = copy_run(ref, tmp_path / "run")
    for step in (2, 4):
        (ckpt(out, step) / runs.STATE_FILE).write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="no checkpoint can be resumed from") as e:
        train(cfg, out, progress=False)
    assert "step_000002" in str(e.value) and "step_000004" in str(e.value)


def test_temp_folders_of_a_killed_save_are_removed_on_resume(ref, tmp_path, monkeypatch):
    import openk3
    from openk3.checkpoint import files

    out, cfg = copy_run(ref, tmp_path / "run")
    model = openk3.load(ckpt(out, 4), dtype=torch.float32)

    def dies(folder, items, max_shard_bytes):  # half the weights written, then SIGKILL
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise Killed

    # SIGKILL runs no `except`/`finally`: the savers' own clean-up (shutil.rmtree) must not happen either
    monkeypatch.setattr(files, "write_weights", dies)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(Killed):
        steps.save_checkpoint(out, 6, model, {"step": 6})
    monkeypatch.undo()
    left = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert len(left) == 1 and left[0].startswith("..tmp-step_000006-")  # the name the writer really uses
    summary = train(cfg, out, progress=False)
    assert summary["resumed_from"] == 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004"]


# ---- C11: config changes on resume ---------------------------------------------------------------------

def test_resume_refuses_maths_changes_listing_every_one(ref, tmp_path):
    out, cfg = copy_run(ref, tmp_path / "run")
    before = (out / "train_config.json").read_text()
    changed = apply_overrides(cfg, ["optim.lr=1e-3", "batch_size=4", "seed=7", "max_steps=5"])
    with pytest.raises(ValueError, match="--allow-config-change") as e:
        train(changed, out, progress=False)
    msg = str(e.value)
    for line in ("optim.lr: 0.003 -> 0.001", "batch_size: 2 -> 4", "seed: 0 -> 7"):
        assert line in msg
    assert "max_steps" not in msg  # a free change is not a reason to refuse
    assert (out / "train_config.json").read_text() == before
    assert not (out / "train_config_history.jsonl").exists()


def test_free_changes_resume_and_are_recorded(ref, tmp_path):
    out, cfg = copy_run(ref, tmp_path / "run")
    summary = train(dataclasses.replace(cfg, max_steps=5, save_every=5, log_every=1), out, progress=False)
    assert summary["resumed_from"] == 4 and summary["steps"] == 5
    assert TrainConfig.from_json(out / "train_config.json").max_steps == 5
    (entry,) = [json.loads(line) for line in (out / "train_config_history.jsonl").read_text().splitlines()]
    assert entry["step"] == 4 and "max_steps: 4 -> 5" in entry["changes"] and entry["previous"]["max_steps"] == 4


def test_allowed_change_uses_new_settings_and_keeps_the_old_config(ref, tmp_path):
    out, cfg = copy_run(ref, tmp_path / "run")
    original = json.loads((out / "train_config.json").read_text())
    changed = apply_overrides(cfg, ["optim.lr=1e-3", "max_steps=5"])
    summary = train(changed, out, progress=False, allow_config_change=True)
    assert summary["resumed_from"] == 4 and summary["steps"] == 5
    assert TrainConfig.from_json(out / "train_config.json").optim.lr == 1e-3
    (entry,) = [json.loads(line) for line in (out / "train_config_history.jsonl").read_text().splitlines()]
    assert entry["previous"] == original and "optim.lr: 0.003 -> 0.001" in entry["changes"]
    step5 = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["kind"] == "train"][-1]
    assert step5["step"] == 5 and step5["lr"] <= 1e-3  # the new peak LR is the one in force
    assert steps.load_trainer_state(ckpt(out, 5))["config"]["optim"]["lr"] == 1e-3


def test_free_fields_do_not_touch_the_maths():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {"optim", "data", "model", "batch_size", "seq_len", "seed", "dtype", "schedule", "warmup",
            "tokenizer", "qb_rate"}.isdisjoint(RESUME_FREE)
    assert {k for k in RESUME_FREE if "." not in k} <= fields


# ---- C12: free space, and writes that fail ------------------------------------------------------------

def tiny_disk(monkeypatch, free: int) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))


def needs(msg: str) -> tuple[int, dict[str, int]]:
    """(total bytes needed, {what: bytes}) read back from a free-space refusal."""
    total = int(re.search(r"need about ([\d,]+) bytes", msg).group(1).replace(",", ""))
    parts = {what: int(n.replace(",", "")) for n, what in re.findall(r"([\d,]+) for (\d+ checkpoint|the token cache)",
                                                                     msg)}
    return total, parts


def test_too_little_disk_space_is_refused_before_training(ref, tmp_path, monkeypatch):
    out = tmp_path / "run"
    tiny_disk(monkeypatch, 1000)
    with pytest.raises(ValueError, match="not enough free disk space") as e:
        train(tiny(tokenizer=str(ref / "tokenizer"), cache_dir=str(ref.parent / ".cache")), out, progress=False)
    msg = str(e.value)
    assert str(out) in msg and "1,000 bytes" in msg
    needed, parts = needs(msg)
    assert "2 checkpoint(s) of" in msg and list(parts) == ["2 checkpoint"]  # saves at steps 2 and 4; cache built
    on_disk = sum(f.stat().st_size for f in ckpt(ref, 4).iterdir())  # one real checkpoint of this model
    assert 0.8 < needed / 2 / on_disk < 1.25
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_free_space_is_checked_before_the_tokenizer_and_the_cache_and_counts_the_cache(tmp_path, monkeypatch):
    out, cache = tmp_path / "run", tmp_path / "cache"
    tiny_disk(monkeypatch, 1000)
    with pytest.raises(ValueError, match="not enough free disk space") as e:
        train(tiny(cache_dir=str(cache)), out, progress=False)
    needed, parts = needs(str(e.value))
    # data.max_bytes=200000 of text, at most one 2-byte id per byte
    assert parts["the token cache"] == 2 * 200_000 and needed == sum(parts.values())
    assert str(cache) in str(e.value)
    assert not (out / "tokenizer").exists() and not (out / ".tokenizer.tmp").exists() and not cache.exists()


def test_checkpoints_counted_are_the_ones_the_run_writes():
    from openk3.train.space import planned_saves

    assert planned_saves(tiny(max_steps=10, save_every=3), 0) == 4  # 3, 6, 9 and the end
    assert planned_saves(tiny(max_steps=9, save_every=3), 3) == 2  # 6, 9
    assert planned_saves(tiny(max_steps=9, save_every=0), 0) == 1
    assert planned_saves(tiny(max_steps=4), 4) == 0  # a finished run writes nothing


def test_keep_checkpoints_bounds_the_space_needed(ref, tmp_path, monkeypatch):
    tiny_disk(monkeypatch, 1000)
    with pytest.raises(ValueError) as e:
        train(tiny(max_steps=20, keep_checkpoints=1, tokenizer=str(ref / "tokenizer"),
                   cache_dir=str(ref.parent / ".cache")), tmp_path / "run", progress=False)
    assert "2 checkpoint(s) of" in str(e.value)  # not 10: the newest is written before the older one goes


def test_a_full_disk_while_caching_names_the_cache(ref, tmp_path, monkeypatch, capsys):
    import errno

    from openk3.__main__ import main
    from openk3.data import shards

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")  # what a write to a full disk raises: no path

    monkeypatch.setattr(shards._SplitWriter, "flush", full)
    cache = tmp_path / "cache"
    rc = main(["train", "--out", str(tmp_path / "run"), "--tokenizer", str(ref / "tokenizer"), "--no-progress",
               f"cache_dir={cache}", *BASE])
    err = capsys.readouterr().err
    assert rc == 2 and "No space left on device" in err and str(cache) in err
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []  # the partial build is removed


def test_a_full_disk_while_saving_names_the_checkpoint(ref, tmp_path, monkeypatch):
    import errno

    from openk3.checkpoint import files

    def full(folder, items, max_shard_bytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "write_weights", full)
    out = tmp_path / "run"
    with pytest.raises(OSError) as e:
        train(tiny(tokenizer=str(ref / "tokenizer"), cache_dir=str(ref.parent / ".cache")), out, progress=False)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(ckpt(out, 2))
    assert "checkpoint" in e.value.strerror
    assert [p.name for p in (out / "checkpoints").iterdir()] == []  # the temp folder went with it


# ---- D14: the command line -----------------------------------------------------------------------------

def parse(argv: list[str]):
    from openk3.__main__ import parse_args
    from openk3.commands.train import build_config

    args = parse_args(["train", *argv])
    return args, build_config(args)


def test_overrides_may_follow_flags_in_any_order(capsys):
    args, cfg = parse(["--preset", "nano", "--out", "X", "model.hidden_size=64", "--max-steps", "2",
                       "seq_len=16", "--dtype", "bfloat16", "optim.lr=1e-3"])
    assert args.overrides == ["model.hidden_size=64", "seq_len=16", "optim.lr=1e-3"]
    assert parse(["seq_len=16", "--out", "X"])[0].overrides == ["seq_len=16"]
    with pytest.raises(SystemExit):  # anything else left over stays a usage error
        parse(["--out", "X", "seq_len=16", "--no-progress", "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err
    assert (cfg.model.hidden_size, cfg.max_steps, cfg.seq_len, cfg.optim.lr, cfg.dtype) == (64, 2, 16, 1e-3, "bf16")


def test_config_file_then_flags_and_overrides(tmp_path):
    base = apply_overrides(TrainConfig(), BASE + ["optim.lr=5e-4", "model.hidden_size=64", "dtype=bf16"])
    base.to_json(tmp_path / "train_config.json")
    _, cfg = parse(["--config", str(tmp_path / "train_config.json"), "--out", "X", "--max-steps", "9",
                    "seq_len=16"])
    assert cfg == dataclasses.replace(base, max_steps=9, seq_len=16)  # the file's lr is kept, not nano's 3e-3
    _, other = parse(["--config", str(tmp_path / "train_config.json"), "--preset", "small", "--out", "X"])
    assert other.preset == "small" and other.model.hidden_size != 64 and other.optim.lr == 5e-4
    with pytest.raises(ValueError, match="unknown field"):
        (tmp_path / "bad.json").write_text('{"batchsize": 3}')
        parse(["--config", str(tmp_path / "bad.json"), "--out", "X"])


def test_a_runs_own_train_config_resumes_it(ref, tmp_path):
    """`--config RUN/train_config.json` describes the run exactly: resuming with it changes nothing."""
    out, _ = copy_run(ref, tmp_path / "run")
    _, cfg = parse(["--config", str(out / "train_config.json"), "--out", str(out), "--no-progress",
                    f"cache_dir={ref.parent / '.cache'}"])
    assert cfg.model.eos_token_id < cfg.model.vocab_size == 512
    summary = train(cfg, out, progress=False)
    assert summary["resumed_from"] == 4 and summary["steps"] == 4


# ---- resuming from the command line: the run's own config is the base --------------------------------

def cli_copy(ref: Path, name: str) -> Path:
    """A copy of the reference run beside it (so the default cache, <out>/../.cache, is the reference's)."""
    dst = ref.parent / name
    shutil.copytree(ref, dst)
    return dst


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from openk3.__main__ import main

    capsys.readouterr()
    rc = main(["train", *argv, "--no-progress"])
    return rc, capsys.readouterr().err


def refused_lines(err: str) -> list[str]:
    block = err.split("(checkpoint -> now):\n", 1)[1]
    return [line.strip() for line in block.splitlines() if line.startswith("  ")]


def test_out_alone_resumes_a_run_made_with_non_default_settings(ref, capsys):
    """ref ran with batch_size=2, seq_len=32, data.max_bytes=200000, ... (not the defaults): none of them is
    typed again here."""
    out = cli_copy(ref, "cli-out-alone")
    assert run_cli(["--out", str(out)], capsys)[0] == 0
    rc, err = run_cli(["--out", str(out), "--max-steps", "5"], capsys)
    assert rc == 0, err
    state = steps.load_trainer_state(ckpt(out, 5))
    assert state["step"] == 5 and state["config"]["batch_size"] == 2 and state["config"]["seq_len"] == 32
    assert state["config"]["data"]["max_bytes"] == 200000


def test_main_sh_flags_resume_a_run_they_made(ref, capsys):
    """scripts/main.sh runs `openk3 train --preset nano --out runs/nano --max-steps 240 "$@"` (here "$@" holds the
    reference run's cut to 4 layers)."""
    out = cli_copy(ref, "cli-main-sh")
    rc, err = run_cli(["--preset", "nano", "--out", str(out), "--max-steps", "4", "model.num_hidden_layers=4"], capsys)
    assert rc == 0, err


def test_resume_refuses_exactly_the_changes_given_and_says_how_to_proceed(ref, capsys):
    out = cli_copy(ref, "cli-refused")
    before = (out / "train_config.json").read_text()
    rc, err = run_cli(["--out", str(out), "batch_size=4"], capsys)
    assert rc == 2 and refused_lines(err) == ["batch_size: 2 -> 4"]
    assert "--allow-config-change" in err and "drop those options" in err
    assert (out / "train_config.json").read_text() == before


def test_the_base_is_the_runs_config_only_when_resuming_it(ref, tmp_path):
    out, _ = copy_run(ref, tmp_path / "run")
    _, cfg = parse(["--out", str(out)])
    assert cfg == TrainConfig.from_json(out / "train_config.json")
    _, fresh = parse(["--out", str(out), "--no-resume"])
    assert fresh.batch_size == TrainConfig().batch_size
    (tmp_path / "empty").mkdir()
    shutil.copy(out / "train_config.json", tmp_path / "empty")  # a config but no checkpoint: nothing to resume
    _, fresh = parse(["--out", str(tmp_path / "empty")])
    assert fresh.batch_size == TrainConfig().batch_size


@pytest.mark.parametrize("spelling, canonical", [("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"),
                                                 ("fp32", "fp32"), ("float32", "fp32"), ("torch.float32", "fp32")])
def test_dtype_spellings_are_stored_canonically(spelling, canonical):
    assert TrainConfig(dtype=spelling).dtype == canonical
    assert apply_overrides(TrainConfig(), [f"dtype={spelling}"]).dtype == canonical


@pytest.mark.parametrize("bad", ["fp16", "int8", "auto"])
def test_other_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(dtype=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_value_error_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="CUDA is not available"):
        train(tiny(device="cuda"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_clean_leftovers_knows_every_temp_name_the_writers_use(tmp_path):
    """The temporaries of a kill at any point: save folders, openk3.save's sibling, write_trainer_state's
    file and fsutil.write_atomic's `latest.tmp.<pid>.<hex>`; finished checkpoints and `latest` stay."""
    from openk3.checkpoint.runs import checkpoint_root, clean_leftovers

    root = checkpoint_root(tmp_path)
    root.mkdir(parents=True)
    junk = [".tmp-step_000004-123", ".old-step_000002-123", "..tmp-step_000004-123.tmp-9f3a",
            "latest.tmp.4242.0badc0de"]
    keep = ["step_000002", "latest"]
    for name in junk[:3] + keep[:1]:
        (root / name).mkdir()
    (root / junk[3]).write_text("step_000004\n")
    (root / "latest").write_text("step_000002\n")
    (root / "step_000002" / "trainer_state.pt.tmp").write_bytes(b"")  # inside a folder: not ours to touch
    assert sorted(clean_leftovers(tmp_path)) == sorted(junk)
    assert sorted(p.name for p in root.iterdir()) == sorted(keep)
