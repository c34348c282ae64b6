"""Draw the training metrics of one or several runs to a PNG.

    python -m benchmarks.plot_metrics runs/train/2026-11-25_12-00-00 --out curves.png
    python -m benchmarks.plot_metrics runs/a runs/b --out compare.png     # one colour per run

Four panels against the step, from each run's metrics.jsonl: training loss (and the held-out loss of
runs with eval.path, dashed), learning rate, tokens/s (all ranks together) and MFU. MFU is recorded on
GPUs whose peak is known (train.py's PEAK_BF16_FLOPS); for runs without it the panel says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import pyplot
from training.metrics import read_metrics

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"))


def run_label(run_dir: Path, several: bool) -> str:
    """A run's legend label: its path where several runs are drawn, else its directory's name (that of
    `.` too)."""
    return str(run_dir) if several else run_dir.resolve().name


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    plt = pyplot()
    runs = {}
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise SystemExit(f"{run_dir} has no metrics.jsonl: give train.py run directories")
        runs[run_label(run_dir, len(run_dirs) > 1)] = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (key, label) in zip(axes.flat, PANELS, strict=True):
        drawn = False
        for i, (name, rows) in enumerate(runs.items()):
            points = [(row["step"], row[key]) for row in rows if key in row]
            if points:
                ax.plot(*zip(*points, strict=True), color=f"C{i}", label=name, linewidth=1.2)
                drawn = True
            held_out = [(row["step"], row["eval_loss"]) for row in rows if "eval_loss" in row]
            if key == "loss" and held_out:
                ax.plot(
                    *zip(*held_out, strict=True),
                    "o--",
                    color=f"C{i}",
                    label=f"{name} (held-out)",
                    markersize=3,
                )
        if not drawn:
            ax.text(
                0.5,
                0.5,
                f"no {label} recorded" + ("\n(GPU runs with a known peak only)" if key == "mfu" else ""),
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="grey",
            )
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="train.py run directories")
    parser.add_argument("--out", type=Path, required=True, help="the PNG file to write")
    opts = parser.parse_args()
    if opts.out.suffix.lower() != ".png":
        parser.error(f"--out {opts.out}: give a .png file")
    print(plot_runs(opts.run_dirs, opts.out))


if __name__ == "__main__":
    main()
