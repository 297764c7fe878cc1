"""Training: Muon + AdamW (`optim`), LR schedules (`schedule`), expert load balancing (`balance`), QK-Clip
(`qk_clip`); the run loop every trainer drives (`loop`), the run folder a trainer opens and resumes (`state`),
configs (`config`), and pretraining (`trainer`: the step, its job, `train`)."""

from openk3.train.balance import (
    RoutingRecorder,
    apply_quantile_balancing,
    apply_sign_balancing,
    aux_balance_loss,
    load_stats,
    quantile_balance_update,
    sign_balance_update,
)
from openk3.train.optim import Muon, OptimConfig, OptimizerSet, build_optimizer, clip_grad_norm_, param_groups
from openk3.train.qk_clip import QKClipRecorder, mla_max_logits, qk_clip_
from openk3.train.schedule import LRSchedule, lr_multiplier

__all__ = [
    "LRSchedule", "Muon", "OptimConfig", "OptimizerSet", "QKClipRecorder", "RoutingRecorder",
    "apply_quantile_balancing", "apply_sign_balancing", "aux_balance_loss", "build_optimizer", "clip_grad_norm_",
    "load_stats", "lr_multiplier", "mla_max_logits", "param_groups", "qk_clip_", "quantile_balance_update",
    "sign_balance_update",
]
