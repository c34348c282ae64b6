"""Loss curves of the same training run at several degrees of one parallel dimension, side by side.

    python -m benchmarks.loss_curves                          # tp = 1, 2, 4, debug model, 200 steps, CPU
    python -m benchmarks.loss_curves --device cuda --dim cp --degrees 1 2 4 parallel.comm=triton

`--dim tp`: tensor + sequence parallel; `--dim cp`: Ulysses context parallel. Each degree runs
`train.py` (under torchrun for degree > 1, one rank per degree: dp = 1) with the same seed, data and
hyper-parameters, then the per-step losses are compared with the first degree. Writes
benchmarks/results/<dim>_loss_curves-<device>.json / .md and a .png plot (matplotlib, imported only
here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, device_name, pyplot, write_results
from training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def run_training(
    dim: str, degree: int, steps: int, device: str, run_dir: Path, extra: list[str]
) -> tuple[list[dict], float]:
    overrides = [
        f"training.steps={steps}",
        f"parallel.{dim}={degree}",
        f"device={device}",
        "logging.every=1",
        "logging.progress_bar=false",
        "checkpoint.every=0",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    cmd = [sys.executable, "train.py"]
    if degree > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={degree}", "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    done = subprocess.run(cmd + overrides, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{dim}={degree} failed:\n{done.stderr[-3000:]}")
    return read_metrics(run_dir), seconds


TITLES = {"tp": "tensor + sequence parallel", "cp": "Ulysses context parallel"}


def plot(dim: str, curves: dict[int, list[tuple[int, float]]], tag: str) -> Path:
    """Loss per step for each degree, and each one's difference from the first, as a PNG."""
    plt = pyplot()
    degrees = list(curves)
    base = dict(curves[degrees[0]])
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[3, 1])
    for i, degree in enumerate(degrees):
        style = dict(linestyle=["-", "--", ":", "-."][i % 4], color=f"C{i}", label=f"{dim}={degree}")
        steps = [s for s, _ in curves[degree]]
        ax.plot(steps, [loss for _, loss in curves[degree]], **style)
        if i > 0:
            ax_diff.plot(steps, [loss - base[s] for s, loss in curves[degree]], **style)
    ax.set_ylabel("training loss")
    ax.set_title(f"debug model, {TITLES[dim]} ({tag})")
    ax.legend()
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel(f"loss - {dim}={degrees[0]}")
    ax_diff.legend()
    fig.tight_layout()
    png = RESULTS_DIR / f"{dim}_loss_curves-{tag}.png"
    fig.savefig(png, dpi=110)
    return png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", default="tp", choices=list(TITLES), help="the parallel dimension to vary")
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--tag", default=None, help="device tag of the result files (default: cpu, or e.g. h200-x4)"
    )
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides, e.g. parallel.comm=triton")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the result JSON")
    opts = parser.parse_args()
    dim, degrees = opts.dim, opts.degrees
    name = f"{dim}_loss_curves"
    tag = opts.tag or (device_name(max(degrees)) if opts.device == "cuda" else "cpu")
    if opts.replot:
        source = RESULTS_DIR / f"{name}-{tag}.json"
        if not source.is_file():
            found = ", ".join(sorted(p.name for p in RESULTS_DIR.glob("*_loss_curves-*.json")))
            parser.error(f"--replot: no {source.name} (give --dim and --tag of one of: {found})")
        data = json.loads(source.read_text())
        print(plot(dim, {int(d): [tuple(p) for p in c] for d, c in data["curves"].items()}, tag))
        return

    curves: dict[int, list[dict]] = {}
    seconds: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for degree in degrees:
            curves[degree], seconds[degree] = run_training(
                dim, degree, opts.steps, opts.device, Path(tmp) / f"{dim}{degree}", opts.overrides
            )
            final = curves[degree][-1]["loss"]
            print(
                f"{dim}={degree}: {len(curves[degree])} steps in {seconds[degree]:.0f} s, final loss {final}"
            )

    base = {r["step"]: r["loss"] for r in curves[degrees[0]]}
    rows = []
    for degree in degrees:
        losses = {r["step"]: r["loss"] for r in curves[degree]}
        diffs = [abs(losses[s] - base[s]) for s in base]
        rows.append(
            {
                dim: degree,
                "steps": len(losses),
                "first_loss": losses[min(losses)],
                "final_loss": losses[max(losses)],
                f"max_abs_diff_vs_{dim}{degrees[0]}": max(diffs),
                f"mean_abs_diff_vs_{dim}{degrees[0]}": sum(diffs) / len(diffs),
                "wall_s": round(seconds[degree], 1),
            }
        )
    degree_list = " ".join(map(str, degrees))
    command = (
        f"python -m benchmarks.loss_curves --device {opts.device} --dim {dim} --degrees {degree_list} "
        f"--steps {opts.steps} {' '.join(opts.overrides)}"
    ).strip()
    notes = (
        f"`{command}`: train.py's default debug model and data, the same seed at every degree "
        f"({TITLES[dim]}); losses as logged in metrics.jsonl (5 decimals)."
    )
    md = write_results(name, rows, notes=notes, device=tag)
    data = json.loads(md.with_suffix(".json").read_text())
    data["curves"] = {str(d): [[r["step"], r["loss"]] for r in curves[d]] for d in degrees}
    md.with_suffix(".json").write_text(json.dumps(data, indent=1))

    png = plot(dim, {d: [(r["step"], r["loss"]) for r in curves[d]] for d in degrees}, tag)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
