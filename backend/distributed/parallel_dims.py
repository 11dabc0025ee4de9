"""How the world is split: every parallel dimension's size, validated once, the rank layout, and
the meshes and process groups asked for by what they are for.

Sizes: data parallel (dp, derived: world / (cp x tp x pp)), context parallel (cp), expert
parallel (ep), tensor parallel (tp, with or without sequence parallelism) and pipeline parallel
(pp: the decoder layers cut into stages, ``stage_layers``). The checks (``errors``) are the only ones: config validation calls them with the
launch's world size and the model's expert count, process-group set-up calls ``validate`` with the
real world, so a launch that disagrees with its config fails with the same sentence either way.

Rank layout, fastest-varying last (megatron-core's order): rank = ((pp_rank x dp + dp_rank) x cp
+ cp_rank) x tp + tp_rank. TP ranks are consecutive, so a TP group stays inside a node; CP ranks
next (rank = dp_rank x cp + cp_rank while tp = pp = 1).

How the meshes compose: the world is a (dp x cp, tp) grid, ``"fsdp"`` its first dimension (FSDP2
shards every parameter, TP's local slices included, over the dp x cp ranks holding the same TP
slice) and ``"tp"`` its second (megatron-core's tensor-parallel layers: column / row parallel
linears, the vocabulary-parallel embedding and output layer). With sequence parallelism (``sp``)
each CP rank's local row is cut tp ways between the TP regions, so rows align to 2 x cp x tp.
Expert parallelism with tp > 1 is refused by name (not composed yet). Expert parallelism cuts the same world
another way: EP groups are blocks of ep consecutive ranks (ep_rank = rank % ep), and the 2-D mesh
(expert_dp, ep) = (world / ep, ep) holds in "expert_dp" the ranks that own the same experts (over
which FSDP2 shards them, torchtitan's ``dp_shard_mod_ep``).

Purposes (``group`` / ``mesh``), as torchtitan's ``ParallelDims.get_mesh`` names them:

- ``"world"``: every rank. Agreement checks (plans, rows, stop requests), maxima of times and
  memory, gathers of small objects: things every process must see.
- ``"fsdp"`` (a mesh) / ``"loss"`` (its group): dp x cp, the ranks that hold distinct tokens. FSDP2
  shards and reduce-scatters over them, and every loss and metric sum reduces over them, so a
  token is counted once (TP ranks hold the same tokens and must not add them again).
- ``"batch"``: dp, the ranks that hold distinct samples (what the planner balances over).
- ``"cp"``, ``"ep"``, ``"tp"``, ``"pp"``: one dimension's group; None when that dimension has size 1
  (every helper then communicates nothing). ``"embedding"``: a pipeline's first and last stage
  (their tied embedding copies' gradients are summed over it). With pp > 1 the "fsdp" mesh, the
  "loss" and "batch" groups are those of this rank's stage. ``"stage"``: every rank of this rank's
  pipeline stage (the world at pp 1): EP groups are blocks of its ranks. ``"expert"`` /
  ``"expert_dp"`` / ``"ep"`` meshes with ep > 1.

This module imports no torch at import time: the config's validation uses the sizes and checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GROUPS = ("world", "loss", "batch", "cp", "ep", "tp", "pp", "embedding", "stage")
MESHES = ("fsdp", "expert", "expert_dp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    cp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = True  # with tp > 1: activations outside the TP regions split over tp
    pipeline_layers: tuple[int, ...] = ()  # decoder layers per stage (empty: ``stage_layers``' even split)
    # process groups and device meshes by purpose, filled by ``build`` (absent in pure uses)
    _built: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(cls, parallel, world_size: int) -> ParallelDims:
        """The sizes ``parallel.*`` asks for in a world of ``world_size`` processes (not yet checked)."""
        return cls(
            world_size=world_size,
            cp=parallel.context_parallel_size,
            ep=parallel.expert_parallel_size,
            tp=parallel.tensor_parallel_size,
            pp=parallel.pipeline_parallel_size,
            sequence_parallel=parallel.sequence_parallel,
            pipeline_layers=tuple(parallel.pipeline_layers),
        )

    @property
    def sp(self) -> int:
        """The sequence-parallel split of a row: tp with sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def dp(self) -> int:
        return max(1, self.world_size // (self.cp * self.tp * self.pp))

    @property
    def fsdp_enabled(self) -> bool:
        """Whether FSDP2 has anything to shard over: more than one rank (torchtitan's rule). One
        rank trains the plain module: FSDP2 there only copies every parameter into its gather
        buffer twice a step and every gradient out again, 10% of a 4-layer x 512 model's FP32
        training step on one CPU thread (0.91 -> 0.82 s, ``tools/bench/bench_rl_vs_trl.py``)."""
        return self.world_size > 1

    def errors(self, *, num_moe_experts: int | None = None, model=None) -> list[str]:
        """Every way these sizes do not tile the world (and, given the model's experts per layer,
        do not split them; given ``model``, the ``model.*`` config, do not split its heads, KV
        heads over TP; the FFN is checked by the config's validation, which knows its default size), each naming its key; [] when they do."""
        world, out = self.world_size, []

        def hint(size: int) -> str:
            return f"; launch with torchrun --nproc-per-node {size} (or a multiple of it)" if world == 1 else ""

        if world % self.cp:
            out.append(f"parallel.context_parallel_size={self.cp}: must divide the world size {world}{hint(self.cp)}")
        if self.ep > 1 and num_moe_experts is not None:
            if not num_moe_experts:
                out.append(f"parallel.expert_parallel_size={self.ep}: needs an MoE model (model.num_moe_experts > 0)")
            elif num_moe_experts % self.ep:
                out.append(
                    f"parallel.expert_parallel_size={self.ep}: must divide model.num_moe_experts={num_moe_experts} "
                    "(every rank of an EP group holds as many experts)"
                )
        if world % self.ep:
            out.append(f"parallel.expert_parallel_size={self.ep}: must divide the world size {world}{hint(self.ep)}")
        if world % (self.cp * self.tp) and not world % self.cp:
            out.append(
                f"parallel.tensor_parallel_size={self.tp}: context x tensor parallel size {self.cp * self.tp} must "
                f"divide the world size {world}{hint(self.cp * self.tp)}"
            )
        if world % (self.cp * self.tp * self.pp) and not world % (self.cp * self.tp):
            out.append(
                f"parallel.pipeline_parallel_size={self.pp}: context x tensor x pipeline parallel size "
                f"{self.cp * self.tp * self.pp} must divide the world size {world}{hint(self.cp * self.tp * self.pp)}"
            )
        if self.tp > 1:
            out += self._tp_model_errors(num_moe_experts, model)
        if self.pp > 1 and self.ep > 1 and not world % self.pp and (world // self.pp) % self.ep:
            out.append(
                f"parallel.expert_parallel_size={self.ep}: must divide the {world // self.pp} ranks of a pipeline "
                f"stage (parallel.pipeline_parallel_size={self.pp}): an EP group stays inside a stage"
            )
        if self.pp > 1 or self.pipeline_layers:
            out += self._pp_errors(num_moe_experts, model)
        return out

    def _pp_errors(self, num_moe_experts, model) -> list[str]:
        """Pipeline stages: at most one a decoder layer; ``pipeline_layers`` one positive count a
        stage summing to the layers. MoE layers run on every stage (EP inside a stage: EP groups are
        blocks of a stage's consecutive ranks); a critic's value head lives on the last stage."""
        out, key = [], f"parallel.pipeline_parallel_size={self.pp}"
        if model is None:
            return out
        layers = model.num_layers
        if self.pp > layers:
            out.append(f"{key}: at most model.num_layers={layers} (every stage holds a decoder layer)")
        if self.pipeline_layers:
            given = list(self.pipeline_layers)
            if len(given) != self.pp or sum(given) != layers or min(given) < 1:
                out.append(
                    f"parallel.pipeline_layers={given}: one count >= 1 per stage ({self.pp}), summing to "
                    f"model.num_layers={layers}"
                )
        return out

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per stage: ``pipeline_layers`` when given, else an even split whose
        remainder goes to the middle stages (the first stage also runs the embedding and the last
        the final norm, the output layer and the loss: on a 151,936-token vocabulary that head
        costs about as much as a layer of a 1B model, so the ends take the fewer layers)."""
        if self.pipeline_layers:
            return list(self.pipeline_layers)
        base, extra = divmod(num_layers, self.pp)
        order = sorted(range(self.pp), key=lambda s: (s in (0, self.pp - 1), abs(s - (self.pp - 1) / 2)))
        counts = [base] * self.pp
        for s in order[:extra]:
            counts[s] += 1
        return counts

    def stage_range(self, stage: int, num_layers: int) -> tuple[int, int]:
        """(first layer, layer count) of ``stage`` (0-based global layer indices)."""
        counts = self.stage_layers(num_layers)
        return sum(counts[:stage]), counts[stage]

    def _tp_model_errors(self, num_moe_experts, model) -> list[str]:
        """What TP splits must divide by it: query heads and KV heads (each TP rank keeps
        heads / tp query heads and their query groups; KV heads are split, never replicated, so a
        model with fewer KV heads than tp is refused), the FFN. Attention sinks split with their
        heads; a critic's one-output head is whole on every TP rank (``model.value_head``). MoE
        layers are token-parallel over TP (experts whole, each rank its sequence-parallel slice of
        the tokens: sequence parallelism required). Not composed yet, refused by name: Liger's
        fused kernel."""
        tp, out, key = self.tp, [], f"parallel.tensor_parallel_size={self.tp}"
        if num_moe_experts and not self.sequence_parallel:
            out.append(
                f"{key}: MoE models (model.num_moe_experts={num_moe_experts}) under TP need "
                "parallel.sequence_parallel=true (each TP rank routes its own slice of the tokens)"
            )

        if model is None:
            return out
        heads = model.num_attention_heads
        groups = model.num_query_groups or heads
        if heads % tp:
            out.append(f"{key}: must divide model.num_attention_heads={heads} (each TP rank keeps heads / tp)")
        if groups % tp:
            out.append(
                f"{key}: must divide model.num_query_groups={groups} (KV heads are split over TP, not replicated)"
            )
        if getattr(model, "logits_fused_kernel", "none") != "none":
            out.append(f"{key}: model.logits_fused_kernel={model.logits_fused_kernel} runs with tp 1 (set none)")
        return out

    def validate(self, **model) -> ParallelDims:
        """Self, or a ValueError holding every ``errors`` sentence."""
        found = self.errors(**model)
        if found:
            raise ValueError("; ".join(found))
        return self

    def coords(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits in each dimension (the layout in the module docstring)."""
        return {
            "tp": rank % self.tp,
            "cp": rank // self.tp % self.cp,
            "dp": rank // (self.tp * self.cp) % self.dp,
            "pp": rank // (self.tp * self.cp * self.dp),
            "ep": rank % self.ep,
        }

    def sizes(self) -> dict[str, int]:
        """Every dimension's size (what checkpoints record and the console shows)."""
        return {
            "world_size": self.world_size,
            "dp": self.dp,
            "cp": self.cp,
            "ep": self.ep,
            "tp": self.tp,
            "pp": self.pp,
        }

    # Runtime: the process groups and meshes (torch.distributed initialised).
    def build(
        self, device_type: str, *, cp_group=None, batch_group=None, tp_group=None, pp_group=None, embedding_group=None
    ) -> ParallelDims:
        """Make the meshes and record the groups by purpose (called once per world by
        ``init_distributed``). ``cp_group`` / ``batch_group`` / ``tp_group``: megatron-core's own
        context-, data- and tensor-parallel groups, which its layers use too (one group per purpose)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.validate()
        if self.pp > 1:  # a (pp, dp x cp, tp) grid: FSDP2 within each stage, over the ranks holding the same slice
            shape, names = (self.pp, self.dp * self.cp, self.tp), ("pp", "fsdp", "tp")
            fsdp = init_device_mesh(
                device_type, shape[:2] if self.tp == 1 else shape, mesh_dim_names=names[:2] if self.tp == 1 else names
            )["fsdp"]
        elif self.tp > 1:  # the (dp x cp, tp) grid: FSDP2 over the ranks holding the same TP slice
            fsdp = init_device_mesh(device_type, (self.dp * self.cp, self.tp), mesh_dim_names=("fsdp", "tp"))["fsdp"]
        else:
            fsdp = init_device_mesh(device_type, (self.dp * self.cp,), mesh_dim_names=("fsdp",))
        stage = dist.group.WORLD
        if self.pp > 1:
            per_stage = self.world_size // self.pp
            stage = init_device_mesh(device_type, (self.pp, per_stage), mesh_dim_names=("pp", "stage")).get_group(
                "stage"
            )
        built = {
            "world": dist.group.WORLD,
            "stage": stage,
            "fsdp": fsdp,
            "loss": fsdp.get_group(),
            "batch": batch_group,
            "cp": cp_group if self.cp > 1 else None,
            "ep": None,
            "tp": tp_group if self.tp > 1 else None,
            "pp": pp_group if self.pp > 1 else None,
            "embedding": embedding_group if self.pp > 1 else None,  # first and last stage (tied embeddings)
        }
        if self.ep > 1 and self.pp > 1:  # experts and their FSDP2 shards inside each stage
            expert = init_device_mesh(
                device_type,
                (self.pp, self.world_size // (self.pp * self.ep), self.ep),
                mesh_dim_names=("pp", "expert_dp", "ep"),
            )
            built.update(expert=expert, expert_dp=expert["expert_dp"], ep=expert.get_group("ep"))
            built["ep_mesh"] = expert["ep"]
        elif self.ep > 1:
            expert = init_device_mesh(
                device_type, (self.world_size // self.ep, self.ep), mesh_dim_names=("expert_dp", "ep")
            )
            built.update(expert=expert, expert_dp=expert["expert_dp"], ep=expert.get_group("ep"))
            built["ep_mesh"] = expert["ep"]
        self._built.update(built)
        return self

    def release(self) -> None:
        """Forget the groups and meshes (at teardown: a group referenced here keeps its gloo
        threads running after it is destroyed; ``teardown``)."""
        self._built.clear()

    def group(self, purpose: str):
        """The process group for ``purpose`` (see the module docstring; None: a dimension of size 1)."""
        if purpose not in GROUPS:
            raise ValueError(f"group {purpose!r}: purposes are {', '.join(GROUPS)}")
        if not self._built:
            raise RuntimeError("ParallelDims.group: the groups are made by init_distributed (build)")
        return self._built[purpose]

    def mesh(self, purpose: str):
        """The device mesh for ``purpose``: "fsdp" (dp x cp), "expert" (expert_dp, ep), "expert_dp",
        "ep" (the last three with ep > 1 only)."""
        if purpose not in MESHES:
            raise ValueError(f"mesh {purpose!r}: purposes are {', '.join(MESHES)}")
        key = "ep_mesh" if purpose == "ep" else purpose
        if key not in self._built:
            raise RuntimeError(f"ParallelDims.mesh({purpose!r}): not built (expert meshes exist with ep > 1 only)")
        return self._built[key]
