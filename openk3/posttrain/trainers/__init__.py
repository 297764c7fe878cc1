"""Post-training trainers: SFT (sft_data.py, sft.py: the run loop of `openk3.train.loop` with the pretraining
step), engine rollouts with behaviour log-probs (rollout.py), per-cell RL problems (problems.py), the losses
(losses.py), the on-policy run shared by RL and MOPD (onpolicy.py), RL teachers (rl.py) and MOPD (mopd.py)."""
