"""A scaling sweep on CPU: the same small DDP job at 1, 2 and 4 workers, then `pytscope scaling` over the runs.

    python examples/scaling_sweep.py                      # runs/scaling-sweep-<time>/w1, w2, w4 + scaling.png
    python examples/scaling_sweep.py --target-loss 1.0    # also seconds and worker-seconds to reach loss 1.0

Each run is `pytscope demo --scenario healthy` (gloo, one process per worker, one thread each). The demo keeps
the per-rank batch at 1024, so the global batch grows with the worker count (weak scaling); the sweep passes
`--weak` to say so, and time to a target loss then compares runs that took different-sized steps. On one
machine the workers share memory bandwidth and the all-reduce goes through loopback, so efficiency below
100% here is the host, not the method; the same command over runs from a cluster is the real use.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from pytscope_core.demo import run_demo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the runs (default runs/scaling-sweep-<time>)"
    )
    parser.add_argument("--target-loss", type=float, default=None)
    args = parser.parse_args()

    # A fresh folder every time: a run directory is append-only, so reusing one would mix two sweeps.
    out = args.out or Path("runs") / f"scaling-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty; pick another --out")
    runs = []
    for w in args.workers:
        print(f"running the healthy demo job on {w} worker(s) ...", flush=True)
        runs.append(run_demo("healthy", ranks=w, steps=args.steps, run_dir=out / f"w{w}", console=False))
    command = [sys.executable, "-m", "pytscope_core.cli", "scaling", *map(str, runs), "--weak"]
    command += ["--plot", str(out / "scaling.png")]
    if args.target_loss is not None:
        command += ["--target-loss", str(args.target_loss)]
    print("$ pytscope " + " ".join(command[3:]), flush=True)
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
