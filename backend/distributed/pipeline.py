"""Pipeline parallelism: a step's microbatches through the stages, 1F1B, every shape from the plan.

Schedule (``one_f_one_b``, pure): stage s of p runs min(p - 1 - s, M) forwards first (warm-up),
then alternates one forward and one backward (steady state), then the remaining backwards
(cool-down), as megatron-core's non-interleaved schedule and PipeDream-Flush: stage s holds at most
p - s microbatches' activations at once, and a step with fewer microbatches than stages still runs
(its bubble is larger, and reported).

Shapes: every rank of a pipeline holds the same plan and the same microbatch tensors (the data
iterator runs on every stage), so the activation crossing from stage s to s + 1 for microbatch j
is [s_local / sp, rows, hidden] of that microbatch's tokens (after the CP cut and the sequence-
parallel split), in the compute dtype: the receiver allocates it from the plan, nothing about
shapes goes on the wire (megatron-core's ``variable_seq_lengths`` sends a shape tensor before every
transfer). ``check_shapes`` compares every stage's list of microbatch shapes once a step (one small
all-gather over the pipeline group): a plan that differs between the stages is an error naming the
stage and the microbatch, never a hang in a receive of the wrong size.

Transport: point-to-point on the pipeline group, sends non-blocking (``isend``, each waited as
soon as its receiver must have it: ``_finish``), receives blocking; every pair of neighbouring stages matches its sends and receives
in schedule order, so no send waits for its receive and 1F1B cannot deadlock (gloo runs isend /
irecv; NCCL too).

Loss: only the last stage computes the objective (the window's normaliser comes from the plan on
every rank, so nothing is broadcast before the step); its window metrics are sent to the other
stages afterwards (``broadcast_metrics``), so every rank logs the same row.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from backend.distributed.fsdp import set_grad_sync
from backend.errors import UserError


class PipelineShapeError(UserError):
    """The stages of one pipeline disagree about a step's microbatches (their plans differ)."""


