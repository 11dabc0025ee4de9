"""The generator in a process of its own, fed weights over a torch.distributed group.

``RemoteGenerator`` (the trainer's rank 0) starts one child process holding an ``HFGenerator`` and
talks to it two ways:

- a pipe carries requests and replies in order (generate this step's prompts with these seeds,
  take weights version v, score a probe sequence), small pickled objects;
- a two-member gloo process group (its own TCPStore, never the trainer's groups; gloo on CUDA
  too, through host memory, as the process shares rank 0's GPU and NCCL refuses a second rank on
  one device) carries the weights: the policy's Hugging Face stream packed into byte buckets of
  at most ``transport.BUCKET_BYTES`` (verl and NeMo-RL send 512 MiB to 2 GiB), each broadcast from the
  trainer. The child knows the layout from ``weight_metadata`` (names, dtypes, shapes in stream
  order), so a bucket needs no header; ``checked_stream`` then refuses a missing, repeated or
  misshapen tensor by name, as in the colocated generators.

The child answers requests one at a time, in order: a generate request queued behind another
waits for it. Its idle time (waiting for the next request) comes back with each result.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Iterable, Sequence

import torch

from backend.distributed.setup import free_port
from backend.generators import transport
from backend.generators.results import Rollout, SyncStats

#: Threads of the generator process on CPU (generation is a chain of small steps: one is enough).
GENERATOR_THREADS = 1
#: How long one weight broadcast may take (both sides are ready when it starts: the trainer sends
#: weights only to an idle generator). A reply is awaited as long as the process lives.
TIMEOUT = datetime.timedelta(minutes=30)


def _group(port: int, rank: int):
    """The two-member gloo group of the trainer's rank 0 (0) and the generator process (1)."""
    return transport.group("127.0.0.1", port, rank, 2, TIMEOUT)


def stream_dtype(device: torch.device) -> torch.dtype:
    """The weights' type on the wire and in the generator: the trainer's FP32 master weights, as
    the colocated transformers generator samples with (so switching k keeps the sampler's precision)."""
    return torch.float32


class RemoteGenerator:
    """The trainer's handle on the generator process (rank 0 only)."""

    def __init__(
        self, hf_config: dict, metadata, *, device: torch.device, vocab_limit=None, stop_token_ids=(), threads: int = 1
    ):
        self.metadata = [(name, dtype, tuple(shape)) for name, dtype, shape in metadata]
        port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        spec = {
            "hf_config": hf_config,
            "metadata": [(n, str(d).removeprefix("torch."), s) for n, d, s in self.metadata],
            "vocab_limit": vocab_limit,
            "stop_token_ids": list(stop_token_ids),
            "device": str(device),
            "threads": threads,
            "port": port,
        }
        self.process = ctx.Process(target=_child_main, args=(child, spec), name="rl-generator")
        self.process.start()
        child.close()
        atexit.register(self.close)  # before multiprocessing's own exit handler joins it
        self.version: int | None = None
        self._pending = 0  # generate requests sent and not yet answered
        self._expect("ready")  # imports and the model built: a child that fails there is reported, not awaited
        self.store, self.group = _group(port, 0)

    @classmethod
    def from_worker(cls, worker, *, stop_token_ids=(), threads: int = GENERATOR_THREADS) -> RemoteGenerator:
        metadata = worker.weight_metadata(stream_dtype(worker.env.device))
        return cls(
            worker.hf_config(stream_dtype(worker.env.device)),
            metadata,
            device=worker.env.device,
            vocab_limit=worker.sampling_vocab,
            stop_token_ids=stop_token_ids,
            threads=threads,
        )

    # ---- requests ----
    def submit(self, step: int, prompts, n: int, temperature: float, max_new_tokens: int, seeds) -> None:
        """Ask for ``n`` responses to each prompt (returns at once: the process reads requests on a
        thread of its own, so a large request never waits for a reply to be read)."""
        self.conn.send(("generate", step, [list(p) for p in prompts], n, temperature, max_new_tokens, list(seeds)))
        self._pending += 1

    def has_reply(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def receive(self) -> Rollout:
        """The next generate request's result, in the order they were sent (blocks)."""
        body = self._expect("rollouts")
        self._pending -= 1
        return Rollout(*body)

    @property
    def pending(self) -> int:
        return self._pending

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """Send the stream as ``version`` (call it with no request in flight: the process takes
        it at once, so neither side waits inside a broadcast)."""
        if self._pending:
            raise RuntimeError(f"weights sent with {self._pending} generate request(s) in flight")
        start = time.perf_counter()
        self.conn.send(("weights", version))
        count, size = transport.send(self.group, weights, self.metadata, who="the generator process")
        loaded = self._expect("loaded")[0]
        if loaded != version:
            raise RuntimeError(f"generator process: loaded version {loaded}, sent {version}")
        self.version = version
        return SyncStats(count, size, time.perf_counter() - start)

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-probabilities (temperature 1) of ``token_ids[1:]`` under the process's weights."""
        self.conn.send(("probe", list(token_ids)))
        return self._expect("probe")[0]

    def _expect(self, kind: str) -> list:
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the generator process died (exit code {self.process.exitcode})")
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=5)
            raise RuntimeError(f"the generator process died (exit code {self.process.exitcode})") from None
        if message[0] == "error":
            raise RuntimeError(f"generator process: {message[1]}")
        if message[0] != kind:
            raise RuntimeError(f"generator process: expected {kind}, got {message[0]}")
        return list(message[1:])

    def close(self) -> None:
        """Stop the process (a request in flight is abandoned)."""
        atexit.unregister(self.close)
        try:
            if self.process.is_alive():
                self.conn.send(("close",))
                self.process.join(timeout=30)
        except (OSError, ValueError):
            pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.group = self.store = None  # the peer has exited and nothing is in flight: freed (threads joined) now


