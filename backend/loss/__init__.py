"""The training objectives as functions of per-token tensors, below the trainer.

``cross_entropy``: sum(loss_weight x token cross-entropy) / the window's loss tokens;
``policy``: the PPO / GRPO clipped objective, its KL and entropy terms and their normalisation
over the optimizer window (``WindowStats``). The trainer (``backend.train.step``) runs the model
and hands these functions the per-token log-probabilities; the RL worker uses the same ones.
"""
