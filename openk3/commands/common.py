"""Arguments and input helpers shared by commands."""

from __future__ import annotations

import argparse
import sys

from openk3.config import PRESETS, K3Config, preset


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default=None,
                   help=f"named config: {', '.join(PRESETS)} (append -kl for the Kimi-Linear form), or a scaling-lab "
                        "family at a width: FAMILY@WIDTH[xLAYERS], e.g. k2-style@64 (docs/scaling.md)")
    g.add_argument("--config", default=None, help="a config.json (kimi_k3 wrapper or bare kimi_linear)")


def add_resume_arguments(p: argparse.ArgumentParser, *, history_file: str, maths: str = "") -> None:
    """--resume / --no-resume / --allow-config-change / --no-progress of a resumable run folder (`openk3 train`,
    `openk3 sft`); `maths` lists examples of the settings that change the run's maths."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", dest="resume", action="store_true", default=True,
                   help="continue from OUT's latest checkpoint if there is one (default)")
    g.add_argument("--no-resume", dest="resume", action="store_false",
                   help="refuse to start if OUT already holds checkpoints")
    p.add_argument("--allow-config-change", action="store_true",
                   help=f"resume even though settings that change the run's maths {maths}differ from the "
                        f"checkpoint's; the change is recorded in OUT/{history_file}")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars on stderr")


def add_rollout_run_arguments(p: argparse.ArgumentParser, d, *, seed_help: str) -> None:
    """The flags `openk3 rl` and `openk3 distill` share (d: the run config's defaults): problem split, seed,
    checkpoint interval, the engine's batch and context, threads."""
    from openk3.posttrain.domains.records import SPLITS

    p.add_argument("--split", choices=SPLITS, default=d.split, help=f"problems' split (default {d.split})")
    p.add_argument("--levels", default=None, help="general difficulty levels drawn, e.g. 1,2 (default all; "
                                                  "those of the SFT data keep RL on what SFT taught)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"{seed_help} (default {d.seed})")
    p.add_argument("--save-every", type=int, default=d.save_every, help=f"checkpoint interval (default {d.save_every})")
    p.add_argument("--update-ref", type=float, default=d.update_ref,
                   help=f"the gradient norm that takes a full learning-rate step; smaller gradients take "
                        f"proportionally smaller steps (default {d.update_ref}; 0 = every step full size)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"trajectories the engine decodes together (default {d.max_num_seqs})")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context limit per trajectory (default: the model's max_position_embeddings)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: $OPENK3_THREADS, else 1 on a 2-CPU machine, else torch's)")


def rollout_run_settings(args: argparse.Namespace) -> dict:
    """The run-config fields that `add_rollout_run_arguments`' flags give (and the CPU threads, set up here)."""
    from openk3.common import setup_cpu
    from openk3.posttrain.domains.general import parse_levels

    setup_cpu(args.threads)
    return dict(split=args.split, levels=parse_levels(args.levels), seed=args.seed, save_every=args.save_every,
                update_ref=args.update_ref or None, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)


def on_policy_done(tag: str, last: dict, out: str, steps: int, summary: str) -> None:
    """The last line of `openk3 rl` / `openk3 distill`: the final step's `summary`, or that there was nothing to
    do (`last` empty: the run in `out` had already taken its `steps`)."""
    if last:
        print(f"[{tag}] done: step {last['step']}, {summary}; checkpoints in {out}/checkpoints", flush=True)
    else:
        print(f"[{tag}] {out} already has {steps} steps; nothing to do", flush=True)


def positive_int(value: str) -> int:
    """An argparse `type=` for counts and lengths that must be >= 1 (`--max-model-len`): 0 or a negative number
    is a usage error naming the value, not a silent "default" (the engine reads 0 as "not given")."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def parse_dtype(value: str):
    """`--dtype` through `openk3.common.resolve_dtype` (its table is the one list of spellings): a torch
    dtype, or None for "auto". A spelling it does not know is an argparse error naming the value."""
    from openk3.common import resolve_dtype

    try:
        return resolve_dtype(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_dtype_argument(p: argparse.ArgumentParser, default: str, what: str) -> None:
    """`--dtype` (generate, chat, convert): auto, bf16/bfloat16, fp32/float32, fp16/float16, fp64/float64."""
    p.add_argument("--dtype", type=parse_dtype, default=default, metavar="DTYPE",
                   help=f"{what}: auto, bf16 (bfloat16), fp32 (float32), fp16 (float16) or fp64 (float64); "
                        f"default {default}")


def model_preset(name: str) -> tuple[K3Config, dict]:
    """A named preset, or a scaling-lab family at a width, `FAMILY@WIDTH[xLAYERS]` (9 layers unless given):
    (the model config, the family's train overrides, e.g. {"balance": "sign"} for k2-style; {} for presets)."""
    if "@" not in name:
        return preset(name), {}
    from openk3.scaling.families import family

    fam, _, size = name.partition("@")
    width, _, layers = size.partition("x")
    try:
        w, n = int(width), int(layers or 9)
    except ValueError:
        raise ValueError(f"--preset {name!r}: expected FAMILY@WIDTH or FAMILY@WIDTHxLAYERS, e.g. k2-style@64") \
            from None
    f = family(fam)
    return f.config(w, n), dict(f.train_overrides)


def config_from_args(args: argparse.Namespace, default: str = "nano") -> tuple[K3Config, str]:
    if args.config:
        return K3Config.from_json(args.config), args.config
    name = args.preset or default
    return model_preset(name)[0], name


def read_text_input(path: str | None, stdin_name: str = "stdin") -> str:
    """The text of `path`, or of stdin when `path` is None or "-"; an unreadable file, or one that is not
    UTF-8, is a ValueError naming it (stdin as `stdin_name`)."""
    from openk3.fsutil import decode_utf8

    try:
        if path is None or path == "-":
            data, where = (sys.stdin.buffer if hasattr(sys.stdin, "buffer") else sys.stdin).read(), stdin_name
        else:
            with open(path, "rb") as fh:
                data, where = fh.read(), path
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    return data if isinstance(data, str) else decode_utf8(data, where)
