"""The smoke profiles' material: a tiny K3, two tasks it learns in seconds, supervised steps and greedy scoring.

    model = tiny_k3(seed)                                     # nano cut to 2 layers (KDA, dense FFN then MoE)
    items = digit_items(200, "test", seed)                    # "kq7mzxab" -> answer "8" ((d + 1) mod 10)
    supervise(model, [i.prompt for i in items], [i.answer for i in items], steps=10, lr=1e-3, seed=0)
    firsts = first_tokens(model, [i.prompt for i in items])   # the greedy first answer token of each prompt

Both tasks answer with one token, so a rollout is one sampled token (`ONE_TOKEN`: every id ends the turn) and
a greedy evaluation is one forward pass: the smoke profiles fit in minutes on one CPU core and still run the
very `rl_step` / `mopd_step` / `merge` a full run uses. Prompts end in the think channel's opening, as every
generation prompt of a thinking model does.

Splits are disjoint by construction: an item belongs to the split its text hashes to (`split_of`), so no
held-out prompt was ever trained on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from openk3.chat import OPEN, SEP
from openk3.posttrain.domains.records import byte_tokenizer

TOK = byte_tokenizer()
THINK_OPEN = [TOK.special_ids[OPEN], *TOK.encode("think"), TOK.special_ids[SEP]]
ONE_TOKEN = tuple(range(TOK.vocab_size))  # extra stop ids: the first sampled token ends the episode
SPLITS = {"train": range(0, 8), "val": range(8, 9), "test": range(9, 10)}  # by the text's hash mod 10
FILLER = 7  # letters around the hidden digit


def split_of(text: str) -> str:
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") % 10
    return next(name for name, r in SPLITS.items() if h in r)


@dataclass(frozen=True)
class Item:
    id: str
    text: str
    prompt: list[int]  # token ids, ending in the think opening
    answer: int  # the token id of the right first token
    cell: str = "general/high"  # the (domain, effort) whose teacher/metrics it belongs to


def _draw(split: str, n: int, seed: int, make: Callable[[random.Random], tuple[str, int, str]],
          salt: str) -> list[Item]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    rng = random.Random(f"{salt}|{split}|{seed}")
    out: list[Item] = []
    seen: set[str] = set()
    while len(out) < n:
        text, answer, cell = make(rng)
        if split_of(text) == split and text not in seen:
            seen.add(text)
            out.append(Item(f"{salt}/{split}/{len(out)}", text, TOK.encode(text) + THINK_OPEN, answer, cell))
    return out


def digit_items(n: int, split: str, seed: int = 0) -> list[Item]:
    """A digit d hidden among FILLER random lowercase letters; the answer is the digit (d + 1) mod 10."""
    def make(rng: random.Random) -> tuple[str, int, str]:
        letters = [chr(97 + rng.randrange(26)) for _ in range(FILLER)]
        d = rng.randrange(10)
        letters.insert(rng.randrange(FILLER + 1), str(d))
        return "".join(letters), TOK.encode(str((d + 1) % 10))[0], "general/high"

    return _draw(split, n, seed, make, "digit")


def splits(make: Callable[[int, str, int], list[Item]], sizes: dict, seed: int) -> tuple[list[Item], ...]:
    """(train, val, test) items of a task (`digit_items`, `tagged_items`), `sizes["train"]` etc. of each."""
    return tuple(make(sizes[split], split, seed) for split in ("train", "val", "test"))


TAGS = {"general/low": "lo:", "general/high": "hi:"}  # the effort tag a prompt starts with (same length)


def tagged_items(n: int, split: str, seed: int = 0) -> list[Item]:
    """An effort tag (`TAGS`) then FILLER random letters; half the items per cell. There is no answer of the
    task's own (`answer` is -1): the behaviour to follow is each cell's teacher's."""
    cells = list(TAGS)

    def make(rng: random.Random) -> tuple[str, int, str]:
        cell = cells[rng.randrange(len(cells))]
        return TAGS[cell] + "".join(chr(97 + rng.randrange(26)) for _ in range(FILLER)), -1, cell

    return _draw(split, n, seed, make, "tagged")