def _reader(conn, inbox: queue.Queue) -> None:
    """Move requests from the pipe to ``inbox`` as they come (the trainer's sends never block on a
    full pipe); the pipe's end (the trainer died or closed) stops the process."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        inbox.put(message)
        if message[0] == "close":
            return


def _child_main(conn, spec: dict) -> None:
    """The generator process: answer requests in order until ``close`` (or the pipe ends). Stop
    signals are the trainer's to act on (it saves at the end of its step, then closes this
    process): a Ctrl-C, Slurm's SIGTERM or the preemption SIGUSR1 sent to the whole process group
    must not kill it first."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from .hf import HFGenerator  # transformers imports here, in the child

        device = torch.device(spec["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        metadata = [(n, transport.DTYPES[d], tuple(s)) for n, d, s in spec["metadata"]]
        gen = HFGenerator(
            spec["hf_config"],
            vocab_limit=spec["vocab_limit"],
            stop_token_ids=spec["stop_token_ids"],
            device=device,
            dtype=metadata[0][1] if metadata else torch.float32,
        )
    except Exception as e:
        conn.send(("error", f"start-up: {type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    store, group = _group(spec["port"], 1)
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(conn, inbox), daemon=True).start()
    version, idle = None, 0.0
    while True:
        waited = time.perf_counter()
        message = inbox.get()
        idle += time.perf_counter() - waited
        kind = message[0]
        try:
            if kind == "close":  # no broadcast is in flight: end the group now, threads joined, then exit
                del group, store
                gc.collect()
                return
            if kind == "weights":
                stream = (pair for pairs in transport.receive(group, metadata, device=device) for pair in pairs)
                try:
                    gen.load_weights(stream)
                finally:
                    for _ in stream:  # every bucket is taken, so the trainer's broadcasts complete
                        pass
                version = message[1]
                conn.send(("loaded", version))
            elif kind == "generate":
                _, step, prompts, n, temperature, max_new, seeds = message
                start = time.perf_counter()
                batches = gen.generate_batch(prompts, n, temperature, max_new, seeds)
                completions = [[(c.token_ids, c.logprobs, c.stopped) for c in b] for b in batches]
                conn.send(("rollouts", step, version, completions, time.perf_counter() - start, idle))
                idle = 0.0
            elif kind == "probe":
                ids = torch.tensor([message[1]], dtype=torch.long)
                logits = gen.logits(ids)[0, :-1].double()
                if gen.vocab_limit is not None:  # the trainer's softmax leaves our padding rows out
                    logits = logits[:, : gen.vocab_limit]
                logp = torch.log_softmax(logits, dim=-1)
                conn.send(("probe", logp.gather(1, ids[0, 1:, None].to(logp.device)).squeeze(1).tolist()))
            else:
                conn.send(("error", f"unknown request {kind!r}"))
        except Exception as e:  # reported to the trainer, which raises it on every rank
            conn.send(("error", f"{kind}: {type(e).__name__}: {e}"))
            return
