"""Parallelism applied from outside the single-device model (issue 19; docs/distributed.md).

The model code never imports torch.distributed. `mesh.py` builds the process mesh from the config's degrees
(the null mesh for one process); `fsdp.py` shards a built model with FSDP2; `ep.py` spreads each MoE layer's
routed experts over ranks (all-to-all dispatch); `pipeline.py` cuts the layers into stages at AttnRes block
boundaries, each stage running a range of the model's own layers; `ac.py` recomputes sub-layers in the
backward (activation checkpointing); `checkpoint.py` saves and loads sharded state with DCP; `layout.py`
checks and describes a layout. The trainer uses the mesh's collectives, which are identities in one process.
"""
