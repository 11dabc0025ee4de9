"""Router statistics and the load-balancing (aux) loss of MoE models, independent of how a window is cut.

megatron-core's ``aux_loss`` is computed per *microbatch* from that microbatch's token counts:
it is not linear in the tokens, so a window cut into one-sample microbatches (fixed micro-batch
size 1) and the same window packed into a few dynamic microbatches would get different aux
gradients. We turn megatron-core's load balancing off (``moe_router_load_balancing_type="none"``)
and compute the loss ourselves, **per sequence**: for each sample s with T_s valid tokens,

    L_s = E * sum_e f_{s,e} * P_{s,e},   f_{s,e} = (tokens of s routed to e) / (T_s * k),
                                          P_{s,e} = (sum over tokens of s of softmax(logits)_e) / T_s

(the switch-transformer loss of one sequence; ``f`` is a constant, the gradient flows through
``P``), and the window's aux loss is ``coeff * mean over the window's samples and ... summed over
layers`` = ``coeff / N_window * sum_s sum_layers L_s``. A sample always lies in one microbatch
(under context parallelism its counts are all-reduced over the CP group, and each CP rank
contributes its own tokens' share of ``P``), so every plan adds exactly the same terms: fixed and
dynamic gradients agree up to summation order. Padding (``valid`` False) and the zero-weight
placeholder microbatch never enter counts or probabilities, so right padding changes nothing.
A sample is a *group* of tokens: a row in the padded layout, a segment of the one row in the
packed layout (``segment_ids``), so padded, packed and fixed plans add the same terms.

How: ``install(model, coeff)`` wraps each ``TopKRouter.routing`` (per instance): the logits and
the router's top-k choice of every routed microbatch are seen once, and padding tokens are then
routed to no expert (a padded dynamic microbatch's padding costs no expert GEMM);
``routing_context`` (``forward.token_losses``) tells the wrapper which tokens are real. ``forward_backward`` adds ``take_microbatch_aux(model) / N_window``
to each microbatch's loss and calls ``window_metrics`` at the end of the window:

- ``moe_aux_loss``: the window's per-sample switch loss averaged over samples and layers
  (1.0 = perfectly balanced; without the coefficient);
- ``moe_tokens_per_expert_max_over_mean``: max over layers of max_e / mean_e of the routed token
  counts of the window (all ranks; 1.0 = balanced);
- ``moe_ep_tokens_max_over_mean`` (expert parallelism only): the rows a rank's experts received
  from its EP group in the window, busiest rank over the mean over all ranks, worst layer (the
  slowest rank sets the layer's time; 1.0 = balanced).

Expert capacity is not set (no token is dropped), so there is no dropped-token metric.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from backend.distributed.collectives import all_gather_objects, all_gather_tensors

from .tensor_parallel import tp_layout


@dataclass
class MoEStats:
    routers: list  # TopKRouter modules, layer order
    coeff: float
    topk: int
    num_experts: int
    ep_size: int = 1  # expert parallelism: experts [j E/EP, (j + 1) E/EP) live on EP rank j
    worst_case: bool = False  # the memory probe's routing: every token to EP rank 0's experts
    # (valid [s*b] bool, group [s*b] int64, groups, the groups holding a sample's other tokens: CP, TP)
    current: tuple | None = None
    mb_aux: torch.Tensor | None = None  # sum over this microbatch's samples and layers of coeff * L_s
    counts: torch.Tensor | None = None  # [layers, E] float64 routed tokens of this rank in the window
    aux_sum: torch.Tensor | None = None  # sum over this rank's samples and layers of L_s (its share under CP)
    _index: dict = field(default_factory=dict)

    def reset_window(self) -> None:
        self.counts = None
        self.aux_sum = None
        self.mb_aux = None


def _layer_stats(stats: MoEStats, router, logits: torch.Tensor, routing_map: torch.Tensor) -> None:
    valid, group, groups, token_groups = stats.current
    e = logits.shape[-1]
    with torch.set_grad_enabled(torch.is_grad_enabled() and stats.coeff > 0):
        scores = torch.softmax(logits.float().reshape(-1, e), dim=-1)  # [tokens, E], token order s-major
        routed = routing_map.to(torch.float32)  # the router's own top-k choice (before padding is dropped)
        m = valid[:, None].to(torch.float32)
        per_group = scores.new_zeros(groups, e, dtype=torch.float32)
        local_counts = per_group.index_add(0, group, routed * m)  # [G, E]
        counts = local_counts.clone()
        ntok = scores.new_zeros(groups, dtype=torch.float32).index_add(0, group, m[:, 0])  # [G]
        for other in token_groups:  # the ranks holding the rest of each sample's tokens (CP, TP)
            dist.all_reduce(counts, group=other)
            dist.all_reduce(ntok, group=other)
        psum = per_group.index_add(0, group, scores * m)  # [G, E]: this rank's share of P (differentiable)
        denom = ntok.clamp(min=1.0)[:, None]
        per_seq = e * (counts / (denom * stats.topk) * psum / denom).sum(-1)  # [G]; empty groups give 0
        total = per_seq.sum()
    layer = stats._index[id(router)]
    if stats.counts is None:
        stats.counts = torch.zeros(len(stats.routers), e, dtype=torch.float64, device=logits.device)
        stats.aux_sum = torch.zeros((), dtype=torch.float64, device=logits.device)
    stats.counts[layer] += local_counts.detach().sum(0).double()
    stats.aux_sum += total.detach().double()  # no host sync per layer
    if stats.coeff > 0 and total.requires_grad:
        term = stats.coeff * total
        stats.mb_aux = term if stats.mb_aux is None else stats.mb_aux + term


def _to_first_rank(probs: torch.Tensor, routing_map: torch.Tensor, stats: MoEStats):
    """The memory probe's routing under expert parallelism: every token's k experts are the first
    k (EP rank 0's, as many as it has; the rest on the next ranks), so rank 0 receives
    EP x tokens x min(k, E / EP) rows, the most any routing can send it."""
    chosen = torch.zeros_like(routing_map)
    chosen[:, : stats.topk] = True
    # The router's own k probabilities, moved to those columns: they keep their gradient, so the
    # backward saves what a real step's does (constant probabilities would save less).
    top = probs.topk(stats.topk, dim=-1).values
    return torch.cat([top, probs.new_zeros(probs.shape[0], probs.shape[1] - stats.topk)], dim=-1), chosen


@contextlib.contextmanager
def worst_case_routing(model):
    """Within: every routed token goes to EP rank 0's experts (``_to_first_rank``); a no-op at EP 1,
    where the expert rows are tokens x k whatever the routing."""
    stats = stats_of(model)
    if stats is None or stats.ep_size == 1:
        yield
        return
    stats.worst_case = True
    try:
        yield
    finally:
        stats.worst_case = False


def _routing(router, original, stats: MoEStats, logits: torch.Tensor, padding_mask=None):
    """megatron-core's routing, then padding (and placeholder samples) sent to no expert: the
    dispatcher gathers only routed tokens, so they cost no expert FLOPs and reach no expert's
    gradient. Their MoE output is zero; nothing real reads it (causal attention never looks right
    of a real token, and their losses are masked)."""
    probs, routing_map = original(logits, padding_mask=padding_mask)
    if stats.current is not None:
        if router.training:
            _layer_stats(stats, router, logits, routing_map)
        if stats.worst_case:
            probs, routing_map = _to_first_rank(probs, routing_map, stats)
        keep = stats.current[0][:, None]  # [s*b, 1], megatron-core's token order
        routing_map = routing_map & keep
        probs = probs * keep
    return probs, routing_map


def install(model: torch.nn.Module, coeff: float) -> MoEStats | None:
    """Attach router statistics (and the aux loss when ``coeff`` > 0) to a model with MoE layers."""
    from backend.megatron_compat import import_megatron_module

    router_cls = import_megatron_module("megatron.core.transformer.moe.router").TopKRouter
    routers = [m for m in model.modules() if isinstance(m, router_cls)]
    if not routers:
        return None
    dispatcher = routers[0].config.moe_token_dispatcher_type
    if dispatcher != "allgather":  # the others size their buffers as tokens x top-k: no room for unrouted padding
        raise RuntimeError(
            f"moe_stats routes padding to no expert, which needs megatron-core's allgather token dispatcher "
            f"(got {dispatcher!r})"
        )
    stats = MoEStats(routers, float(coeff), routers[0].topk, routers[0].config.num_moe_experts)
    for i, r in enumerate(routers):
        stats._index[id(r)] = i
        r.routing = functools.partial(_routing, r, type(r).routing.__get__(r), stats)
    model._moe_stats = stats  # read through stats_of (the forward enters routing_context when present)
    return stats


def stats_of(model) -> MoEStats | None:
    return getattr(model, "_moe_stats", None)


@contextlib.contextmanager
def routing_context(
    model, valid: torch.Tensor, *, cp_group=None, rows: torch.Tensor | None = None, groups: torch.Tensor | None = None
):
    """Within: the model's routers count only ``valid`` tokens ([b, s]), per sample.

    A sample is a row (``groups`` None: the padded layout) or, for a packed row, the sequence id
    each token carries (``groups`` [b, s] int64, e.g. ``segment_ids``). ``rows`` ([samples] bool)
    drops whole samples (False: the zero-weight placeholder)."""
    stats = stats_of(model)
    if stats is None:
        yield
        return
    b, s = valid.shape
    if groups is None:
        groups = torch.arange(b, device=valid.device)[:, None].expand(b, s)
    groups = groups.to(valid.device)
    count = int(rows.numel()) if rows is not None else int(groups.max()) + 1 if groups.numel() else 1
    v = valid if rows is None else valid & rows.to(valid.device)[groups]
    token_groups = [g for g in (cp_group,) if g is not None and dist.get_world_size(g) > 1]
    tp = tp_layout(model)
    if tp.size > 1:  # sequence parallelism: the MoE layer sees this rank's 1/tp of the positions
        chunk = s // tp.size
        part = slice(dist.get_rank(tp.group) * chunk, (dist.get_rank(tp.group) + 1) * chunk)
        v, groups = v[:, part], groups[:, part]
        token_groups.append(tp.group)
    # megatron-core routes tokens in [s, b] order: flatten ours the same way.
    stats.current = (v.t().reshape(-1), groups.t().reshape(-1), count, tuple(token_groups))
    try:
        yield
    finally:
        stats.current = None


def take_microbatch_aux(model) -> torch.Tensor | None:
    """coeff * sum of the per-sample switch losses of the last microbatch (to divide by N_window), or None."""
    stats = stats_of(model)
    if stats is None:
        return None
    out, stats.mb_aux = stats.mb_aux, None
    return out


def begin_window(model) -> None:
    stats = stats_of(model)
    if stats is not None:
        stats.reset_window()


def window_metrics(model, num_samples: int, env) -> dict:
    """The window's router metrics over all ranks (collective: every rank calls it); {} for dense models.
    Token counts sum over ``env.group("loss")`` (each token once, then over TP, whose ranks route
    their own slices); the EP balance gathers every rank's own counts over ``"stage"`` (EP groups
    are blocks of its ranks: the world's, or a pipeline stage's, TP ranks included); under pipeline parallelism each stage's layers are then gathered over the
    pipeline, so the auxiliary loss sums every layer once."""
    stats = stats_of(model)
    if stats is None:
        return {}
    layers, e = len(stats.routers), stats.num_experts
    if stats.counts is None:  # nothing routed on this rank (it still joins the collective)
        device = next(iter(stats.routers[0].parameters())).device
        packed = torch.zeros(layers * e + 1, dtype=torch.float64, device=device)
    else:
        packed = torch.cat([stats.counts.flatten(), stats.aux_sum.reshape(1)])
    if dist.is_initialized():
        dist.all_reduce(packed, group=env.group("loss"))
    if tp_layout(model).size > 1:  # under TP each rank routed its own slice of the tokens
        dist.all_reduce(packed, group=tp_layout(model).group)
    counts, aux = packed[:-1].view(layers, e), float(packed[-1])
    imbalance = None
    if stats.ep_size > 1:  # over this stage's ranks (the world without pipelining): EP groups are blocks of them
        imbalance = _ep_imbalance(stats, packed.new_zeros(layers, e), env.group("stage"))
    if getattr(env, "pp_size", 1) > 1:  # every stage's layers, each counted once (stage order = layer order)
        parts = all_gather_objects((counts.cpu(), aux, imbalance), group=env.group("pp"))
        counts = torch.cat([c for c, _, _ in parts])
        aux = sum(a for _, a, _ in parts)
        imbalance = None if imbalance is None else max(i for _, _, i in parts)
        layers = counts.shape[0]
    mean = counts.mean(-1).clamp(min=1e-12)
    out = {
        "moe_aux_loss": aux / max(1, num_samples) / layers,
        "moe_tokens_per_expert_max_over_mean": float((counts.max(-1).values / mean).max()),
    }
    if imbalance is not None:
        out["moe_ep_tokens_max_over_mean"] = imbalance
    return out


def _ep_imbalance(stats: MoEStats, zeros: torch.Tensor, group) -> float:
    """max over layers of (rows the busiest rank's experts received) / (the mean over ranks).

    Rank r of EP group g receives, for its experts, the tokens every rank of g routed to them;
    every rank's own counts are gathered (layers x E numbers a rank) and summed per group, so two
    EP groups whose hot ranks differ are not averaged into balance."""
    mine = stats.counts if stats.counts is not None else zeros
    return ep_imbalance(torch.stack(all_gather_tensors(mine, group=group)), stats.ep_size)


def ep_imbalance(every: torch.Tensor, ep: int) -> float:
    """``every`` [world, layers, E]: each rank's routed tokens per expert (EP groups are blocks of
    ``ep`` consecutive ranks; EP rank j holds experts [j E/EP, (j + 1) E/EP))."""
    world, layers, e = every.shape
    per_group = every.view(world // ep, ep, layers, e).sum(1)  # what each EP group routed
    received = per_group.view(world // ep, layers, ep, e // ep).sum(-1)  # [groups, layers, EP rank]
    received = received.permute(1, 0, 2).reshape(layers, world)  # per layer, one column a rank
    mean = received.mean(-1).clamp(min=1e-12)
    return float((received.max(-1).values / mean).max())
