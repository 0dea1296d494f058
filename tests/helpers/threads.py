"""How many of torch's threads a worker of a parallel test run takes (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Mapping


def worker_share(threads: int, environ: Mapping[str, str]) -> int | None:
    """A pytest-xdist worker's share of ``threads`` (torch's count for the whole machine): an equal
    part, one at least; None (leave torch's count) outside a parallel run or where the user set
    OMP_NUM_THREADS. pytest-xdist tells each worker the count in PYTEST_XDIST_WORKER_COUNT."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in environ:
        return None
    return max(1, threads // workers)
