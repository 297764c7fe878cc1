"""`openk3 train --dry-run`: the layout a launch would get, before any process starts.

    print(describe(cfg))          # the mesh, each rank's rows, memory per rank, where the experts live

Planning, not launching: the world size is the product of the `parallel.*` degrees (give
`parallel.dp_shard=8` to see 8 processes), every other rule of `ParallelConfig.check` applies. Memory per
rank is `openk3 plan`'s training arithmetic (`plan/train.py::per_gpu_bytes`: bf16 weights + fp32 master and
gradients + the optimizer split, fully sharded over the ranks; one gathered layer; one micro-batch's
activations with full activation checkpointing), so the two commands agree; a CPU fp32 run keeps fp32
weights instead of the bf16 + fp32 pair, which the line says.
"""

from __future__ import annotations


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def describe(cfg) -> str:
    """The dry-run report of a `TrainConfig` (ValueError naming the degree when the layout cannot run)."""
    from openk3.plan import counts
    from openk3.plan.train import TrainSpec, optimizer_split, per_gpu_bytes

    par, world = cfg.parallel, cfg.parallel.world_size
    par.check(world, cfg.batch_size, cfg.grad_accum)
    dp, accum = par.dp, cfg.grad_accum
    rows = cfg.batch_size // dp
    micro = rows // accum
    lines = [f"[train] dry run: {world} process{'es' if world > 1 else ''}; mesh dp_replicate {par.dp_replicate} x "
             f"dp_shard {par.dp_shard} (pp {par.pp}, cp {par.cp}, ep {par.ep}); launch: "
             + ("openk3 train ..." if world == 1 else
                f"torchrun --standalone --nproc_per_node {world} -m openk3 train ... (one node)")]
    for rank in range(min(world, 8) if par.pp == 1 else 0):  # pipeline stages: the stage map below
        replica, shard = divmod(rank, par.dp_shard)
        lines.append(f"  rank {rank}: replica {replica}, shard {shard}: rows {rank * rows}-{(rank + 1) * rows - 1} "
                     f"of each global batch of {cfg.batch_size}, in {accum} micro-batch{'es' if accum > 1 else ''} "
                     f"of {micro} x {cfg.seq_len} tokens")
    if world > 8 and par.pp == 1:
        lines.append(f"  ... ranks 8-{world - 1} alike")
    model = cfg.model
    p = counts.params(model)
    split = optimizer_split(model)
    if par.pp > 1:
        lines.append(f"  parameters {p.total:,} ({split['muon']:,} on Muon, {split['adamw']:,} on AdamW); each rank "
                     "trains its stage's parameters (their gradients and optimizer state) and, in this version, "
                     "holds the whole model's weights")
    else:
        lines.append(f"  parameters {p.total:,} ({split['muon']:,} on Muon, {split['adamw']:,} on AdamW); each "
                     f"rank holds 1/{par.dp_shard} of every parameter and its optimizer state"
                     + (f", replicated {par.dp_replicate}x" if par.dp_replicate > 1 else ""))
    spec = TrainSpec(seq_len=cfg.seq_len, micro_batch_tokens=micro * cfg.seq_len)
    mem = per_gpu_bytes(model, spec, par.dp_shard)
    lines.append(f"  memory per rank (openk3 plan's arithmetic: bf16 weights + fp32 master and gradients, "
                 f"full activation checkpointing; a {cfg.dtype} CPU run keeps fp32 weights instead): sharded state "
                 f"{_mib(mem['sharded_state'])}, gathered layer weights {_mib(mem['gathered_weights'])}, "
                 f"activations {_mib(mem['activations'])}, logits {_mib(mem['logits'])}; total {_mib(mem['total'])}")
    if par.pp > 1:
        from openk3.parallel.pipeline import bank_rows, stage_bounds

        bounds = stage_bounds(model, par.pp, par.pp_cuts)
        kind = "1F1B" if accum >= par.pp else "GPipe"
        lines.append(f"  pipeline: {par.pp} stages cut at AttnRes block boundaries; every stage sees the whole "
                     f"batch of {cfg.batch_size} rows in {accum} micro-batch{'es' if accum > 1 else ''} of {micro} "
                     f"x {cfg.seq_len} tokens ({kind}; grad_accum sets them)")
        for s, (a, b) in enumerate(bounds):
            extra = " + embedding" if s == 0 else ""
            extra += " + output mix, norm, head" if s == par.pp - 1 else ""
            sends = (f"; sends {bank_rows(model, b)} x [micro-batch, {cfg.seq_len}, {model.hidden_size}]"
                     if s < par.pp - 1 else "")
            lines.append(f"    stage {s} (rank {s}): layers {a}-{b - 1}{extra}{sends}")
    experts = model.num_experts
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_hidden_layers))
    if experts and par.ep > 1:
        from openk3.parallel.ep import check_ep, expert_map

        check_ep(experts, par.ep)
        width, k = model.expert_in_dim, model.num_experts_per_token
        # dispatch + combine forward, the same two backward; on average 1/ep of the rows stay on their rank
        row_bytes = width * (2 if cfg.dtype == "bf16" else 4)
        a2a = 4 * moe_layers * rows * cfg.seq_len * k * row_bytes * (par.ep - 1) / par.ep
        lines.append(f"  experts: {moe_layers} MoE layers x {experts} routed experts; ep {par.ep}: each rank holds "
                     f"{experts // par.ep} whole experts of every MoE layer (not FSDP-sharded); tokens reach them by "
                     f"all-to-all of {width}-wide rows ({'the latent' if model.use_latent_moe else 'the hidden'} "
                     f"width), about {_mib(a2a)} sent per rank and step under uniform routing")
        for r, (first, last) in enumerate(expert_map(experts, par.ep)[:8]):
            lines.append(f"    rank {r}: experts {first}-{last}")
    elif experts and par.dp_shard > 1:
        lines.append(f"  experts: {moe_layers} MoE layers x {experts} routed experts; ep 1: every rank holds "
                     f"all {experts} of each layer, their rows sharded over the {par.dp_shard} shard ranks "
                     f"(parallel.ep={par.dp_shard} keeps whole experts per rank instead)")
    elif experts:
        lines.append(f"  experts: {moe_layers} MoE layers x {experts} routed experts, all on every rank that holds "
                     "their layer")
    return "\n".join(lines)
