"""`openk3 posttrain`: the whole post-training pipeline of issue 18 (item 7; background §3.1-3.9).

    report = Pipeline("runs/pt", preset="nano", profile="smoke", domains=("general",)).run()

Stages, each in its own sub-folder of the output folder DIR, in this order:

    base                   base/                the starting checkpoint: the run's BPE tokenizer trained on its
                                                domains (vocab.py) and the preset (cut to the profile's layers)
                                                with that vocabulary, randomly initialised; or --base
    data                   data/sft_train.jsonl reference records of every domain x effort (`general.sft_dataset`,
                                                `agentic.agentic_dataset`): SFT sees all three verbosities
    sft                    sft/                 `trainers.sft.sft` on those records
    teacher D/max, D/high, D/low
                           teachers/D-E/        `trainers.rl.rl` per domain in the chain max -> high -> low: max
                                                starts from SFT with B_max; high starts from the max teacher and low
                                                from the high teacher, their budgets annealed from the previous
                                                effort's (background §3.3)
    mopd                   student/             `trainers.mopd.distill`: the student (from SFT) learns every cell
                                                from its own teacher
    merge                  merged/              `merge.merge_checkpoints` (`openk3 merge`) of the teachers onto SFT
                                                (the profile's method, TIES by default): the "nine specialists
                                                merged" baseline
    eval                   eval/                `report.evaluate_models` (`openk3 eval`) of sft, student, merged and
                                                every teacher on every cell of the chosen domains; DIR/report.json
                                                is its report.json

DIR/report.json follows the issue's contract ({"models": {"sft", "student", "merged", "teachers": {"D/E": M}},
"checkpoints": {same keys -> checkpoint folders}}) for the cells of the chosen domains. DIR/pipeline.json
records the run's settings, the profile, and per stage its status, seconds and settings. A stage marked
done there is skipped, so a killed pipeline rerun continues with the first unfinished stage; inside that
stage SFT, RL and MOPD resume from their own last checkpoint and eval from its finished models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from openk3.chat import THINKING_EFFORTS
from openk3.fsutil import read_json, write_atomic
from openk3.log import reporter
from openk3.posttrain.domains.records import DOMAINS

PIPELINE_FILE = "pipeline.json"
REPORT_FILE = "report.json"
#: RL order per domain: each effort's teacher starts from the previous one's (background §3.3).
CHAIN = ("max", "high", "low")
#: Settings of a run that a rerun must repeat: its stages were computed with them.
FIXED_SETTINGS = ("preset", "profile", "domains", "base", "seed")
_MISSING = object()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """How big each stage is (docs/posttraining.md has the measured times)."""

    name: str
    layers: int | None  # cut of the preset to this many layers (None: the preset as it is)
    vocab_size: int | None  # the run's BPE tokenizer trained on its domains (vocab.py); None: byte-level
    general_problems: int  # SFT problems per effort of the general domain (x3 records each)
    agentic_problems: int  # SFT problems per family and effort of agent / coding
    levels: tuple[int, ...] | None  # general levels in SFT, RL, MOPD and eval (None: 1-3): what SFT taught is asked
    sft_steps: int | None  # None: sft_epochs passes over the data
    sft_epochs: int
    sft_batch: int
    sft_grad_accum: int  # micro-batches per SFT step (memory: 8 x 8192-token rows at once need ~23 GB on nano)
    sft_seq_len: int  # rows of general-only SFT
    agentic_seq_len: int  # rows when agent / coding records (0.9-2.8k BPE tokens: tools are declared) are in
    sft_lr: float
    sft_overflow: str  # "drop" keeps only whole traces; "truncate" (tiny) keeps every record's start
    rl_steps: int
    rl_prompts: int
    rl_group: int
    rl_general: tuple[int, int, int] | None  # (steps, prompts, group) for general teachers: rollouts ~10x cheaper
    rl_temperature: float  # RL sampling (log-probs at the same temperature): below 1 where T = 1 solves ~nothing
    rl_lr: float
    mopd_steps: int
    mopd_prompts: int
    mopd_lr: float
    mopd_think_cap: int | None  # MOPD's safety cap on think tokens (None: the context limit)
    eval_n: int  # problems per cell (the contract needs n >= 16 trajectories)
    eval_samples: int
    eval_temperature: float  # 0 = greedy (one sample per problem)
    eval_think_cap: int | None
    response_cap: int
    max_turns: int  # agent / coding turns per episode (RL, MOPD)
    eval_max_turns: int  # the same in eval
    max_model_len: int | None  # context per general trajectory in RL, MOPD and eval (None: the model's)
    agentic_max_model_len: int  # the same with agent / coding prompts (longer than nano's 4,096 positions)
    merge_method: str
    merge_density: float | None
    micro_tokens: int | None  # RL / MOPD trainer passes and teacher scoring in row chunks of this many tokens
    save_every: int | None  # RL / MOPD checkpoints every this many steps (None: at the end only)


PROFILES = {
    # tests: seconds per stage; general prompts are 360-510 byte tokens, so 600 leaves ~100 generated ones; SFT rows
    # of 2,048 for agent / coding (their tool declarations alone are ~1,200 tokens: at 1,024 no assistant turn fit)
    "tiny": Profile(name="tiny", vocab_size=2048, layers=4,
                    general_problems=2, agentic_problems=1, levels=(1,),
                    sft_steps=2, sft_epochs=1, sft_batch=2, sft_grad_accum=1,
                    sft_seq_len=1024, agentic_seq_len=2048, sft_lr=2e-4,
                    sft_overflow="truncate",
                    rl_steps=1, rl_prompts=1, rl_group=2, rl_lr=1e-5, rl_general=None, rl_temperature=1.0,
                    mopd_steps=1, mopd_prompts=3, mopd_lr=1e-5, mopd_think_cap=16,
                    eval_n=16, eval_samples=1, eval_temperature=1.0, eval_think_cap=8,
                    response_cap=8, max_turns=2, eval_max_turns=2, max_model_len=600, agentic_max_model_len=8192,
                    merge_method="ties", merge_density=0.5,
                    micro_tokens=None, save_every=None),
    # one CPU core, under 12 minutes for all three domains (docs/posttraining.md has the measured runs). Its response
    # cap (64) is below most agent / coding reference turns (p90 401 / 278 tokens: file writes), so those turns
    # end as format failures: smoke checks the mechanics; with a cap of 1024 the eval alone took ~11 min. So eval
    # stops agent / coding episodes after their first turn: with more turns the cap ended each episode at whichever
    # turn first wrote long tool calls, which differs by effort, and the think count measured that instead of the
    # effort (coding low 28.5 > high 25.0 think tokens: low's first calls fit the cap and it went on to a second
    # turn). SFT (8 epochs: at 5 the model read the effort only across short user messages, so agent and coding
    # thinking did not follow it) and eval carry most of the time: the effort ordering comes from the three
    # verbosities of the SFT traces. nano is cut to 4 layers: at 9 the same minutes of SFT learn nothing usable.
    # RL and MOPD take a few steps, so the curves exist and move. Eval is greedy: at temperature 1 a model this
    # briefly trained wanders off its traces, and where it closes the think channel is then noise (a shorter SFT
    # measured low 43 > high 34 think tokens sampled, 80 < 87 < 158 greedy)
    "smoke": Profile(name="smoke", vocab_size=2048, layers=4,
                     general_problems=48, agentic_problems=3, levels=(1,),
                     sft_steps=None, sft_epochs=8, sft_batch=1, sft_grad_accum=1,
                     sft_seq_len=1024, agentic_seq_len=2048, sft_lr=2e-3,
                     sft_overflow="truncate",
                     rl_steps=2, rl_prompts=2, rl_group=2, rl_lr=1e-5, rl_general=None, rl_temperature=1.0,
                     mopd_steps=3, mopd_prompts=3, mopd_lr=1e-5, mopd_think_cap=320,
                     eval_n=16, eval_samples=1, eval_temperature=0.0, eval_think_cap=320,
                     response_cap=64, max_turns=4, eval_max_turns=1,
                     max_model_len=1024, agentic_max_model_len=4096,
                     merge_method="ties", merge_density=0.5,
                     micro_tokens=None, save_every=None),
    # the real experiment, sized to finish inside one ~3-hour working session on one core of the 2-core machine
    # (~2 h; docs/posttraining.md has the measured stages): nano cut to 4 layers as in smoke (at 9 layers an hour
    # of SFT learned less than 4 layers in 10 minutes), levels 1-2, whole traces only, a response cap that
    # covers the longest reference turn (a coding file write, ~1,040 byte tokens, ~300 BPE), greedy eval with
    # a think cap above every reference (general max ~820 bytes), and 200 test problems per cell: at 32 a cell's
    # accuracy had a standard error of ~0.06, as large as every difference the run could show
    "full": Profile(name="full", vocab_size=2048, layers=4,
                    general_problems=150, agentic_problems=8, levels=(1, 2),
                    sft_steps=None, sft_epochs=6, sft_batch=1, sft_grad_accum=1,
                    sft_seq_len=2048, agentic_seq_len=4096, sft_lr=2e-3,
                    sft_overflow="drop",
                    rl_steps=6, rl_prompts=4, rl_group=4, rl_lr=3e-5, rl_general=(20, 8, 8), rl_temperature=0.7,
                    mopd_steps=12, mopd_prompts=9, mopd_lr=3e-5, mopd_think_cap=768,
                    eval_n=200, eval_samples=1, eval_temperature=0.0, eval_think_cap=768,
                    response_cap=1024, max_turns=6, eval_max_turns=6, max_model_len=2048, agentic_max_model_len=8192,
                    merge_method="ties", merge_density=0.5,
                    micro_tokens=8192, save_every=2),
    # the first full sizing (background §3.1-3.9 scaled to ~12 hours on one core: all 9 nano layers, SFT
    # 2 epochs of 8 x 8,192 tokens in 8 micro-batches, 20 RL steps of 32 rollouts per teacher, 40 MOPD steps,
    # 48 samples per cell at T = 1). Not run to the end here: a working session's machine lasts ~3 hours
    "overnight": Profile(name="overnight", vocab_size=2048, layers=None,
                         general_problems=600, agentic_problems=40, levels=None,
                         sft_steps=None, sft_epochs=2, sft_batch=8, sft_grad_accum=8,
                         sft_seq_len=2048, agentic_seq_len=8192, sft_lr=5e-4,
                         sft_overflow="drop",
                         rl_steps=20, rl_prompts=4, rl_group=8, rl_lr=1e-5,
                         rl_general=None, rl_temperature=1.0,
                         mopd_steps=40, mopd_prompts=9, mopd_lr=1e-5, mopd_think_cap=None,
                         eval_n=48, eval_samples=1, eval_temperature=1.0, eval_think_cap=None,
                         response_cap=1536, max_turns=8, eval_max_turns=8,
                         max_model_len=None, agentic_max_model_len=16384,
                         merge_method="ties", merge_density=0.5,
                         micro_tokens=8192, save_every=5),
}


def parse_domains(text: str | Any) -> tuple[str, ...]:
    """"general,agent" -> ("general", "agent") in DOMAINS order; ValueError naming --domains otherwise."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    unknown = [p for p in parts if p not in DOMAINS]
    if not parts or unknown:
        raise ValueError(f"--domains: expected a comma-separated subset of {','.join(DOMAINS)}, got {text!r}")
    return tuple(d for d in DOMAINS if d in parts)


