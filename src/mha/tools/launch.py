"""Run a function on W processes of this machine joined by torch.distributed (what ``mha
distributed``, the benchmark and the tests use; torchrun does the same across machines).

    results = spawn(fn, nprocs, *args, timeout=120)

Each process sets up the default group (gloo over 127.0.0.1 on a free port; with CUDA devices,
NCCL for CUDA tensors too), runs ``fn(*args)`` and returns its value (anything torch.save takes):
``results[r]`` is rank r's. The whole run ends within ``timeout`` seconds: when a rank raises,
the others are stopped and the error is raised here with the rank's traceback; when time runs out,
every process is killed and TimeoutError is raised.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["backend_for", "free_port", "spawn"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str | torch.device = "cpu") -> str:
    """gloo for CPU tensors; NCCL for CUDA tensors (gloo beside it for CPU ones)."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def spawn(fn, nprocs: int, *args, timeout: float = 120.0, threads: int | None = None, device: str = "cpu",
          env: dict[str, str] | None = None) -> list:
    """``[fn(*args) on rank r for r in range(nprocs)]``, each rank in its own process (see the module
    docstring). ``fn`` must be importable (a module-level function). ``threads``: torch's intra-op
    threads per rank (default: this machine's cores shared out, at least 1). ``env``: added to the
    processes' environment (read when they start, e.g. by the C library's malloc)."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    with tempfile.TemporaryDirectory(prefix="mha-spawn-") as folder:
        setup = (f"tcp://127.0.0.1:{free_port()}", nprocs, threads, device, timeout, folder)
        with _environment(env or {}):
            context = mp.start_processes(_run_rank, args=(setup, fn, args), nprocs=nprocs, join=False,
                                         start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the {nprocs} ranks did not finish within {timeout:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(os.path.join(folder, f"{rank}.pt"), weights_only=False) for rank in range(nprocs)]


@contextlib.contextmanager
def _environment(changes: dict[str, str]):
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _run_rank(rank: int, setup, fn, args) -> None:
    init_method, world_size, threads, device, timeout, folder = setup
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(threads)
    if torch.device(device).type == "cuda":  # one GPU per rank, as torchrun's LOCAL_RANK would pick
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(*args)
        torch.save(result, os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
