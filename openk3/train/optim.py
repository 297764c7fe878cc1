"""Muon (with Per-Head Muon for attention projections) + AdamW, parameter grouping, gradient clipping.

The K3 recipe as far as public (landscape §0, spec §9): Muon orthogonalisation *per attention head*
for matrices, AdamW for embeddings, head, norms, vectors and gates, weight decay 0.1; the update of
Muon is rescaled so its RMS matches AdamW's (Moonlight: 0.2 * sqrt(max(rows, cols))), which lets
one learning rate serve both halves.

Parameter table (`classify`, by name and shape; first matching row wins):

| parameter | optimizer | kind | decay | blocks orthogonalised |
|---|---|---|---|---|
| `model.embed_tokens.weight` | AdamW | embedding | yes | - |
| `lm_head.weight` | AdamW | head | yes | - |
| any 1-D tensor (RMSNorm gains, `o_norm`, `A_log`, `dt_bias`) | AdamW | vector | no | - |
| KDA `*_conv1d.weight` [P, 1, k] | AdamW | conv | no | - |
| AttnRes `*_res_proj.weight` [1, D] (pseudo-queries) | AdamW | attnres_query | no | - |
| router `block_sparse_moe.gate.weight` [E, D] | AdamW (Muon if `muon_router`) | router | yes | whole matrix |
| KDA `b_proj.weight` [H, D] (one beta gate per head) | AdamW | gate | yes | - |
| stacked experts `experts.w1/w3/w2` [E, out, in] | Muon | experts | yes | each expert |
| `self_attn.` q/k/v/g_proj, f_b/g_b_proj, q_b_proj, kv_b_proj (rows head-major) | Muon | per_head_rows | yes | head |
| `self_attn.o_proj` (input columns head-major) | Muon | per_head_cols | yes | head |
| every other matrix (1) | Muon | matrix | yes | whole matrix |

(1) MLA `q_a_proj` and `kv_a_proj_with_mqa` (shared by all heads), KDA `f_a_proj`/`g_a_proj`, the
dense and shared-expert MLPs, the latent down/up projections.

`muon=False` (the Muon -> AdamW ablation of Moonlight and of K3's recipe; the scaling lab's baseline)
sends every row of the table to AdamW with the same kind and the same weight decay (matrices and experts
keep theirs), at `adamw_lr` (else `lr`); the Muon-only options (`per_head`, `momentum`, `nesterov`,
`ns_*`) are then unused, and `muon_router=True` is refused.

"Gates" is read as the router (its scores are a gate over experts) and KDA's per-head beta gate
`b_proj`, whose per-head block would be a single row; the output-gate projections `g_proj` are
head-major matrices like q/k/v and get Per-Head Muon.

The math lives in functions of tensors (`newton_schulz`, `muon_update`, `to_blocks`/`from_blocks`)
so a sharded (FSDP2/DTensor) optimizer can reuse it on local blocks later.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan's Muon, Moonlight)

PER_HEAD_ROWS = ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "g_b_proj", "q_b_proj", "kv_b_proj")
PER_HEAD_COLS = ("o_proj",)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 2e-4  # Muon peak LR (RMS-matched, so AdamW-like values)
    adamw_lr: float | None = None  # None: same as `lr`
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled, both halves; never on vectors, convs, AttnRes queries
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 elsewhere), "float32" or "bfloat16"
    per_head: bool = True  # False: plain Muon on whole attention matrices (ablation)
    muon_router: bool = False
    grad_clip: float | None = 1.0
    # QK-Clip (`openk3.train.qk_clip`) rescales q/k weights after the step, whatever took it: K2 paired it
    # with Muon because Muon let max logits grow, but the rule reads only the weights and the logits, so with
    # muon=False it applies unchanged and the Muon/AdamW ablation differs in the optimizer alone.
    qk_clip_tau: float | None = 100.0  # Kimi K2's MuonClip threshold (see `openk3.train.qk_clip`)
    muon: bool = True  # False: every parameter on AdamW (the Muon -> AdamW ablation; module doc)

    def __post_init__(self) -> None:
        if self.muon_router and not self.muon:
            raise ValueError("optim.muon_router=True asks for Muon on the router, but optim.muon=False puts "
                             "every parameter on AdamW; drop one of them")

    @property
    def resolved_adamw_lr(self) -> float:
        """AdamW's peak LR: `adamw_lr`, else `lr`."""
        return self.lr if self.adamw_lr is None else self.adamw_lr

    @property
    def peak_lr(self) -> float:
        """The peak LR of the matrices (what a run logs as its "lr"): Muon's, or AdamW's when muon=False."""
        return self.lr if self.muon else self.resolved_adamw_lr


