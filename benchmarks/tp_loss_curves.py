"""Loss curves of the same training run at tp = 1, 2, 4 (tensor + sequence parallel), side by side.

    python -m benchmarks.tp_loss_curves                       # debug model, 200 steps, CPU (gloo)
    python -m benchmarks.tp_loss_curves --device cuda --tps 1 2 4

Each degree runs `train.py` (under torchrun for tp > 1) with the same seed, data and hyper-parameters,
then the per-step losses are compared with tp = 1. Writes benchmarks/results/tp_loss_curves-<device>
.json / .md and a .png plot (matplotlib, imported only here).
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

from benchmarks.common import RESULTS_DIR, write_results

ROOT = Path(__file__).resolve().parent.parent


def run_training(
    tp: int, steps: int, device: str, run_dir: Path, extra: list[str]
) -> tuple[list[dict], float]:
    overrides = [
        f"training.steps={steps}",
        f"parallel.tp={tp}",
        f"device={device}",
        "logging.every=1",
        "logging.progress_bar=false",
        "checkpoint.every=0",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    cmd = [sys.executable, "train.py"]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}", "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    done = subprocess.run(cmd + overrides, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"tp={tp} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, seconds


def plot(curves: dict[int, list[tuple[int, float]]], tag: str) -> Path:
    """Loss per step for each tp, and each one's difference from the first, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = list(curves)
    base = dict(curves[tps[0]])
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[3, 1])
    for i, tp in enumerate(tps):
        style = dict(linestyle=["-", "--", ":", "-."][i % 4], color=f"C{i}", label=f"tp={tp}")
        steps = [s for s, _ in curves[tp]]
        ax.plot(steps, [loss for _, loss in curves[tp]], **style)
        if i > 0:
            ax_diff.plot(steps, [loss - base[s] for s, loss in curves[tp]], **style)
    ax.set_ylabel("training loss")
    ax.set_title(f"debug model, tensor + sequence parallel ({tag})")
    ax.legend()
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel(f"loss - tp={tps[0]}")
    ax_diff.legend()
    fig.tight_layout()
    png = RESULTS_DIR / f"tp_loss_curves-{tag}.png"
    fig.savefig(png, dpi=110)
    return png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tag", default=None, help="device tag of the result files (default: the device)")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides, e.g. model=debug")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from the result JSON")
    opts = parser.parse_args()
    if opts.replot:
        tag = opts.tag or opts.device
        data = json.loads((RESULTS_DIR / f"tp_loss_curves-{tag}.json").read_text())
        print(plot({int(tp): [tuple(p) for p in c] for tp, c in data["curves"].items()}, tag))
        return

    curves: dict[int, list[dict]] = {}
    seconds: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in opts.tps:
            curves[tp], seconds[tp] = run_training(
                tp, opts.steps, opts.device, Path(tmp) / f"tp{tp}", opts.overrides
            )
            final = curves[tp][-1]["loss"]
            print(f"tp={tp}: {len(curves[tp])} steps in {seconds[tp]:.0f} s, final loss {final}")

    base = {r["step"]: r["loss"] for r in curves[opts.tps[0]]}
    rows = []
    for tp in opts.tps:
        losses = {r["step"]: r["loss"] for r in curves[tp]}
        diffs = [abs(losses[s] - base[s]) for s in base]
        rows.append(
            {
                "tp": tp,
                "steps": len(losses),
                "first_loss": losses[min(losses)],
                "final_loss": losses[max(losses)],
                f"max_abs_diff_vs_tp{opts.tps[0]}": max(diffs),
                f"mean_abs_diff_vs_tp{opts.tps[0]}": sum(diffs) / len(diffs),
                "wall_s": round(seconds[tp], 1),
            }
        )
    tag = opts.tag or opts.device
    notes = (
        f"`python -m benchmarks.tp_loss_curves --device {opts.device} --tps {' '.join(map(str, opts.tps))} "
        f"--steps {opts.steps}`: train.py's default debug model and data, the same seed at every tp "
        "(tensor + sequence parallel, comm=torch); losses as logged in metrics.jsonl (5 decimals)."
    )
    md = write_results("tp_loss_curves", rows, notes=notes, device=tag)
    data = json.loads(md.with_suffix(".json").read_text())
    data["curves"] = {str(tp): [[r["step"], r["loss"]] for r in curves[tp]] for tp in opts.tps}
    md.with_suffix(".json").write_text(json.dumps(data, indent=1))

    png = plot({tp: [(r["step"], r["loss"]) for r in curves[tp]] for tp in opts.tps}, tag)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
