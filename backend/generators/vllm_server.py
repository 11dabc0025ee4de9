"""vLLM OpenAI-compatible servers as the RL loop's generator (``rl.generator: vllm_server``).

Servers: the loop starts ``rl.vllm_server.num_engines`` of them (``servers.start_servers``), or is
given ``rl.vllm_server.urls``. Every rank talks to them over HTTP; rank 0 alone sends weights.

Weights, every sync (rank 0), through vLLM's weight-transfer API on every engine:
``/pause?mode=wait`` (nothing is generating then anyway: the loops sync between steps),
``/start_weight_update``, ``/update_weights`` (names, dtypes, shapes and the bucket size, once a
sync, in the request) answered while rank 0 broadcasts the byte buckets of ``transport.send``
over one gloo group of rank 0 and every server worker (``vllm_engine`` receives them); on CUDA by
default (``rl.vllm_server.transport``) vLLM's own NCCL engine instead: the same checked stream,
packed into ``bucket_mib`` buffers (two in flight) by vLLM's producer, from rank 0's GPU,
``/finish_weight_update`` with ``weight_version`` = the trainer's step, ``/reset_prefix_cache``
(its keys and values were computed by the old weights), ``/resume``. The group is made at the
first sync (``/init_weight_transfer_engine`` on every engine while rank 0 joins it) with
``rl.vllm_server.sync_timeout_s`` as its timeout: a broadcast a dead server cannot finish raises
after it, naming the servers that no longer answer ``/health``. After every sync the loop compares
each engine's log-probabilities of a probe sequence with the trainer's (``probe_logprobs``
returns them by engine): an engine that missed the update is an error naming it, never sampled.

Generation: a step's prompts are spread over the engines by tokens (longest first, each to the
engine holding the fewest prompt tokens so far: a deterministic assignment), one request a prompt
(``n`` responses, the prompt's own seed, log-probabilities after temperature: the servers run
with ``--logprobs-mode processed_logprobs``) to vLLM's token-in / token-out endpoint, all in flight
at once so each server batches them; every response's ``weight_versions`` must be the synced one.
The same seeds and engine count give the same rollouts. A server that fails a request stops the
step with its URL and the prompts it held (nothing of that step is trained); nothing is retried
on the others (a retry would sample those prompts on another engine, with other draws).
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import requests
import torch

from backend.distributed.setup import free_port

from . import transport
from .results import Completion, Rollout, SyncStats
from .servers import ServerProcess, healthy, start_servers, stop_servers, wait_urls

#: Names the engine's served model (requests must name it).
SERVED_NAME = "policy"
#: vLLM's token-in / token-out generate endpoint (``--enable-scale-out``).
GENERATE = "/inference/v1/generate"


class EngineError(RuntimeError):
    """A vLLM server failed a request, or stopped answering."""


def _route_address(url: str) -> str:
    """This machine's address on the route to ``url``'s host: where a server reaches us."""
    parsed = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parsed.hostname, parsed.port or 80))
        return s.getsockname()[0]


def assign(prompts: Sequence[Sequence[int]], engines: int) -> list[int]:
    """The engine of each prompt: longest first, each to the engine with the fewest prompt tokens
    so far (ties to the lowest engine): balanced by tokens, the same for the same prompts."""
    load = [0] * engines
    out = [0] * len(prompts)
    for i in sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i)):
        e = min(range(engines), key=lambda e: (load[e], e))
        out[i] = e
        load[e] += len(prompts[i])
    return out


def bounded(fn, timeout: float, what: str):
    """``fn()`` in a daemon thread, its result or error; a ``TimeoutError`` naming ``what`` when it
    has not returned within ``timeout`` seconds (the thread is left: an NCCL call cannot be
    interrupted, and the run ends on the error)."""
    box: dict = {}

    def body():
        try:
            box["out"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=body, name=what, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("out")


class VLLMServerGenerator:
    """The loop's handle on its vLLM servers (see the module docstring). ``sender``: this rank
    sends the weights (rank 0); the others drain the stream (their gathers are collectives)."""

    def __init__(
        self,
        urls: Sequence[str],
        metadata,
        settings,
        *,
        sender: bool,
        stop_token_ids: Sequence[int] = (),
        vocab_limit: int | None = None,
        vocab_size: int | None = None,
        servers: Sequence[ServerProcess] = (),
    ):
        self.urls = [u.rstrip("/") for u in urls]
        self.metadata = [(n, d, tuple(s)) for n, d, s in metadata]
        self.settings = settings
        self.sender = sender
        self.servers = list(servers)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        # ids past the tokenizer's vocabulary (padding rows) are never sampled, as in HFGenerator
        self.allowed = list(range(vocab_limit)) if vocab_limit and vocab_size and vocab_limit < vocab_size else None
        self.session = requests.Session()
        self.transfer = transport.backend(settings.transport, cuda=torch.cuda.is_available())
        self.pg = self.store = None
        self.version: int | None = None
        self._lock = threading.Lock()
        self._results: list = []  # the asynchronous loop's replies, in request order
        self._queue: list = []
        self._worker: threading.Thread | None = None
        self._idle_since = time.perf_counter()

    @classmethod
    def from_worker(cls, worker, *, stop_token_ids=(), sender: bool | None = None, run_dir=None):
        """Rank 0 starts the servers (or takes ``rl.vllm_server.urls``) and every rank of the
        world gets their URLs (``sender=None``: the synchronous loop, every rank a handle; a bool:
        this rank only, the asynchronous loop's rank 0)."""
        from backend.distributed.collectives import all_gather_objects

        from .transport import DTYPES

        cfg, env = worker.cfg, worker.env
        settings = cfg.rl.vllm_server
        dtype = DTYPES["float32"]
        hf_config = worker.hf_config(dtype)
        servers, error = [], None
        everyone = sender is None
        if env.is_main:
            try:
                if settings.urls:
                    urls = list(settings.urls)
                    wait_urls(urls, settings.startup_timeout_s)  # a Slurm job's generator nodes start beside us
                else:
                    servers = start_servers(hf_config, settings, max_model_len=cfg.data.max_seq_length, log_dir=run_dir)
                    urls = [s.url for s in servers]
            except Exception as e:
                urls, error = [], f"{type(e).__name__}: {e}"
        else:
            urls = []
        if everyone and env.world_size > 1:
            urls, error = all_gather_objects((urls, error), group=env.group("world"))[0]
        if error:
            raise EngineError(f"rl.generator=vllm_server: {error}")
        return cls(
            urls,
            worker.weight_metadata(dtype),
            settings,
            sender=env.is_main if everyone else bool(sender),
            stop_token_ids=stop_token_ids,
            vocab_limit=worker.sampling_vocab,
            vocab_size=hf_config["vocab_size"],
            servers=servers,
        )

    # ---- HTTP ----
    def _post(self, url: str, path: str, body=None, *, timeout: float | None = None, params=None) -> dict:
        try:
            reply = self.session.post(
                url + path, json=body, params=params, timeout=timeout or self.settings.request_timeout_s
            )
        except requests.RequestException as e:
            raise EngineError(f"vLLM server {url}: {path}: {type(e).__name__}: {e}") from None
        if reply.status_code != 200:
            raise EngineError(f"vLLM server {url}: {path} answered {reply.status_code}: {reply.text[:500]}")
        return reply.json() if reply.content else {}

    def _get(self, url: str, path: str) -> dict:
        try:
            reply = self.session.get(url + path, timeout=self.settings.request_timeout_s)
        except requests.RequestException as e:
            raise EngineError(f"vLLM server {url}: {path}: {type(e).__name__}: {e}") from None
        if reply.status_code != 200:
            raise EngineError(f"vLLM server {url}: {path} answered {reply.status_code}: {reply.text[:500]}")
        return reply.json() if reply.content else {}

    def silent(self) -> list[str]:
        """The servers that do not answer ``/health`` now (or whose process ended)."""
        return [url for url in self.urls if not healthy(url)]

    def named_silent(self) -> str:
        """The servers that stopped answering, each named as every other engine error names it
        ("vLLM server URL"), for an error of the whole group (a broadcast has no single peer)."""
        silent = self.silent()
        if not silent:
            return "every vLLM server still answers /health"
        return ", ".join(f"vLLM server {url}" for url in silent) + " no longer answer(s) /health"

    def _on_every(self, fn, *, what: str) -> list:
        """``fn(url)`` on every server at once (threads); the first failure raised naming its server."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.urls))) as pool:
            futures = [pool.submit(fn, url) for url in self.urls]
            out, errors = [], []
            for url, f in zip(self.urls, futures):
                try:
                    out.append(f.result())
                except Exception as e:
                    errors.append(f"{url}: {e}" if url not in str(e) else str(e))
        if errors:
            raise EngineError(f"{what}: " + "; ".join(errors))
        return out

    # ---- weights ----
    def _connect(self) -> None:
        """The transfer group of rank 0 and every server worker (first sync): our gloo group, or
        vLLM's NCCL communicator (rank 0 this process's GPU, then every engine's workers)."""
        sizes = [int(self._get(url, "/get_world_size")["world_size"]) for url in self.urls]
        host = self.settings.transfer_host or _route_address(self.urls[0])
        port = free_port("")
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        timeout = self.settings.sync_timeout_s

        if self.transfer == "nccl":  # vLLM's packed engine: its buffers are the buckets
            extra = {"packed": True, "packed_buffer_size_bytes": self.bucket_bytes, "packed_num_buffers": 2}
        else:
            extra = {"timeout_s": timeout}

        def init(url):
            info = {
                "master_address": host,
                "master_port": port,
                "rank_offset": offsets[self.urls.index(url)],
                "world_size": world,
                **extra,
            }
            return self._post(url, "/init_weight_transfer_engine", {"init_info": info}, timeout=timeout)

        def join():
            if self.transfer == "nccl":
                from vllm.distributed.weight_transfer.nccl_common import trainer_init

                return None, bounded(
                    lambda: trainer_init({"master_address": host, "master_port": port, "world_size": world}),
                    timeout,
                    "joining the NCCL weight-transfer group",
                )
            return transport.group(host, port, 0, world, datetime.timedelta(seconds=timeout))

        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(self._on_every, init, what="joining the weight-transfer group")
            try:
                self.store, self.pg = join()
            except Exception as e:
                raise EngineError(
                    f"the weight-transfer group at {host}:{port} did not form within {timeout:g} s "
                    f"(rl.vllm_server.sync_timeout_s); {self.named_silent()}: {e}"
                ) from None
            pending.result()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> SyncStats:
        """Send the stream to every server as ``version`` (rank 0); the other ranks drain it."""
        start = time.perf_counter()
        version = (self.version or 0) + 1 if version is None else version
        if not self.sender:
            count = size = 0
            for _, t in weights:
                count += 1
                size += t.numel() * t.element_size()
            self.version = version
            return SyncStats(count, size, time.perf_counter() - start)
        if self.pending:
            raise RuntimeError(f"weights sent with {self.pending} generate request(s) in flight")
        stream = iter(weights)
        try:
            if self.pg is None:
                self._connect()
            self._on_every(lambda url: self._post(url, "/pause", params={"mode": "wait"}), what="pause")
            self._on_every(lambda url: self._post(url, "/start_weight_update", {}), what="start_weight_update")
            info = {
                "names": [n for n, _, _ in self.metadata],
                "dtype_names": [str(d).removeprefix("torch.") for _, d, _ in self.metadata],
                "shapes": [list(s) for _, _, s in self.metadata],
            }
            if self.transfer == "gloo":  # vLLM's NCCL engine took its buffer size at init
                info["bucket_bytes"] = self.bucket_bytes
            timeout = self.settings.sync_timeout_s
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                answered = pool.submit(
                    self._on_every,
                    lambda url: self._post(url, "/update_weights", {"update_info": info}, timeout=timeout),
                    what="update_weights",
                )
                try:
                    count, size = self._send(stream, timeout)
                except ValueError:
                    raise
                except Exception as e:
                    raise EngineError(
                        f"weight broadcast to the vLLM servers failed (bounded by rl.vllm_server.sync_timeout_s="
                        f"{timeout:g}); {self.named_silent()}: {e}"
                    ) from None
                answered.result()
            finally:  # on an error, never wait here for a request to a server that may hang
                pool.shutdown(wait=False, cancel_futures=True)
            label = {"weight_version": str(version)}
            self._on_every(lambda url: self._post(url, "/finish_weight_update", label), what="finish_weight_update")
            self._on_every(lambda url: self._post(url, "/reset_prefix_cache"), what="reset_prefix_cache")
            self._on_every(lambda url: self._post(url, "/resume"), what="resume")
        finally:
            for _ in stream:  # the other ranks' gathers go on to the end
                pass
        self.version = version
        return SyncStats(count, size, time.perf_counter() - start)

    @property
    def bucket_bytes(self) -> int:
        return self.settings.bucket_mib * 2**20

    def _send(self, stream, timeout: float) -> tuple[int, int]:
        """Broadcast the checked stream to every server worker: our gloo buckets (bounded by the
        group's timeout), or vLLM's packed NCCL producer from this rank's GPU (an NCCL broadcast
        never times out by itself: it runs in a daemon thread bounded by ``timeout``)."""
        if self.transfer == "gloo":
            return transport.send(self.pg, stream, self.metadata, limit=self.bucket_bytes, who="the vLLM servers")
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        tally = [0, 0]
        device = torch.device("cuda", torch.cuda.current_device())
        pairs = ((n, t.to(device)) for n, t in transport.checked(stream, self.metadata, "the vLLM servers", tally))

        def run():
            packed_nccl_broadcast_producer(
                iterator=pairs,
                group=self.pg,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=self.bucket_bytes,
                num_buffers=2,
            )
            torch.cuda.current_stream().synchronize()

        bounded(run, timeout, "the NCCL weight broadcast")
        return tally[0], tally[1]

    def probe_logprobs(self, token_ids: Sequence[int]) -> dict[str, list[float]]:
        """Each server's log p of every token of ``token_ids`` after the first (its prompt
        log-probabilities, temperature 1), by URL: the loop checks every engine."""
        ids = [int(t) for t in token_ids]

        def one(url):
            body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
            choice = self._post(url, "/v1/completions", body)["choices"][0]
            return [float(choice["prompt_logprobs"][i][str(t)]["logprob"]) for i, t in enumerate(ids) if i > 0]

        return dict(zip(self.urls, self._on_every(one, what="probe")))

    # ---- generation ----
    def _request(self, url, prompt, n, temperature, max_new_tokens, seed) -> list[Completion]:
        """One prompt's ``n`` responses from vLLM's token-in / token-out endpoint (``--enable-
        scale-out``: no tokenizer needed), each response's weight version checked."""
        params = {
            "n": n,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": -1,
            "seed": int(seed),
            "logprobs": 0,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": True,  # only stop_token_ids end a response, as in the other generators
            "detokenize": False,
        }
        if self.allowed is not None:
            params["allowed_token_ids"] = self.allowed
        body = {"model": SERVED_NAME, "token_ids": [int(t) for t in prompt], "sampling_params": params}
        choices = sorted(self._post(url, GENERATE, body)["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            spans = {str(v["version"]) for v in c.get("weight_versions") or []}
            if self.version is not None and spans - {str(self.version)}:
                raise EngineError(
                    f"vLLM server {url}: a response was sampled by weight version(s) {sorted(spans)}, not the "
                    f"synced {self.version}"
                )
            ids = [int(t) for t in c["token_ids"]]
            lps = [float(x["logprob"]) for x in c["logprobs"]["content"]][: len(ids)]
            out.append(Completion(ids, lps, stopped=c["finish_reason"] == "stop"))
        return out

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int, seeds: Sequence[int]
    ) -> list[list[Completion]]:
        """Every prompt's ``n`` responses, the prompts spread over the servers by tokens, all in
        flight at once; a failure names the server and the prompts it held."""
        if not prompts:
            return []
        engine = assign(prompts, len(self.urls))
        with ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            futures = [
                pool.submit(self._request, self.urls[e], p, n, temperature, max_new_tokens, s)
                for p, e, s in zip(prompts, engine, seeds)
            ]
            out, failed = [], {}
            for i, f in enumerate(futures):
                try:
                    out.append(f.result())
                except Exception as e:
                    failed.setdefault(self.urls[engine[i]], (str(e), []))[1].append(i)
                    out.append(None)
        if failed:
            url, (message, held) = next(iter(failed.items()))
            raise EngineError(f"{message} (prompts {held} of this request were on {url})")
        return out

    def generate(self, prompt_ids, n, temperature, max_new_tokens, seed) -> list[Completion]:
        return self.generate_batch([prompt_ids], n, temperature, max_new_tokens, [seed])[0]

    # ---- the asynchronous loop's interface (RemoteGenerator's) ----
    def submit(self, step: int, prompts, n: int, temperature: float, max_new_tokens: int, seeds) -> None:
        """Queue a step's generation (run in order on a thread of this handle)."""
        with self._lock:
            self._queue.append((step, [list(p) for p in prompts], n, temperature, max_new_tokens, list(seeds)))
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._serve, daemon=True, name="vllm-server-requests")
                self._worker.start()

    def _serve(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    self._idle_since = time.perf_counter()
                    return
                step, prompts, n, temperature, max_new, seeds = self._queue[0]
            idle = time.perf_counter() - self._idle_since
            start = time.perf_counter()
            try:
                batches = self.generate_batch(prompts, n, temperature, max_new, seeds)
                completions = [[(c.token_ids, c.logprobs, c.stopped) for c in b] for b in batches]
                result = Rollout(step, self.version, completions, time.perf_counter() - start, idle)
            except Exception as e:
                result = e
            with self._lock:
                self._queue.pop(0)
                self._results.append(result)
            self._idle_since = time.perf_counter()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._results)

    def has_reply(self, timeout: float = 0.0) -> bool:
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._results:
                    return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)

    def receive(self):
        """The next submitted step's rollouts (blocks); a failed request raises here."""
        while not self.has_reply(1.0):
            pass
        with self._lock:
            result = self._results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    def close(self) -> None:
        """Stop the servers this handle started (servers given by URL are left running)."""
        if self.transfer == "nccl" and self.pg is not None:
            self.pg.destroy()  # vLLM's communicator: its NCCL resources
        self.pg = self.store = None
        stop_servers(self.servers)
        self.servers = []