def one_f_one_b(num_microbatches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s order of forwards ("F", j) and backwards ("B", j) under 1F1B."""
    m = num_microbatches
    warmup = min(stages - 1 - stage, m)
    order = [("F", j) for j in range(warmup)]
    forward, backward = warmup, 0
    while forward < m:
        order.append(("F", forward))
        forward += 1
        order.append(("B", backward))
        backward += 1
    order += [("B", j) for j in range(backward, m)]
    return order


def in_flight(num_microbatches: int, stages: int, stage: int) -> int:
    """The most microbatches whose activations stage ``stage`` holds at once: min(p - s, M)."""
    peak = held = 0
    for op, _ in one_f_one_b(num_microbatches, stages, stage):
        held += 1 if op == "F" else -1
        peak = max(peak, held)
    return peak


def modelled_bubble(costs: list[float], stages: int) -> float:
    """The idle fraction of a 1F1B step with microbatch costs ``costs`` (forward + backward, the
    same on every stage), from a simulation of the schedule: each stage's busy time over the
    step's makespan, averaged over the stages, subtracted from 1. Equal costs give the textbook
    (p - 1) / (M + p - 1)."""
    m = len(costs)
    if not m or stages == 1:
        return 0.0
    fwd = [c / 3 for c in costs]  # a backward costs about twice a forward
    bwd = [2 * c / 3 for c in costs]
    done: dict[tuple[str, int, int], float] = {}
    orders = [one_f_one_b(m, stages, s) for s in range(stages)]
    clock = [0.0] * stages
    pos = [0] * stages
    while any(pos[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            op, j = orders[s][pos[s]]
            if op == "F":
                ready = 0.0 if s == 0 else done.get(("F", j, s - 1))
                length = fwd[j]
            else:
                ready = 0.0 if s == stages - 1 else done.get(("B", j, s + 1))
                ready = max(ready, done[("F", j, s)]) if ready is not None else None
                length = bwd[j]
            if ready is None:
                continue
            clock[s] = max(clock[s], ready) + length
            done[(op, j, s)] = clock[s]
            pos[s] += 1
            progressed = True
        if not progressed:  # cannot happen for a valid 1F1B order
            raise RuntimeError("1F1B simulation stalled")
    makespan = max(clock)
    busy = sum(costs)
    return 1.0 - busy / makespan if makespan else 0.0


def pipeline_order(costs: list[float], stages: int, rule: str = "bubble") -> list[int]:
    """The order a stage runs a step's microbatches (indices into ``costs``), the same on every
    stage of a pipeline (they hold the same plan). ``"bubble"``: the smallest microbatch first
    (the later stages wait for its forward to reach them) and the second smallest last (the
    earlier stages wait for its backward to come back), the rest in the plan's order, if
    ``modelled_bubble`` says that is shorter than the plan's order, else the plan's: never worse
    than the plan in the model. Measured over 100 plans of the dynamic planner (64-256 lognormal
    lengths, 4,096 tokens a GPU, about 16 microbatches): mean modelled bubble 0.065 -> 0.056 at
    pp 2, 0.163 -> 0.151 at pp 4, 0.320 -> 0.313 at pp 8 (padded). ``"plan"``: the plan's."""
    plan = list(range(len(costs)))
    if rule == "plan" or stages == 1 or len(costs) < 3:
        return plan
    smallest, second = sorted(plan, key=lambda j: (costs[j], j))[:2]
    ends = [smallest, *(j for j in plan if j not in (smallest, second)), second]
    ordered = modelled_bubble([costs[j] for j in ends], stages)
    return ends if ordered < modelled_bubble(costs, stages) else plan


def stage_shape(mb, env, hidden: int) -> tuple[int, int, int]:
    """The activation between stages for microbatch ``mb``: [s_local / sp, rows, hidden]."""
    rows, length = mb.tokens.shape
    return (length // env.sp_size, rows, hidden)


def check_shapes(shapes: list[tuple[int, int, int]], env, step: int) -> None:
    """Every stage of this pipeline plans the same microbatches (module docstring)."""
    group = env.group("pp")
    theirs: list = [None] * env.pp_size
    dist.all_gather_object(theirs, shapes, group=group)
    for stage, other in enumerate(theirs):
        if other == shapes:
            continue
        if len(other) != len(shapes):
            raise PipelineShapeError(
                f"step {step}: pipeline stage {stage} plans {len(other)} microbatches, stage {env.pp_rank} "
                f"{len(shapes)}: the stages of one pipeline must hold the same plan"
            )
        j = next(i for i, (a, b) in enumerate(zip(other, shapes)) if a != b)
        raise PipelineShapeError(
            f"step {step}: pipeline stage {stage} plans microbatch {j} as {other[j]} (tokens, rows, hidden), stage "
            f"{env.pp_rank} as {shapes[j]}: the stages of one pipeline must hold the same plan"
        )


def run_pipeline(model, microbatches, env, *, hidden: int, dtype, last_forward, stage_forward, step: int = 0) -> dict:
    """One window's forwards and backwards through this rank's stage (1F1B): ``last_forward(j,
    mb)`` on the last stage returns the microbatch's scalar objective share, ``stage_forward(mb)``
    on the others (output hidden states, a scalar added to the objective or None): the stage's
    own share of the objective is backpropagated with its output's gradient (a MoE stage's router
    auxiliary loss). Gradient sync on the last microbatch's backward only.
    Returns this stage's idle seconds waiting for its neighbours and its busy seconds."""
    stages, stage = env.pp_size, env.pp_rank
    group = env.group("pp")
    prev = env.stage_rank(stage - 1) if stage > 0 else None
    nxt = env.stage_rank(stage + 1) if stage < stages - 1 else None
    shapes = [stage_shape(mb, env, hidden) for mb in microbatches]
    check_shapes(shapes, env, step)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    sent: dict[tuple[str, int], object] = {}  # isend works by (op, microbatch): each holds its tensor
    extras: dict[int, torch.Tensor] = {}  # a stage's own objective share by microbatch (MoE aux loss)
    waited = 0.0
    start = time.perf_counter()
    count = len(microbatches)
    for op, j in one_f_one_b(count, stages, stage):
        mb = microbatches[j]
        if op == "F":
            if prev is not None:
                t0 = time.perf_counter()
                x = receive_input(model, shapes[j], dtype, env, tag=0)
                waited += time.perf_counter() - t0
                x.requires_grad_(True)
                inputs[j] = x
            if nxt is None:
                outputs[j] = last_forward(j, mb)
            else:
                out, extra = stage_forward(mb)
                if extra is not None:
                    extras[j] = extra
                if tuple(out.shape) != shapes[j]:
                    raise PipelineShapeError(
                        f"step {step}: stage {stage} produced {tuple(out.shape)} for microbatch {j}, the plan says "
                        f"{shapes[j]}"
                    )
                sent["F", j] = dist.isend(out.detach().to(dtype).contiguous(), dst=nxt, group=group, tag=0)
                outputs[j] = out
        else:
            _finish(sent, ("B", j - 1))  # the previous gradient sent: at most one held (see _finish)
            set_grad_sync(model, j == count - 1, pipelined=True)
            out = outputs.pop(j)
            if nxt is None:
                out.backward()
            else:
                grad = torch.empty(shapes[j], dtype=out.dtype, device=env.device)
                t0 = time.perf_counter()
                dist.recv(grad, src=nxt, group=group, tag=1)
                waited += time.perf_counter() - t0
                _finish(sent, ("F", j))  # the next stage answered j: its activation arrived long ago
                extra = extras.pop(j, None)
                if extra is None:
                    torch.autograd.backward(out, grad)
                else:
                    torch.autograd.backward([out, extra], [grad, torch.ones_like(extra)])
            x = inputs.pop(j, None)
            if x is not None:
                sent["B", j] = dist.isend(x.grad.to(dtype).contiguous(), dst=prev, group=group, tag=1)
    for key in list(sent):
        _finish(sent, key)
    total = time.perf_counter() - start
    return {"idle_s": waited, "step_s": total}


def _finish(sent: dict, key) -> None:
    """Wait for one send and drop it. A send's work holds its tensor until waited, so a step that
    waited only at its end held every microbatch's activation and input gradient at once: M
    tensors where 1F1B needs p - s. Activation j is done once its gradient came back; the input
    gradient of j once the backward of j + 1 begins (the previous stage receives it in its own
    backward of j, which comes before anything it needs from this stage next), so at most p - s
    activations and one gradient are in flight, and no wait can block a neighbour that waits on
    this stage."""
    work = sent.pop(key, None)
    if work is not None:
        work.wait()


def receive_input(model, shape, dtype, env, *, tag: int) -> torch.Tensor:
    """The previous stage's activation for this stage's next microbatch, of the planned ``shape``,
    set as the model's input (megatron-core's ``set_input_tensor``)."""
    x = torch.empty(shape, dtype=dtype, device=env.device)
    dist.recv(x, src=env.stage_rank(env.pp_rank - 1), group=env.group("pp"), tag=tag)
    model.set_input_tensor(x)
    return x


def broadcast_metrics(metrics: dict, env) -> dict:
    """The last stage's window metrics on every stage of the pipeline."""
    box = [metrics if env.last_stage else None]
    dist.broadcast_object_list(box, src=env.stage_rank(env.pp_size - 1), group=env.group("pp"))
    return box[0]


def sum_tied_grads(model, env) -> None:
    """Tied embeddings: the first stage's embedding gradient and the last stage's output-layer
    gradient (the same weight in the whole model) summed over the two, so both apply the same
    update (megatron-core's embedding-group all-reduce). Local FSDP2 shards: both stages shard the
    same [vocab, hidden] tensor over equal meshes, so shard i is the same rows on both."""
    names = getattr(model, "stage_names", None)
    if names is None or not names.tied or not (names.pre or names.post):
        return
    target = "embedding.word_embeddings.weight" if names.pre else names.tied_copy
    param = dict(model.named_parameters())[target]
    if param.grad is None:
        return
    local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
    dist.all_reduce(local, group=env.group("embedding"))


def pipeline_metrics(model, data, env) -> dict:
    """The step row's pipeline numbers: ``pipeline_bubble`` (the mean over stages of each stage's
    time waiting for its neighbours over its step), the worst stage's, and the bubble 1F1B predicts
    from the plan's microbatch costs in the order they ran (``modelled_bubble``, data-parallel
    rank 0's microbatches), and in the plan's order (``pipeline_bubble_modelled_plan_order``)."""
    from backend.distributed.collectives import all_gather_objects

    times = getattr(model, "pipeline_times", None) or {"idle_s": 0.0, "step_s": 0.0}
    every = all_gather_objects((env.pp_rank, times["idle_s"], times["step_s"]), group=env.group("world"))
    fractions = [idle / step if step else 0.0 for _, idle, step in every]
    costs = [max(1, mb.cost) for mb in data.plan.ranks[0]]
    ran = pipeline_order(costs, env.pp_size, model.pipeline_order_rule)
    return {
        "pipeline_bubble": sum(fractions) / len(fractions),
        "pipeline_bubble_max": max(fractions),
        "pipeline_bubble_modelled": modelled_bubble([costs[j] for j in ran], env.pp_size),
        "pipeline_bubble_modelled_plan_order": modelled_bubble(costs, env.pp_size),
    }


def stage_forward(model, batch, env, evaluate, hidden):
    """One forward-only microbatch through the pipeline (``forward_only``): ``evaluate(batch)`` on
    the last stage (returned), ``hidden(batch)`` (the stage's layers) elsewhere with its output
    sent on (None returned). Without pipelining, ``evaluate(batch)``. Every stage runs the
    microbatches in the same order, so each receive meets its send."""
    if env.pp_size == 1:
        return evaluate(batch)
    group = env.group("pp")
    shape = stage_shape(batch, env, model.config.hidden_size)
    if not env.first_stage:
        receive_input(model, shape, model.activation_dtype, env, tag=2)
    if env.last_stage:
        return evaluate(batch)
    out = hidden(batch)
    dist.send(out.to(model.activation_dtype).contiguous(), dst=env.stage_rank(env.pp_rank + 1), group=group, tag=2)
    return None