# -- classification ------------------------------------------------------------------------------------

def _heads_of(model: nn.Module, name: str) -> int:
    parent = model.get_submodule(".".join(name.split(".")[:-2]))  # "<...>.self_attn.q_proj.weight"
    heads = getattr(parent, "num_heads", None)
    if heads is None:
        raise ValueError(f"{name}: per-head parameter outside an attention module with `num_heads`")
    return int(heads)


def classify(model: nn.Module, name: str, p: torch.Tensor, cfg: OptimConfig) -> dict:
    """One parameter -> {"optimizer", "kind", "decay", "heads", "axis"} (see the module table).

    `heads` blocks are cut along `axis` of the last two dims (0: rows, 1: columns); leading dims
    (stacked experts) are independent matrices.
    """
    parts = name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else ""

    def adamw(kind: str, decay: bool) -> dict:
        return {"optimizer": "adamw", "kind": kind, "decay": decay, "heads": 1, "axis": 0}

    def muon(kind: str, heads: int = 1, axis: int = 0) -> dict:
        if not cfg.muon:  # the AdamW ablation: same kind and decay, no blocks (AdamW is elementwise)
            return adamw(kind, True)
        return {"optimizer": "muon", "kind": kind, "decay": True, "heads": heads, "axis": axis}

    if name.endswith("embed_tokens.weight"):
        return adamw("embedding", True)
    if name == "lm_head.weight" or name.endswith(".lm_head.weight"):
        return adamw("head", True)
    if p.ndim <= 1:
        return adamw("vector", False)
    if leaf.endswith("conv1d"):
        return adamw("conv", False)
    if leaf.endswith("_res_proj"):
        return adamw("attnres_query", False)
    if name.endswith("block_sparse_moe.gate.weight"):
        return muon("router") if cfg.muon_router else adamw("router", True)
    if "self_attn" in parts and leaf == "b_proj":
        return adamw("gate", True)
    if p.ndim == 3 and "experts" in parts:
        return muon("experts")
    if p.ndim != 2:
        raise ValueError(f"{name}: no optimizer rule for shape {tuple(p.shape)}")
    if cfg.per_head and "self_attn" in parts and leaf in PER_HEAD_ROWS + PER_HEAD_COLS:
        heads = _heads_of(model, name)
        axis = 1 if leaf in PER_HEAD_COLS else 0
        if p.shape[axis] % heads:
            raise ValueError(f"{name}: dim {axis} of {tuple(p.shape)} is not divisible by {heads} heads")
        return muon("per_head_cols" if axis else "per_head_rows", heads, axis)
    return muon("matrix")


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Every trainable parameter in exactly one group, grouped by (optimizer, kind, decay, heads, axis).

    Each group: params, names, optimizer ("muon" | "adamw"), kind, heads, axis, lr, base_lr,
    weight_decay. Order is deterministic (first appearance in `named_parameters`), which is what
    makes optimizer state dicts portable between two builds of the same model.
    """
    adamw_lr = cfg.resolved_adamw_lr
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        c = classify(model, name, p, cfg)
        key = (c["optimizer"], c["kind"], c["decay"], c["heads"], c["axis"])
        if key not in groups:
            lr = cfg.lr if c["optimizer"] == "muon" else adamw_lr
            groups[key] = {"params": [], "names": [], "optimizer": c["optimizer"], "kind": c["kind"],
                           "heads": c["heads"], "axis": c["axis"], "lr": lr, "base_lr": lr,
                           "weight_decay": cfg.weight_decay if c["decay"] else 0.0}
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    return list(groups.values())


# -- Muon math (pure functions of tensors) -------------------------------------------------------------

def newton_schulz(G: torch.Tensor, steps: int = 5, *, dtype: torch.dtype | None = None,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalisation U V^T of each matrix in G [..., r, c] (quintic Newton-Schulz).

    Each matrix is scaled to unit Frobenius norm, then iterated X <- aX + (bA + cA^2)X with A = XX^T
    (on the wide orientation, so A is the small Gram matrix). The coefficients trade exactness for
    speed: singular values land in roughly [0.7, 1.2], not exactly 1. Returns G's shape in `dtype`
    (default G's dtype).
    """
    a, b, c = NS_COEFFS
    X = G.to(dtype or G.dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = X.reshape(shape)
    return X.mT if tall else X


def to_blocks(t: torch.Tensor, heads: int, axis: int) -> torch.Tensor:
    """[..., r, c] -> [..., heads, r/heads, c] (axis 0) or [..., heads, r, c/heads] (axis 1)."""
    *lead, r, c = t.shape
    if heads == 1:
        return t
    if axis == 0:
        return t.reshape(*lead, heads, r // heads, c)
    return t.reshape(*lead, r, heads, c // heads).transpose(-3, -2)


def from_blocks(b: torch.Tensor, heads: int, axis: int) -> torch.Tensor:
    """Inverse of `to_blocks`."""
    if heads == 1:
        return b
    if axis == 0:
        *lead, h, rh, c = b.shape
        return b.reshape(*lead, h * rh, c)
    c = b.transpose(-3, -2)  # [..., r, heads, c/heads]
    return c.reshape(*c.shape[:-2], c.shape[-2] * c.shape[-1])


def whole_matrices_local(p: torch.Tensor) -> bool:
    """A DTensor of stacked matrices [E, rows, cols] whose every placement is Replicate or Shard(0): each rank
    holds whole matrices (experts under FSDP or expert parallelism), so Muon needs no gathering (B.5)."""
    return p.ndim == 3 and all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in p.placements)


def momentum_direction(grad: torch.Tensor, buf: torch.Tensor, *, momentum: float, nesterov: bool) -> torch.Tensor:
    """buf <- momentum * buf + grad (in place, fp32); returns grad + momentum * buf (Nesterov) or buf."""
    g = grad.float()
    buf.mul_(momentum).add_(g)
    return g.add(buf, alpha=momentum) if nesterov else buf


def rms_scale(block_rows: int, block_cols: int) -> float:
    """Moonlight's update scale, 0.2 * sqrt(max(rows, cols)): orthogonalised update RMS ~ AdamW's."""
    return 0.2 * math.sqrt(max(block_rows, block_cols))


def muon_update(grad: torch.Tensor, buf: torch.Tensor, *, momentum: float, nesterov: bool, ns_steps: int,
                heads: int = 1, axis: int = 0, ns_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One Muon direction (fp32, `grad`'s shape); updates the momentum buffer `buf` in place.

    Each block of the momentum direction (per head along `axis`, per expert along leading dims) is
    orthogonalised and scaled by `rms_scale` of the block. `Muon.step` does the same, batching the
    Newton-Schulz iterations of equally shaped blocks across parameters.
    """
    u = momentum_direction(grad, buf, momentum=momentum, nesterov=nesterov)
    blocks = to_blocks(u, heads, axis)
    o = newton_schulz(blocks, ns_steps, dtype=ns_dtype).float() * rms_scale(*blocks.shape[-2:])
    return from_blocks(o, heads, axis).reshape(grad.shape)


def _resolve_ns_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Muon(torch.optim.Optimizer):
    """Muon on matrices (and stacks of matrices), per-block orthogonalisation from group metadata.

    Group keys: lr, weight_decay (decoupled: p <- p * (1 - lr * wd)), momentum, nesterov, ns_steps,
    ns_dtype, heads, axis. State: `momentum_buffer` (fp32) per parameter, in the parameter's own layout.

    Sharded parameters (FSDP2 DTensors, `openk3.parallel`): the momentum stays sharded (elementwise), the
    direction is all-gathered, every rank orthogonalises the whole matrix (the same deterministic result on
    each) and keeps its own rows: Moonlight's gather-everywhere, the background's v1 (B.5), exactly the
    single-process update. Stacked experts split by whole matrices (Shard(0): FSDP2 or expert parallelism)
    are orthogonalised where they are, with no communication.
    """

    def __init__(self, params, *, lr: float = 2e-4, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "auto", heads: int = 1,
                 axis: int = 0) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_dtype=ns_dtype, heads=heads, axis=axis)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            heads, axis = group["heads"], group["axis"]
            # Equally shaped blocks of all parameters of the group share one batched Newton-Schulz call.
            buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                u = momentum_direction(p.grad, state["momentum_buffer"], momentum=group["momentum"],
                                       nesterov=group["nesterov"])
                local = hasattr(u, "full_tensor") and whole_matrices_local(p)
                if local:  # stacked experts split between ranks by whole matrices: orthogonalise them here
                    u = u.to_local()
                elif hasattr(u, "full_tensor"):  # a DTensor shard: orthogonalise the whole matrix
                    u = u.full_tensor()
                blocks = to_blocks(u, heads, axis)
                buckets.setdefault((tuple(blocks.shape[-2:]), p.device), []).append((p, blocks, u.shape, local))
            for ((r, c), device), items in buckets.items():
                flat = torch.cat([b.reshape(-1, r, c) for _, b, _, _ in items])
                ns_dtype = _resolve_ns_dtype(group["ns_dtype"], device)
                o = newton_schulz(flat, group["ns_steps"], dtype=ns_dtype).float() * rms_scale(r, c)
                for (p, blocks, shape, local), o_p in zip(items, o.split([b[..., 0, 0].numel()
                                                                          for _, b, _, _ in items])):
                    upd = from_blocks(o_p.reshape(blocks.shape), heads, axis).reshape(shape)
                    if local:
                        from torch.distributed.tensor import DTensor

                        upd = DTensor.from_local(upd, p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
                    elif hasattr(p, "device_mesh"):  # keep this rank's part (no communication)
                        from torch.distributed.tensor import distribute_tensor

                        upd = distribute_tensor(upd, p.device_mesh, p.placements, src_data_rank=None)
                    if group["weight_decay"]:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(upd.to(p.dtype), alpha=-group["lr"])
        return loss


# -- the pair, as the training loop sees it -------------------------------------------------------------

class OptimizerSet:
    """Muon + AdamW stepping together. `set_lr_multiplier` is the scheduler's hook (lr = base_lr * m)."""

    def __init__(self, muon: Muon | None, adamw: torch.optim.AdamW | None, cfg: OptimConfig) -> None:
        self.muon, self.adamw, self.cfg = muon, adamw, cfg
        self.lr_multiplier = 1.0
        # the running mean of the gradient norms of the steps taken, where a step's size follows its gradient's
        # norm against it (on-policy RL/MOPD: `posttrain.trainers.onpolicy.signal_step`); None until then
        self.grad_norm_mean: float | None = None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def set_lr_multiplier(self, m: float) -> None:
        self.lr_multiplier = float(m)
        for g in self.param_groups:
            g["lr"] = g["base_lr"] * self.lr_multiplier

    def clip_grad_norm_(self, max_norm: float | None = None) -> torch.Tensor:
        """Clip all gradients to `max_norm` (default `cfg.grad_clip`; None: only measure)."""
        max_norm = self.cfg.grad_clip if max_norm is None else max_norm
        return clip_grad_norm_(self.params(), max_norm)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The state with whole tensors: a sharded (FSDP2) parameter's state is gathered (a collective, so
        every rank calls it), so a checkpoint is the same whatever the world size that wrote it."""
        return {"muon": _gathered(self.muon.state_dict()) if self.muon else None,
                "adamw": _gathered(self.adamw.state_dict()) if self.adamw else None,
                "lr_multiplier": self.lr_multiplier, "grad_norm_mean": self.grad_norm_mean}

    def load_state_dict(self, sd: dict) -> None:
        """Load a `state_dict()` (whole tensors); a sharded parameter keeps its own rows of each."""
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if (opt is None) != (sd[key] is None):
                raise ValueError(f"state dict {key} does not match this optimizer set")
            if opt is not None:
                opt.load_state_dict(sd[key])
                _shard_like_params(opt)
        self.set_lr_multiplier(sd["lr_multiplier"])
        self.grad_norm_mean = sd.get("grad_norm_mean")  # (absent from checkpoints written before it existed)


def _gathered(sd: dict) -> dict:
    """An optimizer state dict with every DTensor replaced by its whole value (state order is the same on
    every rank, so the collectives line up)."""
    state = {k: {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in entry.items()}
             for k, entry in sd["state"].items()}
    return {**sd, "state": state}


def _shard_like_params(opt: torch.optim.Optimizer) -> None:
    """After loading whole tensors: each state tensor of a parameter's shape takes that parameter's layout."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not hasattr(p, "device_mesh"):
                continue
            from torch.distributed.tensor import distribute_tensor

            for name, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v) and not hasattr(v, "device_mesh") and tuple(v.shape) == tuple(p.shape):
                    opt.state[p][name] = distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> OptimizerSet:
    """Group the parameters (`param_groups`) and build Muon for the Muon half, torch AdamW for the rest
    (either may be None: `muon=False` has no Muon groups)."""
    groups = param_groups(model, cfg)
    muon_groups = [g for g in groups if g["optimizer"] == "muon"]
    adamw_groups = [g for g in groups if g["optimizer"] == "adamw"]
    muon = Muon(muon_groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                ns_dtype=cfg.ns_dtype) if muon_groups else None
    adamw = torch.optim.AdamW(adamw_groups, lr=cfg.resolved_adamw_lr,
                              betas=cfg.betas, eps=cfg.eps,
                              weight_decay=cfg.weight_decay) if adamw_groups else None
    return OptimizerSet(muon, adamw, cfg)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of all gradients (before clipping); scales them to `max_norm` if above it."""
    params = [p for p in params if p.grad is not None]
    if max_norm is None:
        return torch.nn.utils.get_total_norm([p.grad for p in params])
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
