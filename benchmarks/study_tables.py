"""Print the markdown tables of docs/efficient.md from a study's results folder.

    python benchmarks/study_tables.py benchmarks/results-variants

Reads results.json (mha bench --variants) and training.json (benchmarks/train_variants.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _by_point(rows, section):
    return {r["point"]: r for r in rows if r["section"] == section}


def speed_table(rows) -> str:
    speed = _by_point(rows, "variants")
    lengths = sorted({r["extra"]["T"] for r in speed.values()})
    names = list(dict.fromkeys(p.split(" ", 1)[1] for p in speed))
    lines = ["| variant | " + " | ".join(f"T={T} ms" for T in lengths) + f" | T={lengths[-1]} peak MiB |",
             "| --- " * (len(lengths) + 2) + "|"]
    for name in names:
        mine = [speed[f"T{T} {name}"] for T in lengths]
        lines.append(f"| {name} | " + " | ".join(f"{r['times_ms']['time']:.3g}" for r in mine)
                     + f" | {mine[-1]['extra']['peak RSS growth MiB']:.0f} |")
    return "\n".join(lines)


def quality_tables(rows) -> str:
    quality = _by_point(rows, "quality")
    out = []
    for T in sorted({r["extra"]["T"] for r in quality.values()}):
        out += [f"T = {T}:", "", "| variant | head error median | head error max | embedding cosine (min) | top-5 kept "
                "| attention ms |", "| --- | --- | --- | --- | --- | --- |"]
        for point, r in quality.items():
            if r["extra"]["T"] == T:
                e = r["extra"]
                out.append(f"| {point.split(' ', 1)[1]} | {e['head error median']:.2g} | {e['head error max']:.2g} | "
                           f"{e['embedding cosine']:.3f} ({e['cosine min']:.3f}) | {e['top-5 kept']:.2f} | "
                           f"{r['times_ms']['attention']:.3g} |")
        out.append("")
    return "\n".join(out)


def training_tables(training) -> str:
    out = []
    for title, summary in training["summary"].items():
        out += [f"{title}:", "", "| variant | accuracy, mean ± spread | seed range | steps | ms per step |",
                "| --- | --- | --- | --- | --- |"]
        for name, s in summary.items():
            out.append(f"| {name} | {s['mean']:.3f} ± {s['spread']:.3f} | {s['min']:.3f}–{s['max']:.3f} | "
                       f"{s['steps']:.0f} | {s['ms_per_step']:.0f} |")
        beaten = training["separated"][title]
        out += ["", "separated beyond the seed spread (every seed of the first above every seed of the second):",
                ", ".join(f"{a} > {b}" for a, b in beaten) or "none", ""]
    out.append(f"{training['minutes']:.0f} minutes, torch {training['torch']}, {training['threads']} threads")
    return "\n".join(out)


def main(folder: str) -> None:
    folder = Path(folder)
    if (folder / "results.json").exists():
        rows = json.loads((folder / "results.json").read_text())["rows"]
        print(speed_table(rows), end="\n\n")
        print(quality_tables(rows))
    if (folder / "training.json").exists():
        print(training_tables(json.loads((folder / "training.json").read_text())))


if __name__ == "__main__":
    main(sys.argv[1])
