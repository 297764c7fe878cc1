"""Post-training the K3 way (issue 18; docs/posttraining.md): SFT, effort-budgeted RL teachers, MOPD, the merge
ablation, evaluation. Three rooms, each importing only the ones before it (tests/test_layers.py checks):

    domains/      what is trained on: the trajectory record, effort budgets, the `general` domain's generators,
                  the `agent` / `coding` experts acting in sandboxes, the pipeline's tokenizer
    trainers/     how: SFT data and loop, rollouts, RL problems, the losses, the on-policy run, RL and MOPD
    evaluation/   what came out: every model on every (domain, effort) cell, plots, the report

`merge.py` (weight merging: the baseline MOPD is compared with) sits beside evaluation, and `pipeline.py` (the
whole pipeline, `openk3 posttrain`) on top of all.
"""
