"""``mha bench --sections distributed``: attention across spawned processes against one process.

For one causal sequence (B=1, H=8, D=64, fp32), each run spawns fresh processes
(mha.tools.distributed_demo): one process running flash over the whole sequence, then ring attention
with each balance (zigzag, contiguous, striped) and Ulysses attention on W ranks. Measured per
rank: peak resident-memory growth from before its inputs were made (so a rank's inputs count, as
the one process's do), its attention's CPU time (one torch thread per rank: the ranks share this
machine's cores, so CPU time, not wall time, is each rank's work), the scores it computed at each
step of the ring, and the largest error of checked rows against the one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from . import distributed_demo as demo

RUNS = (("ring", "zigzag"), ("ring", "contiguous"), ("ring", "striped"), ("ulysses", "zigzag"))


def runs(T: int, nprocs: int) -> Iterator[tuple[str, str, list[dict]]]:
    """(mode, balance, every rank's report) of the one-process baseline ("single", "") and each run."""
    yield "single", "", demo.spawn_run(demo.Settings(length=T, mode="single", causal=True), 1)
    for mode, balance in RUNS:
        yield mode, balance, demo.spawn_run(demo.Settings(length=T, mode=mode, balance=balance, causal=True), nprocs)


def plot_distributed(rows, path: str) -> None:
    """Left: scores per rank and step of the ring, zigzag beside contiguous; right: each rank's
    attention CPU time for every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = [r for r in rows if r.section == "distributed" and "ranks" in r.detail]
    fig, (steps_ax, cpu_ax) = plt.subplots(1, 2, figsize=(12, 4.4))
    ring = [r for r in runs if " ring " in r.point and not r.point.endswith("striped")]
    width = 0.8 / max(1, len(ring))
    for i, r in enumerate(ring):
        ranks = r.detail["ranks"]
        W = len(ranks)
        for rank in ranks:
            steps = rank["step_scores"]
            bottom = 0
            for step, scores in enumerate(steps):
                steps_ax.bar(rank["rank"] + (i - (len(ring) - 1) / 2) * width, scores / 1e6, width, bottom=bottom,
                             color=plt.cm.viridis(step / max(1, W - 1)), edgecolor="black" if i == 0 else "white",
                             hatch="" if i == 0 else "//")
                bottom += scores / 1e6
    steps_ax.set(title="scores per rank, one colour per ring step\n(solid: " + ", hatched: ".join(
        r.point.split(" ", 3)[3] for r in ring) + ")", xlabel="rank", ylabel="scores per head (millions)")
    if ring:
        W = len(ring[0].detail["ranks"])
        steps_ax.legend(handles=[matplotlib.patches.Patch(color=plt.cm.viridis(t / max(1, W - 1)), label=f"step {t}")
                                 for t in range(W)], fontsize=8)
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        ranks = r.detail["ranks"]
        cpu_ax.bar([x["rank"] + (i - (len(runs) - 1) / 2) * width for x in ranks], [x["cpu_seconds"] for x in ranks],
                   width, label=r.point.split(" ", 2)[2])
    cpu_ax.set(title="attention CPU time per rank (one thread each)", xlabel="rank", ylabel="seconds")
    cpu_ax.legend(fontsize=8)
    for ax in (steps_ax, cpu_ax):
        ax.grid(True, axis="y", alpha=0.3)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