def cells(domains: tuple[str, ...]) -> list[str]:
    return [f"{d}/{e}" for d in domains for e in THINKING_EFFORTS]


def teacher_dir(out: Path, cell: str) -> Path:
    return out / "teachers" / cell.replace("/", "-")


def contract_problems(report: dict, domains: tuple[str, ...]) -> list[str]:
    """`evaluate.report_problems` restricted to the cells of `domains` (a general-only run cannot have the
    agent and coding cells; everything about the cells it ran must hold)."""
    from openk3.posttrain.evaluation.report import report_problems

    skipped = [c for c in cells(DOMAINS) if c.split("/")[0] not in domains]
    return [p for p in report_problems(report) if not any(c in p for c in skipped)]


def _say(msg: str) -> None:
    reporter("posttrain").info(msg)


class Pipeline:
    """The stages of one run folder; `run()` does the ones not yet done (module docstring)."""

    def __init__(self, out: str | os.PathLike, *, preset: str, profile: str | Profile = "smoke",
                 domains: tuple[str, ...] = DOMAINS, base: str | None = None, seed: int = 0,
                 threads: int | None = None) -> None:
        from openk3.config import preset as preset_config

        if isinstance(profile, str):
            if profile not in PROFILES:
                raise ValueError(f"--profile: expected one of {', '.join(PROFILES)}, got {profile!r}")
            profile = PROFILES[profile]
        domains = parse_domains(",".join(domains))
        if any(d != "general" for d in domains):
            from openk3.agent import unavailable_reason

            reason = unavailable_reason()
            if reason:  # refused, not skipped: a report without those cells would look complete
                raise ValueError(f"--domains {','.join(domains)}: the agent and coding domains run in sandboxes, "
                                 f"which cannot run here ({reason}); pass --domains general")
        if base is None:
            try:
                preset_config(preset)  # an unknown preset is an error now, not after the data stage
            except ValueError as e:
                raise ValueError(f"--preset: {e}") from None
        elif not Path(base).exists():
            raise ValueError(f"--base: no checkpoint or run folder {base}")
        if threads is not None and threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        # absolute, so that report.json's checkpoint folders hold wherever it is read from
        self.out, self.preset, self.profile, self.domains = Path(out).resolve(), preset, profile, domains
        self.base_checkpoint = None if base is None else str(Path(base).resolve())
        self.seed, self.threads = seed, threads
        self.settings = {"preset": preset, "profile": profile.name, "domains": list(domains),
                         "base": self.base_checkpoint, "seed": seed}
        self.state = self._load_state()

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _load_state(self) -> dict:
        path = self.out / PIPELINE_FILE
        if not path.is_file():
            return {"settings": self.settings, "profile": dataclasses.asdict(self.profile), "stages": {}}
        state = read_json(path)
        saved = state.get("settings", {})
        changed = [f"{k}: {saved.get(k)!r} -> {self.settings[k]!r}" for k in FIXED_SETTINGS
                   if saved.get(k) != self.settings[k]]
        if changed:
            raise ValueError(f"{path}: this folder holds a pipeline run with other settings ({'; '.join(changed)}); "
                             "rerun with its settings to continue it, or choose a new --out")
        # the same profile name can hold other numbers (a Profile passed in, or a newer openk3 whose profile
        # changed): the stages done were computed with the recorded ones, so continuing would mix two runs
        recorded, now = state.get("profile", {}), json.loads(json.dumps(dataclasses.asdict(self.profile)))  # as read
        differ = [f"{k}: {recorded.get(k, '(not recorded)')!r} -> {now.get(k, '(none)')!r}"
                  for k in sorted(set(recorded) | set(now)) if recorded.get(k, _MISSING) != now.get(k, _MISSING)]
        if differ:
            raise ValueError(f"{path}: this folder's run used profile {self.profile.name!r} with other numbers than "
                             f"the one requested (recorded -> requested: {'; '.join(differ)}); its stages were "
                             "computed with the recorded ones, so it is not continued with these. Continue it with "
                             "the openk3 version (or Profile) that made it, or choose a new --out")
        return state

    def _save_state(self) -> None:
        write_atomic(self.out / PIPELINE_FILE, (json.dumps(self.state, indent=1) + "\n").encode())

    def output(self, stage: str) -> Path:
        """What a stage writes; a stage marked done whose output is gone runs again."""
        if stage.startswith("teacher "):
            return teacher_dir(self.out, stage.removeprefix("teacher "))
        return {"base": self.base_folder(), "data": self.out / "data" / "sft_train.jsonl", "sft": self.out / "sft",
                "mopd": self.out / "student", "merge": self.out / "merged", "eval": self.out / REPORT_FILE}[stage]

    def done(self, stage: str) -> bool:
        return self.state["stages"].get(stage, {}).get("status") == "done" and self.output(stage).exists()

    def stage_names(self) -> list[str]:
        teachers = [f"teacher {d}/{e}" for d in self.domains for e in CHAIN]
        return ["base", "data", "sft", *teachers, "mopd", "merge", "eval"]

    def run(self, stop_after: str | None = None) -> dict | None:
        """Run every stage not yet done (or up to and including `stop_after`); returns the report when the
        eval stage has run."""
        from openk3.common import setup_cpu

        names = self.stage_names()
        if stop_after is not None and stop_after not in names:
            raise ValueError(f"stop_after: no stage {stop_after!r} (stages: {', '.join(names)})")
        self.out.mkdir(parents=True, exist_ok=True)
        threads = setup_cpu(self.threads)
        self.state.setdefault("runs", []).append({"started": time.time(), "threads": threads})
        self._save_state()
        _say(f"{self.out}: preset {self.preset}, profile {self.profile.name}, domains {','.join(self.domains)}, "
             f"{threads} thread(s); {len(names)} stages")
        for k, name in enumerate(names, 1):
            if self.done(name):
                _say(f"stage {k}/{len(names)} {name}: done before, skipped")
            else:
                _say(f"stage {k}/{len(names)} {name}: running")
                t0 = time.perf_counter()
                settings = self._stage(name)
                seconds = time.perf_counter() - t0
                self.state["stages"][name] = {"status": "done", "seconds": round(seconds, 2), "settings": settings}
                self._save_state()
                _say(f"stage {k}/{len(names)} {name}: done in {seconds:.1f} s")
            if name == stop_after:
                return None
        return read_json(self.out / REPORT_FILE)

    def _stage(self, name: str) -> dict:
        if name.startswith("teacher "):
            return self.teacher(name.removeprefix("teacher "))
        return getattr(self, name)()

    # ---- stages --------------------------------------------------------------------------------------

    def base_folder(self) -> Path:
        return Path(self.base_checkpoint) if self.base_checkpoint is not None else self.out / "base"

    def base(self) -> dict:
        import torch

        from openk3.checkpoint import save
        from openk3.config import preset as preset_config
        from openk3.model.model import K3ForCausalLM
        from openk3.posttrain.domains.records import byte_tokenizer

        if self.base_checkpoint is not None:
            return {"base": self.base_checkpoint}
        cfg = preset_config(self.preset)
        if self.profile.layers is not None and self.profile.layers < cfg.num_hidden_layers:
            from openk3.train.config import TrainConfig, apply_overrides

            # the trainer's override re-derives the KDA/MLA layout and AttnRes blocks for the new depth
            cfg = apply_overrides(TrainConfig(model=cfg), [f"model.num_hidden_layers={self.profile.layers}"]).model
        if self.profile.vocab_size is None:
            tok, kind = byte_tokenizer(), "byte-level"
            if tok.vocab_size > cfg.vocab_size:
                raise ValueError(f"--preset {self.preset}: vocabulary {cfg.vocab_size} is smaller than the "
                                 f"byte-level tokenizer's {tok.vocab_size} ids; give a pretrained --base with its "
                                 "tokenizer")
        else:
            from openk3.posttrain.domains.vocab import train_posttrain_tokenizer
            from openk3.train.trainer import with_tokenizer_ids

            # the model's vocabulary and special ids become the tokenizer's (vocab.py says why)
            tok = train_posttrain_tokenizer(self.domains, self.profile.vocab_size, self.seed)
            cfg, kind = with_tokenizer_ids(cfg, tok), f"bpe-{tok.vocab_size} (posttrain/domains/vocab.py)"
        model = K3ForCausalLM.build(cfg, seed=self.seed).eval()
        folder = self.out / "base"
        save(model, folder, dtype=torch.float32)
        tok.save(str(folder))
        return {"layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size, "tokenizer": kind,
                "init_seed": self.seed}

    def context(self, domains: tuple[str, ...]) -> int | None:
        """max_model_len for trajectories of these domains."""
        p = self.profile
        return p.max_model_len if set(domains) == {"general"} else p.agentic_max_model_len

    def tokenizer(self):
        from openk3.checkpoint.load import resolve_checkpoint
        from openk3.tokenizer import Tokenizer

        return Tokenizer.from_dir(str(resolve_checkpoint(self.base_folder())))

    def data(self) -> dict:
        from collections import Counter

        from openk3.posttrain.domains.budget import BudgetConfig
        from openk3.posttrain.domains.general import sft_dataset
        from openk3.posttrain.domains.records import write_jsonl

        p, tok = self.profile, self.tokenizer()
        records = []
        for domain in self.domains:
            if domain == "general":
                records += sft_dataset(p.general_problems, self.seed, "train", tokenizer=tok, budget=BudgetConfig(),
                                       levels=p.levels)
            else:
                from openk3.posttrain.domains.agentic import agentic_dataset

                records += agentic_dataset(domain, p.agentic_problems, self.seed, "train", tokenizer=tok)
        path = self.out / "data" / "sft_train.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, records)
        counts = Counter(f"{r['domain']}/{r['effort']}" for r in records)
        think = {c: round(sum(r["stats"]["think_tokens"] for r in records if f"{r['domain']}/{r['effort']}" == c)
                          / counts[c], 1) for c in counts}
        return {"file": str(path), "records": len(records), "per_cell": dict(counts), "think_tokens_mean": think}

    def sft(self) -> dict:
        from openk3.posttrain.trainers.sft import SFTConfig, sft
        from openk3.train.optim import OptimConfig

        p = self.profile
        started = self.out / "sft" / "sft_config.json"  # a stage begun by an earlier version keeps its packing
        packing = SFTConfig.from_run(started).packing if started.is_file() else SFTConfig.packing
        cfg = SFTConfig(base=str(self.base_folder()), data=(str(self.out / "data" / "sft_train.jsonl"),),
                        optim=OptimConfig(lr=p.sft_lr), batch_size=p.sft_batch, grad_accum=p.sft_grad_accum,
                        seq_len=p.sft_seq_len if self.domains == ("general",) else p.agentic_seq_len,
                        epochs=p.sft_epochs, max_steps=p.sft_steps, overflow=p.sft_overflow, seed=self.seed,
                        save_every=0, threads=self.threads, packing=packing)
        summary = sft(cfg, self.out / "sft", progress=False)
        return {"config": cfg.to_dict(), "steps": summary["steps"], "final_loss": summary["final_loss"],
                "conversations": summary["conversations"], "dropped_too_long": summary["dropped_too_long"],
                "truncated": summary["truncated"]}

    def teacher(self, cell: str) -> dict:
        from openk3.checkpoint.load import resolve_checkpoint
        from openk3.posttrain.trainers.rl import RLConfig, rl

        domain, effort = cell.split("/")
        k = CHAIN.index(effort)
        previous = None if k == 0 else CHAIN[k - 1]
        # the exact checkpoint, so pipeline.json says which step each teacher started from
        start = resolve_checkpoint(self.out / "sft" if previous is None
                                   else teacher_dir(self.out, f"{domain}/{previous}"))
        p = self.profile
        steps, prompts, group = p.rl_general if domain == "general" and p.rl_general else \
            (p.rl_steps, p.rl_prompts, p.rl_group)
        cfg = RLConfig(model=str(start), domain=domain, effort=effort, steps=steps, prompts_per_step=prompts,
                       group_size=group, lr=p.rl_lr, budget_from_effort=previous, response_cap=p.response_cap,
                       max_turns=p.max_turns, seed=self.seed, save_every=p.save_every or steps,
                       max_model_len=self.context((domain,)), micro_tokens=p.micro_tokens,
                       levels=p.levels if domain == "general" else None, temperature=p.rl_temperature)
        last = rl(cfg, teacher_dir(self.out, cell))
        return {"config": cfg.to_dict(), "last": {k: last.get(k) for k in ("reward", "over_budget_rate", "think_mean")}}

    def teachers(self) -> dict[str, str]:
        return {c: str(teacher_dir(self.out, c)) for c in cells(self.domains)}

    def mopd(self) -> dict:
        from openk3.checkpoint.load import resolve_checkpoint
        from openk3.posttrain.trainers.mopd import MOPDConfig, distill

        p = self.profile
        cfg = MOPDConfig(student=str(resolve_checkpoint(self.out / "sft")), teachers=self.teachers(),
                         cells=tuple(cells(self.domains)),
                         steps=p.mopd_steps, prompts_per_step=p.mopd_prompts, lr=p.mopd_lr,
                         response_cap=p.response_cap, think_cap=p.mopd_think_cap, seed=self.seed,
                         max_turns=p.max_turns, save_every=p.save_every or p.mopd_steps,
                         max_model_len=self.context(self.domains), micro_tokens=p.micro_tokens,
                         levels=p.levels)
        last = distill(cfg, self.out / "student")
        return {"config": cfg.to_dict(), "last": {k: last.get(k) for k in ("reverse_kl", "clipped_frac", "think_mean")}}

    def merge(self) -> dict:
        from openk3.posttrain.merge import merge_checkpoints

        p = self.profile
        teachers = list(self.teachers().values())
        merge_checkpoints(self.out / "sft", teachers, self.out / "merged", p.merge_method, density=p.merge_density)
        argv = ["--base", str(self.out / "sft"), "--models", *teachers, "--method", p.merge_method,
                "--out", str(self.out / "merged")]
        if p.merge_density is not None:
            argv += ["--density", str(p.merge_density)]
        return {"argv": ["openk3", "merge", *argv]}  # the same merge as a command, for the record

    def eval(self) -> dict:
        from openk3.posttrain.evaluation.report import evaluate_models

        p = self.profile
        models = {"sft": self.out / "sft", "student": self.out / "student", "merged": self.out / "merged",
                  **self.teachers()}
        teacher_metrics = {c: f"{path}/metrics.jsonl" for c, path in self.teachers().items()}
        options = dict(cells=",".join(self.domains), n_per_cell=p.eval_n, samples=p.eval_samples,
                       temperature=p.eval_temperature, seed=self.seed, levels=p.levels or None,
                       response_cap=p.response_cap, max_turns=p.eval_max_turns, max_num_seqs=64,
                       think_cap=p.eval_think_cap, max_model_len=self.context(self.domains))
        report = evaluate_models(models, self.out / "eval", teacher_metrics=teacher_metrics,
                                 mopd_metrics=str(self.out / "student" / "metrics.jsonl"), **options)
        write_atomic(self.out / REPORT_FILE, (json.dumps(report, indent=1) + "\n").encode())
        problems = contract_problems(report, self.domains)
        if problems:  # the stages all ran, so this is a bug, not a partial run
            raise RuntimeError(f"{self.out / REPORT_FILE} breaks the issue-18 contract: {'; '.join(problems[:5])}")
        return {"options": options}
