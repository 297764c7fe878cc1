"""Parallelism applied from outside the single-device model (issue 19; docs/distributed.md).

The model code never imports torch.distributed: `mesh.py` builds the process mesh from the config's degrees
(the null mesh for one process), `fsdp.py` shards a built model with FSDP2, and the trainer uses the mesh's
collectives, which are identities in one process.
"""
