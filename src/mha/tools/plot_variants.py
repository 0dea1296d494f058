"""Figures of the efficient-attention study (``mha bench --variants``, benchmarks/train_variants.py).

    variants.png  time and peak memory against T (random inputs: speed does not depend on them),
                  and the median per-head error on MiniLM's real attention against T
    quality.png   per layer and head, each variant's error on MiniLM's real attention (largest T)
    pareto.png    speed against quality: MiniLM's attention time against its embedding cosine and
                  kept neighbours at each T, and (with training.json) ms per training step against
                  held-out accuracy on the trained task; grey steps join the points no other beats

Every variant keeps one colour and one marker in every figure; exact ones are solid lines.
"""

from __future__ import annotations

import math

_MARKERS = "osD^v<>pP*Xhd"


def variant_styles(names: list[str]) -> dict[str, tuple]:
    """A colour and a marker of its own for each variant (matplotlib's default cycle has ten
    colours: the eleventh variant would reuse the first's)."""
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"].colors
    colours = tab20[0::2] + tab20[1::2]  # the ten strong shades first, then their light twins
    return {name: (colours[i % 20], _MARKERS[i % len(_MARKERS)]) for i, name in enumerate(names)}


def study_styles(names=()) -> dict[str, tuple]:
    """The styles of every variant of the study (bench_variants.VARIANTS, in its order), then of
    any other name: a variant looks the same in every figure, whichever subset a figure shows."""
    from .bench_variants import VARIANTS

    return variant_styles(list(dict.fromkeys([*VARIANTS, *names])))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(name: str, styles: dict) -> dict:
    colour, marker = styles[name]
    return dict(color=colour, marker=marker, linestyle="-" if name.startswith("exact") else "--", label=name)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    _pyplot().close(fig)


def by_variant(rows, section: str) -> dict[str, list]:
    """{variant: its rows of ``section`` in order of T}; points are named "T{T} {variant}"."""
    grouped: dict[str, list] = {}
    for r in rows:
        if r.section == section:
            grouped.setdefault(r.point.split(" ", 1)[1], []).append(r)
    return {name: sorted(mine, key=lambda r: r.extra["T"]) for name, mine in grouped.items()}


def plot_variants(rows, path: str, styles: dict) -> None:
    """Time, peak memory and real-attention error against T, log-log (no outlier flattens the rest)."""
    speed, quality = by_variant(rows, "variants"), by_variant(rows, "quality")
    fig, (time_ax, memory_ax, error_ax) = _pyplot().subplots(1, 3, figsize=(18, 5))
    for name, mine in speed.items():
        Ts = [r.extra["T"] for r in mine]
        time_ax.loglog(Ts, [r.times_ms["time"] for r in mine], **_style(name, styles))
        memory_ax.loglog(Ts, [max(r.extra["peak RSS growth MiB"], 0.1) for r in mine], **_style(name, styles))
    for name, mine in quality.items():
        if not name.startswith("exact"):
            error_ax.loglog([r.extra["T"] for r in mine], [r.extra["head error median"] for r in mine],
                            **_style(name, styles))
    time_ax.set(title="time per forward (B=1, H=8, D=64)", xlabel="sequence length T", ylabel="ms")
    memory_ax.set(title="peak memory growth of the process", xlabel="sequence length T", ylabel="MiB")
    error_ax.set(title="all-MiniLM-L6-v2's attention: median over layers and heads",
                 xlabel="sequence length T", ylabel="|out - exact| / |exact|")
    for ax in (time_ax, memory_ax, error_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_quality(rows, path: str) -> None:
    """One heatmap per variant: its error per layer (rows) and head (columns) at the largest T."""
    quality = {name: mine[-1] for name, mine in by_variant(rows, "quality").items() if not name.startswith("exact")}
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    cols = min(4, len(quality))
    fig, axes = plt.subplots(math.ceil(len(quality) / cols), cols, squeeze=False, layout="constrained",
                             figsize=(4.2 * cols, 3.2 * math.ceil(len(quality) / cols)))
    norm = LogNorm(vmin=1e-3, vmax=10)
    for ax, (name, row) in zip(axes.flat, quality.items()):
        image = ax.imshow([[max(e, 1e-3) for e in layer] for layer in row.detail["head errors"]], norm=norm,
                          cmap="magma_r", aspect="auto")
        layers, heads = len(row.detail["head errors"]), len(row.detail["head errors"][0])
        ax.set(title=f"{name}, T={row.extra['T']}", xlabel="head", ylabel="layer", xticks=range(0, heads, 2),
               yticks=range(layers))
    for ax in list(axes.flat)[len(quality):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="|out - exact| / |exact| on MiniLM's q, k, v")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points that no other point beats on both time (lower) and quality (higher), by time."""
    best, kept = -math.inf, []
    for time, quality in sorted(points, key=lambda p: (p[0], -p[1])):
        if quality > best:
            kept.append((time, quality))
            best = quality
    return kept


def plot_pareto(rows, path: str, styles: dict, training: dict | None = None) -> None:
    """Speed against quality: MiniLM (every T; the front at the largest) and, given training.json's
    content, the trained task (each comparison)."""
    quality = by_variant(rows, "quality")
    largest = max(r.extra["T"] for mine in quality.values() for r in mine)
    panels = [("embedding cosine", "sentence-embedding cosine to exact"), ("top-5 kept", "fraction of top-5 neighbours kept")]
    comparisons = list((training or {}).get("summary", {}).items())
    plt = _pyplot()
    cols = 2
    fig, axes = plt.subplots(math.ceil((len(panels) + len(comparisons)) / cols), cols, squeeze=False,
                             figsize=(8 * cols, 6 * math.ceil((len(panels) + len(comparisons)) / cols)))
    axes = list(axes.flat)
    for ax, (measure, label) in zip(axes, panels):
        for name, mine in quality.items():
            ax.semilogx([r.times_ms["attention"] for r in mine], [r.extra[measure] for r in mine], **_style(name, styles))
            for r in mine:
                ax.annotate(f"{r.extra['T']}", (r.times_ms["attention"], r.extra[measure]), fontsize=6, alpha=0.7)
        _front(ax, [(r.times_ms["attention"], r.extra[measure]) for mine in quality.values() for r in mine
                    if r.extra["T"] == largest])
        ax.set(title=f"all-MiniLM-L6-v2, no retraining (labels: T; grey: front at T={largest})",
               xlabel="attention time, 6 layers (ms)", ylabel=label)
    for ax, (title, summary) in zip(axes[len(panels):], comparisons):
        for name, s in summary.items():
            style = _style(name, styles)
            style.pop("linestyle")
            ax.errorbar(s["ms_per_step"], s["mean"], yerr=[[s["mean"] - s["min"]], [s["max"] - s["mean"]]],
                        capsize=3, **style)
        _front(ax, [(s["ms_per_step"], s["mean"]) for s in summary.values()])
        ax.set_xscale("log")
        ax.set(title=f"trained task, {title} (bars: seed range; grey: front)", xlabel="ms per training step",
               ylabel="held-out accuracy", ylim=(0, 1.02))
    for ax in axes[:len(panels) + len(comparisons)]:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels) + len(comparisons):]:
        ax.axis("off")
    _save(fig, path)


def _front(ax, points) -> None:
    times, qualities = zip(*front(points))
    ax.step(times, qualities, where="post", color="grey", alpha=0.5, linewidth=3, zorder=0)
