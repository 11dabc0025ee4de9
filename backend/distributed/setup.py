"""Process groups: torch.distributed (gloo on CPU, NCCL on GPU) and megatron-core parallel_state.

Ranks are laid out as megatron-core does with tensor and pipeline parallel size 1: the context-
parallel rank varies fastest, so rank = dp_rank * cp + cp_rank. Gradients are reduced over the
whole data x context parallel group (CP ranks hold different tokens of the same sequences).

Expert parallelism (EP) cuts the same world another way: EP groups are blocks of ``ep``
consecutive ranks (ep_rank = rank % ep; at cp 2 and ep 2 an EP group is a CP pair, at dp 2 x cp 2
and ep 4 the whole world). ``expert_mesh`` is the 2-D mesh (expert_dp, ep) = (world / ep, ep):
its "ep" dimension places the experts, its "expert_dp" dimension holds the ranks that own the same
experts, over which FSDP2 shards (and reduce-scatters) those experts' weights, as torchtitan's
``dp_shard_mod_ep``. megatron-core's own expert parallel size stays 1: its allgather dispatcher
sees every expert and our experts module does the exchange (``model.expert_parallel``).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from backend.megatron_compat import import_megatron_module

from .collectives import all_gather_objects

log = logging.getLogger(__name__)


@dataclass
class ParallelEnv:
    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    device: torch.device
    cp_group: object  # None when cp_size == 1
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: object = None  # None when ep_size == 1
    expert_mesh: object = None  # DeviceMesh (expert_dp, ep) when ep_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cp_size: int, backend: str = "auto", timeout_s: float = 600.0, *, ep_size: int = 1) -> ParallelEnv:
    """Join (or, run without torchrun, form a one-process) world and build the parallel groups."""
    if "RANK" not in os.environ:  # a plain `python -m backend.train`: a world of one on loopback
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % cp_size:
        raise ValueError(f"parallel.context_parallel_size={cp_size} must divide the world size {world}")
    ps = import_megatron_module("megatron.core.parallel_state")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp_size
        )
    env = ParallelEnv(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        device=device,
        cp_group=ps.get_context_parallel_group() if cp_size > 1 else None,
    )
    if env.dp_rank * env.cp_size + env.cp_rank != env.rank:
        raise RuntimeError(f"unexpected rank layout: rank {env.rank} is dp {env.dp_rank}, cp {env.cp_rank}")
    if ep_size > 1:
        if world % ep_size:
            raise ValueError(f"parallel.expert_parallel_size={ep_size} must divide the world size {world}")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("expert_dp", "ep"))
        env.ep_size, env.ep_rank = ep_size, env.rank % ep_size
        env.ep_group, env.expert_mesh = mesh.get_group("ep"), mesh
    return env


def init_from_config(cfg) -> ParallelEnv:
    """``init_distributed`` with the config's parallel sizes and backend."""
    p = cfg.parallel
    return init_distributed(p.context_parallel_size, p.backend, ep_size=p.expert_parallel_size)


def shutdown_distributed() -> None:
    ps = import_megatron_module("megatron.core.parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def describe_world(env: ParallelEnv) -> list[dict]:
    """Every rank's place (host, Slurm node, local rank), gathered on all ranks."""
    mine = {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "dp_rank": env.dp_rank,
        "cp_rank": env.cp_rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_node_id": os.environ.get("SLURM_NODEID"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    return all_gather_objects(mine)


def check_world_matches_allocation(world: list[dict]) -> None:
    """Under Slurm, every node of the allocation must be in this one world.

    A launch that starts an independent torchrun per node forms several one-node worlds that
    each train alone, silently; this turns that into an error naming both counts.
    """
    expected = os.environ.get("SLURM_JOB_NUM_NODES")
    if expected is None or "SLURM_JOB_ID" not in os.environ:
        return
    nodes = {w["slurm_node_id"] for w in world}
    if len(nodes) != int(expected):
        raise RuntimeError(
            f"this world has {len(world)} ranks on {len(nodes)} Slurm node(s), but the allocation has {expected}: "
            f"every node must join one rendezvous (launch with tools/slurm/train.sbatch)"
        )
