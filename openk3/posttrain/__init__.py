"""Post-training the K3 way: SFT, effort-budgeted RL teachers, MOPD, the merge ablation, evaluation (issue 18)."""
