"""Every key a ``metrics.jsonl`` row (and so wandb) can hold: its unit and meaning.

The one list of what the numbers are: ``docs/reference/metrics.md`` is generated from it and the
tests check that the rows of real runs (training, evaluation, GRPO, PPO with a critic, MoE) hold
no key missing here, so a new metric without a meaning fails. No torch: read by the docs tools.
"""

from __future__ import annotations

# (key, unit, meaning), grouped as the reference page shows them.
GROUPS: dict[str, list[tuple[str, str, str]]] = {
    "Every training step": [
        ("step", "count", "optimizer step just finished (1-based)"),
        ("loss", "objective", "the window's objective, normalised over its loss tokens on every rank"),
        ("grad_norm", "L2 norm", "global gradient norm before clipping (optimizer.clip_grad)"),
        ("lr", "learning rate", "learning rate this step used"),
        ("tokens", "tokens", "real (unpadded) tokens the step trained on, all ranks"),
        ("loss_tokens", "tokens", "tokens the loss counts (loss_mask 1): the window's denominator, all ranks"),
        ("padded_tokens", "tokens", "tokens the step computed, padding included, all ranks"),
        ("padding_efficiency", "fraction", "tokens / padded_tokens over all ranks (1.0 = no padding)"),
        ("padding_efficiency_min_rank", "fraction", "the worst rank's padding efficiency"),
        ("padding_efficiency_this_rank", "fraction", "rank 0's padding efficiency"),
        ("num_microbatches", "count", "microbatches each rank ran (equal on every rank)"),
        (
            "pipeline_bubble",
            "fraction",
            "pipeline parallelism: each stage's time waiting for its neighbours over its step, mean of the stages",
        ),
        ("pipeline_bubble_max", "fraction", "pipeline parallelism: the idlest stage's waiting fraction"),
        (
            "pipeline_bubble_modelled",
            "fraction",
            "pipeline parallelism: the bubble 1F1B predicts from the microbatch costs, in the order they ran",
        ),
        (
            "pipeline_bubble_modelled_plan_order",
            "fraction",
            "pipeline parallelism: the bubble 1F1B predicts in the plan's order (parallel.pipeline_order)",
        ),
        ("blend_samples", "count by source", "data.blend only: the window's samples from each source, by its path"),
        ("num_sequences", "count", "sequences in the window, all ranks"),
        ("empty_microbatches", "count", "microbatch slots a rank ran empty to stay aligned with the others"),
        ("oversize_singletons", "count", "sequences over the budget on their own, run alone (never dropped)"),
        ("over_budget_microbatches", "count", "microbatches over the budget (only oversize singletons can be)"),
        ("distinct_shapes", "count", "distinct padded lengths over the window's microbatches"),
        ("rank_imbalance", "ratio", "slowest rank's modelled time over the mean rank's"),
        ("modelled_step_time", "token-equivalents", "the planner's modelled step time (cost + attention + overhead)"),
        ("kind", "name", "the planner: dynamic (train.dynamic_batch_enable) or fixed (train.micro_batch_size)"),
        ("layout", "name", "padded or packed (train.dynamic_batch_layout)"),
        ("plan_fingerprint", "hash", "the plan's fingerprint, equal on every rank (checked each step)"),
        ("step_time_s", "seconds", "wall time of the step on rank 0"),
        ("tokens_per_s", "tokens / second", "tokens / step_time_s"),
        ("data_time_s", "seconds", "time the step spent preparing its window (reading, planning, collating)"),
        ("data_wait_s", "seconds", "time the step waited on the background prefetch (data.prefetch)"),
        (
            "peak_memory_bytes",
            "bytes",
            "the step's peak: CUDA allocator on GPU, live tensors on CPU (where train.memory_meter measures)",
        ),
        (
            "predicted_peak_bytes",
            "bytes",
            "train.max_tokens_per_gpu=auto: the probe's fit for the step's largest microbatch",
        ),
        (
            "peak_over_prediction_max_rank",
            "ratio",
            "auto budget: the worst rank's measured / predicted peak (> 1.05 lowers the budget)",
        ),
        (
            "nonfinite_steps",
            "count",
            "steps skipped so far for a non-finite loss or gradient norm (train.nonfinite=skip)",
        ),
        (
            "oversampling_factor",
            "ratio",
            "times each sample appears per window: global_batch_size / samples when the data set is smaller, else 1",
        ),
    ],
    "Over-long samples (data.overlong)": [
        ("overlong_policy", "name", "data.overlong: error, truncate or drop"),
        ("overlong_truncated", "count", "samples cut to data.max_seq_length so far"),
        ("overlong_truncated_tokens", "tokens", "tokens cut off those samples so far"),
        ("overlong_dropped", "count", "samples skipped for their length so far"),
    ],
    "Evaluation rows (event: eval)": [
        ("event", "name", "eval on an evaluation row (written after the row of the step it evaluated)"),
        ("valid_loss", "nats / token", "cross-entropy on the validation samples"),
        ("valid_tokens", "tokens", "loss tokens the validation loss was averaged over"),
        ("valid_time_s", "seconds", "time the evaluation took"),
    ],
    "The policy loss (loss.type=policy)": [
        ("pg_loss", "objective", "the clipped policy-gradient term"),
        ("kl", "nats / token", "KL to the reference policy (loss.kl_estimator), when loss.kl_coef > 0"),
        ("entropy", "nats / token", "full-vocabulary entropy of the policy at the loss tokens"),
        ("clipfrac", "fraction", "loss tokens whose clipped term is the larger (no gradient through them)"),
        ("clipfrac_lower", "fraction", "loss tokens held by the dual clip (loss.dual_clip)"),
        ("approx_kl", "nats / token", "mean of old - lp over the loss tokens"),
        ("ratio_min", "ratio", "smallest importance ratio exp(lp - old) over the window"),
        ("ratio_max", "ratio", "largest importance ratio over the window"),
        ("logprob_time_s", "seconds", "forward-only passes for recomputed old and reference log-probabilities"),
        ("token_mult_prob_error", "ratio", "mean exp(|lp - rollout|) over tokens with rollout_logprobs (1 = equal)"),
        ("rollout_logprob_abs_diff", "nats", "mean |lp - rollout| over tokens with rollout_logprobs"),
        ("rollout_logprob_abs_diff_max", "nats", "largest |lp - rollout|"),
        ("rollout_kl", "nats / token", "k3 KL of the trainer against the sampler"),
        ("rollout_correction_share", "fraction", "tokens loss.rollout_correction clamped or masked"),
    ],
    "PPO's critic (loss.type=value; rl.advantage=gae)": [
        ("vf_loss", "objective", "the clipped value loss"),
        ("vf_clipfrac", "fraction", "loss tokens whose clipped value term is the larger"),
        ("value_mean", "value", "mean predicted value over the loss tokens"),
        ("return_mean", "value", "mean GAE return over the loss tokens"),
        ("explained_variance", "fraction", "1 - Var(return - value) / Var(return)"),
        ("values_s", "seconds", "the critic's forward-only pass for the rollouts' values"),
        ("advantage_std", "advantage", "standard deviation of the step's GAE advantages"),
        ("critic_s", "seconds", "the critic's optimizer steps of the loop step"),
    ],
    "The RL loop (python -m backend.rl)": [
        (
            "loop_step_s",
            "seconds",
            "wall time of the loop step, from the previous step row to this one (sync, generation, scoring, training)",
        ),
        ("reward_mean", "reward", "mean reward of the step's responses"),
        ("reward_std", "reward", "standard deviation of the rewards"),
        ("reward_min", "reward", "smallest reward"),
        ("reward_max", "reward", "largest reward"),
        ("response_length_mean", "tokens", "mean response length"),
        ("response_length_min", "tokens", "shortest response"),
        ("response_length_max", "tokens", "longest response"),
        ("response_stopped_share", "fraction", "responses that ended at a stop id (the rest hit rl.max_new_tokens)"),
        ("zero_variance_groups", "fraction", "prompt groups whose responses all got the same reward (no GRPO signal)"),
        ("generated_tokens", "tokens", "response tokens generated this step"),
        ("generate_s", "seconds", "generation time"),
        ("generate_tokens_per_s", "tokens / second", "generated_tokens / generate_s"),
        ("reward_s", "seconds", "scoring this rank's responses with rl.reward"),
        ("logprobs_s", "seconds", "the trainer's forward-only log-probabilities of the rollouts (loss.old_logprobs)"),
        ("weight_sync_s", "seconds", "streaming the trained weights into the generator"),
        ("weight_sync_bytes", "bytes", "bytes streamed into the generator"),
        (
            "sync_probe_max_abs_diff",
            "nats",
            "after a sync: largest |generator - trainer| log-probability of a probe sequence",
        ),
    ],
    "Asynchronous RL (rl.max_staleness >= 1)": [
        ("staleness_max", "versions", "most optimizer steps the trained rows' sampling weights lag the policy"),
        ("staleness_mean", "versions", "mean lag of the trained rows' sampling weights (<= rl.max_staleness)"),
        ("trainer_idle_s", "seconds", "time the trainer waited for the generator process since the last step row"),
        ("generator_idle_s", "seconds", "time the generator process waited for this step's request"),
    ],
    "Mixture of experts": [
        ("moe_aux_loss", "ratio", "per-sample load-balancing loss, averaged over samples and layers (1.0 = balanced)"),
        ("moe_tokens_per_expert_max_over_mean", "ratio", "the worst layer's busiest expert over the mean"),
        ("moe_ep_tokens_max_over_mean", "ratio", "expert parallelism: the busiest rank's expert rows over the mean"),
    ],
}

METRICS: dict[str, tuple[str, str]] = {key: (unit, meaning) for rows in GROUPS.values() for key, unit, meaning in rows}


def undocumented(rows) -> set[str]:
    """The keys of ``rows`` (metrics.jsonl objects) that ``METRICS`` does not describe."""
    return {key for row in rows for key in row} - set(METRICS)