def turn_ids(reasoning: str, content: str) -> list[int]:
    """The ids a model generates for an assistant turn with this think text and response, after a prompt that
    ends in the think opening (XTML, the byte tokenizer: think text, close, the response channel, end)."""
    from openk3.chat import encode_segments, render

    user = [{"role": "user", "content": "x"}]

    def ids(messages: list[dict], prompt: bool) -> list[int]:
        return encode_segments(render({"messages": messages, "tools": [], "thinking_effort": "high",
                                       "add_generation_prompt": prompt}), TOK).ids

    before = ids(user, True)
    after = ids([*user, {"role": "assistant", "reasoning_content": reasoning, "content": content}], False)
    assert after[:len(before)] == before and before[-len(THINK_OPEN):] == THINK_OPEN
    return after[len(before):]


def tiny_k3(seed: int, layers: int = 2):
    """The nano preset cut to `layers` layers (2: a KDA layer with a dense FFN, one with the latent MoE; Block
    AttnRes, SiTU-GLU and the byte vocabulary as nano has them), float32."""
    from openk3.model.model import K3ForCausalLM
    from openk3.train.config import TrainConfig, apply_overrides

    cfg = apply_overrides(TrainConfig(), [f"model.num_hidden_layers={layers}"]).model
    return K3ForCausalLM.build(cfg, seed=seed).eval()


def optimizer(model, lr: float):
    """Muon + AdamW as the trainers build it (no weight decay, no QK-Clip)."""
    from openk3.train.optim import OptimConfig, build_optimizer

    return build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0, qk_clip_tau=None))


def mean(scores: dict) -> float:
    """The mean of {item id: score} (an arm's accuracy, agreement or think tokens over its items)."""
    return sum(scores.values()) / len(scores)


def _by_length(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The prompts' indices grouped by length (each group one forward pass without padding)."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    return list(groups.values())


@torch.no_grad()
def first_tokens(model, prompts: Sequence[Sequence[int]], batch: int = 256) -> list[int]:
    """The greedy first token after each prompt (prompts of one length share a forward pass)."""
    model.eval()
    out: dict[int, int] = {}
    for rows in _by_length(prompts):
        for k in range(0, len(rows), batch):
            part = rows[k:k + batch]
            ids = torch.tensor([list(prompts[i]) for i in part])
            for i, t in zip(part, model(ids)[:, -1].argmax(-1).tolist(), strict=True):
                out[i] = t
    return [out[i] for i in range(len(prompts))]


@torch.no_grad()
def first_token_mass(model, prompts: Sequence[Sequence[int]], tokens: Sequence[int]) -> float:
    """The mean probability the model puts on `tokens` as the first token after each prompt."""
    model.eval()
    total = 0.0
    for rows in _by_length(prompts):
        probs = model(torch.tensor([list(prompts[i]) for i in rows]))[:, -1].float().softmax(-1)
        total += float(probs[:, list(tokens)].sum())
    return total / len(prompts)


def supervise(model, prompts: Sequence[Sequence[int]], answers: Sequence[int | Sequence[int]], *, steps: int,
              lr: float, seed: int, batch: int = 32, every: int = 0, stop: Callable[[int], bool] | None = None) -> int:
    """Supervised steps on what follows each prompt: a token id, or a list of ids (a whole turn), by
    cross-entropy summed over the answer's tokens and averaged over the batch (right padding, causal, so
    padding changes nothing before it); batches drawn with `seed`; `stop(step)` is asked every `every` steps
    and ends the training when true. Returns the steps taken."""
    opt = optimizer(model, lr)
    rng = random.Random(seed)
    targets = [[a] if isinstance(a, int) else list(a) for a in answers]
    for step in range(1, steps + 1):
        rows = [rng.randrange(len(prompts)) for _ in range(batch)]
        T = max(len(prompts[r]) + len(targets[r]) for r in rows)
        ids = torch.zeros(batch, T, dtype=torch.long)
        labels = torch.full((batch, T - 1), -100, dtype=torch.long)  # labels[t] is the token at t + 1
        for b, r in enumerate(rows):
            p, a = list(prompts[r]), targets[r]
            ids[b, :len(p) + len(a)] = torch.tensor(p + a)
            labels[b, len(p) - 1:len(p) - 1 + len(a)] = torch.tensor(a)
        model.train()
        opt.zero_grad()
        logits = model(ids)[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum") / batch
        loss.backward()
        opt.clip_grad_norm_()
        opt.step()
        model.eval()
        if every and step % every == 0 and stop is not None and stop(step):
            return step
    return steps
