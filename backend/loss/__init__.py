"""The training objectives, below the trainer: each a registered ``Objective`` (``registry``) that
the step receives, built on functions of per-token tensors.

``cross_entropy``: sum(loss_weight x token cross-entropy) / the window's loss tokens;
``policy``: the PPO / GRPO clipped objective, its KL and entropy terms and their normalisation
over the optimizer window (``WindowStats``); ``value``: PPO's clipped value loss. An objective
runs the model on a microbatch through ``outputs`` (per-token losses, log-probabilities, values)
and hands the per-token tensors to these functions; the RL workers use the same ones.
"""
