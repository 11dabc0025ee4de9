"""Process groups: torch.distributed (gloo on CPU, NCCL on GPU) and megatron-core parallel_state.

The layout (which rank holds what) and the groups by purpose are ``ParallelDims``'s
(``parallel_dims.py``); this module joins the world, initialises megatron-core's parallel state with
the same sizes (its layers read their groups from it) and hands every caller a ``ParallelEnv``:
this rank's coordinates plus ``dims`` for the groups. megatron-core's own expert parallel size
stays 1: its allgather dispatcher sees every expert and our experts module does the exchange
(``model.expert_parallel``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from backend.megatron_compat import import_megatron_module

from .collectives import all_gather_objects
from .parallel_dims import ParallelDims
from .teardown import end_process_groups

log = logging.getLogger(__name__)


@dataclass
class ParallelEnv:
    """This rank's place in the world and the world's ``ParallelDims`` (sizes, groups, meshes)."""

    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    device: torch.device
    dims: ParallelDims

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.dims.ep

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.dims.tp

    @property
    def sp_size(self) -> int:
        """The sequence-parallel split of a row (tp with sequence parallelism, else 1)."""
        return self.dims.sp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0: the embedding's; pp - 1: the output layer's)."""
        return self.dims.coords(self.rank)["pp"]

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of ``stage`` in this rank's pipeline (same dp, cp and tp coordinates)."""
        return self.rank + (stage - self.pp_rank) * (self.world_size // self.dims.pp)

    @property
    def cp_group(self):
        """The context-parallel group (None at cp 1)."""
        return self.dims.group("cp")

    @property
    def ep_group(self):
        """The expert-parallel group (None at ep 1)."""
        return self.dims.group("ep")

    @property
    def expert_mesh(self):
        """The (expert_dp, ep) mesh (None at ep 1)."""
        return self.dims.mesh("expert") if self.dims.ep > 1 else None

    def group(self, purpose: str):
        """``dims.group(purpose)``: "world", "loss", "batch", "cp", "ep", "tp"."""
        return self.dims.group(purpose)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now ("": every interface, for peers on other machines)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(
    cp_size: int,
    backend: str = "auto",
    timeout_s: float = 600.0,
    *,
    ep_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = True,
    pp_size: int = 1,
    pipeline_layers=(),
) -> ParallelEnv:
    """Join (or, run without torchrun, form a one-process) world and build the parallel groups."""
    if "RANK" not in os.environ:  # a plain `python -m backend.train`: a world of one on loopback
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        _warn_unrestartable()
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    dims = ParallelDims(
        world_size=dist.get_world_size(),
        cp=cp_size,
        ep=ep_size,
        tp=tp_size,
        pp=pp_size,
        sequence_parallel=sequence_parallel,
        pipeline_layers=tuple(pipeline_layers),
    ).validate()
    ps = import_megatron_module("megatron.core.parallel_state")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            context_parallel_size=dims.cp,
            expert_tensor_parallel_size=1,  # experts are never split over TP (moe_compat)
        )
    rank = dist.get_rank()
    where = dims.coords(rank)
    theirs = (ps.get_data_parallel_rank(), ps.get_context_parallel_rank(), ps.get_tensor_model_parallel_rank())
    if (where["dp"], where["cp"], where["tp"]) != theirs:
        raise RuntimeError(
            f"unexpected rank layout: rank {rank} is (dp, cp, tp) {theirs} in megatron-core's groups but {where} "
            "in ParallelDims"
        )
    dims.build(
        device.type,
        cp_group=ps.get_context_parallel_group(),
        batch_group=ps.get_data_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group() if dims.pp > 1 else None,
        embedding_group=ps.get_embedding_group(check_initialized=False) if dims.pp > 1 else None,  # middle stages: none
    )
    return ParallelEnv(
        rank=rank,
        world_size=dims.world_size,
        local_rank=local_rank,
        dp_rank=where["dp"],
        dp_size=dims.dp,
        cp_rank=where["cp"],
        cp_size=dims.cp,
        device=device,
        dims=dims,
    )


def _warn_unrestartable() -> None:
    """torchrun with restarts allowed and its rendezvous store shared with the workers: a restarted
    group would read the previous attempt's addresses (``torchrun.py``); say how to avoid it."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("RANK") == "0":
        log.warning(
            "torchrun --max-restarts > 0 with its rendezvous store shared: a restarted group can fail to connect "
            "(stale addresses of the previous attempt); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
            "torchrun's environment (python -m backend.distributed.torchrun sets it)"
        )


def init_from_config(cfg) -> ParallelEnv:
    """``init_distributed`` with the config's parallel sizes and backend."""
    p = cfg.parallel
    return init_distributed(
        p.context_parallel_size,
        p.backend,
        ep_size=p.expert_parallel_size,
        tp_size=p.tensor_parallel_size,
        sequence_parallel=p.sequence_parallel,
        pp_size=p.pipeline_parallel_size,
        pipeline_layers=p.pipeline_layers,
    )


def shutdown_distributed(env: ParallelEnv | None = None, *, agree: bool | None = None) -> None:
    """Leave the world in order (``teardown.end_process_groups``: every rank agrees it is done,
    megatron-core's groups, the sub-groups, then the default group). ``env``: the world's
    ``ParallelEnv``, whose group table is emptied first so that its groups can be freed now.
    ``agree``: barrier first (default: when no exception is in flight)."""
    if agree is None:
        agree = sys.exc_info()[0] is None
    if env is not None:
        env.dims.release()
    end_process_groups(agree=agree)


def describe_world(env: ParallelEnv) -> list[dict]:
    """Every rank's place (host, Slurm node, local rank), gathered on all ranks."""
    mine = {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "dp_rank": env.dp_rank,
        "cp_rank": env.cp_rank,
        "tp_rank": env.tp_rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_node_id": os.environ.get("SLURM_NODEID"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    return all_gather_objects(mine, group=env.group("world"))


def check_world_matches_allocation(world: list[dict]) -> None:
    """Under Slurm, every node of the launch (the job step's nodes: a job's generator nodes run
    vLLM servers in a step of their own) must be in this one world.

    A launch that starts an independent torchrun per node forms several one-node worlds that
    each train alone, silently; this turns that into an error naming both counts.
    """
    expected = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_JOB_NUM_NODES")
    if expected is None or "SLURM_JOB_ID" not in os.environ:
        return
    nodes = {w["slurm_node_id"] for w in world}
    if len(nodes) != int(expected):
        raise RuntimeError(
            f"this world has {len(world)} ranks on {len(nodes)} Slurm node(s), but the launch has {expected}: "
            f"every node must join one rendezvous (launch with tools/slurm/train.sbatch)"
        )


def tp_groups_across_nodes(world: list[dict], tp: int) -> list[list[int]]:
    """The TP groups (ranks) whose members sit on more than one node (Slurm node, else host): every
    layer's forward and backward then crosses the network several times, where TP groups inside a
    node use its fast links. Ranks are launched node by node, so tp must divide the ranks per node."""
    spread = []
    for start in range(0, len(world), tp):
        group = world[start : start + tp]
        if len({(w["slurm_node_id"], w["hostname"]) for w in group}) > 1:
            spread.append([w["rank"] for w in group])
    return spread
