"""What the torch-level `Scope` adds to a training step, counted in instructions instead of timed.

Timing a 1 ms CPU step on a shared machine has a run-to-run noise of several percent, more than the effect
being measured. Valgrind's callgrind counts the instructions a step executes exactly, and (with
`--cache-sim`) the first-level instruction-cache misses and mispredicted branches its simulated CPU sees:
the same numbers on every run, so a change to the hot path shows up even when it is a fraction of a percent.

Each arm is the 1 ms MLP step of benchmarks/overhead.py (batch 32, 64-384-384-10, one thread), run in its own
process under callgrind; only the measured steps are counted (they run inside a `functools.reduce` call, the
only one in the process, which callgrind is told to collect within). The arms: `plain`, and `scope` with the
model, optimizer and loader watched and `interval` beyond the run (no gather: the per-step cost alone).

    python benchmarks/instructions.py [--steps 100] [--cache-sim]

Needs valgrind on PATH. The two arms run side by side, 2-4 minutes (most of it importing torch under
valgrind).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = {"Ir": "instructions", "I1mr": "I1 misses", "Bcm": "cond. mispredicts", "Bim": "ind. mispredicts"}
OUTSIDE_GEMM = "instructions outside the matrix kernels"
"""MKL's sgemm kernels take a different path for differently aligned buffers: the same model in two processes
can differ by tens of thousands of instructions per step there, whatever pytscope does. The comparison is
made on the instructions outside them (the Python, torch's dispatch, the hooks), reported first."""


def _step_loop(arm: str, steps: int) -> None:
    """The measured process: warm up, then run `steps` steps inside functools.reduce."""
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    import overhead
    import torch
    import torch.nn.functional as F

    from pytscope_core.scope import Scope

    torch.set_num_threads(1)
    model = overhead.make_model(384)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = overhead.make_loader(32, steps + 30)
    scope = None
    if arm == "scope":
        scope = Scope(tempfile.mkdtemp(), interval=10**9, console=False, hang_timeout=None)
        scope.watch(model, opt, loader)
    batches = iter(loader)

    def step(*_: object) -> None:
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scope is not None:
            scope.log(loss=loss)

    for _ in range(30):
        step()
    functools.reduce(step, range(steps), None)  # type: ignore[arg-type]  # only these are collected
    if scope is not None:
        scope.finish()


def _command(arm: str, steps: int, cache_sim: bool, out: Path) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=functools_reduce",
        f"--callgrind-out-file={out}",
        *(["--cache-sim=yes", "--branch-sim=yes"] if cache_sim else []),
        sys.executable,
        __file__,
        "--arm",
        arm,
        "--steps",
        str(steps),
    ]


def _per_step(arm: str, out: Path, steps: int) -> dict[str, float]:
    text = out.read_text(errors="replace")
    events = re.search(r"^events: (.+)$", text, re.M)
    totals = re.search(r"^totals: (.+)$", text, re.M)
    if events is None or totals is None:
        raise SystemExit(f"{arm}: no totals in callgrind's output")
    counts = dict(zip(events.group(1).split(), (float(v) for v in totals.group(1).split()), strict=False))
    per_step = {name: counts[key] / steps for key, name in COUNTERS.items() if key in counts}
    return {OUTSIDE_GEMM: per_step["instructions"] - _gemm_instructions(out) / steps, **per_step}


def _gemm_instructions(out: Path) -> float:
    """Instructions in MKL's gemm kernels (functions named mkl_blas_*gemm*), from callgrind_annotate."""
    listing = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--auto=no", str(out)], capture_output=True, text=True
    ).stdout
    total = 0.0
    for line in listing.splitlines():
        m = re.match(r"\s*([\d,]+) .*mkl_blas_\S*gemm", line)
        if m:
            total += float(m.group(1).replace(",", ""))
    return total


def _measure(steps: int, cache_sim: bool) -> dict[str, dict[str, float]]:
    """Both arms at once (one process each), counted per step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for arm in ("plain", "scope"):
            out = Path(tmp) / f"{arm}.out"
            cmd = _command(arm, steps, cache_sim, out)
            runs[arm] = (
                out,
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True),
            )
        result = {}
        for arm, (out, proc) in runs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"{arm}: valgrind failed (exit {proc.returncode}): {err[-2000:]}")
            result[arm] = _per_step(arm, out, steps)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--cache-sim", action="store_true", help="also simulate caches and branch prediction")
    p.add_argument("--arm", choices=["plain", "scope"], help=argparse.SUPPRESS)  # the measured process
    args = p.parse_args(argv)
    if args.arm is not None:
        _step_loop(args.arm, args.steps)
        return 0
    if shutil.which("valgrind") is None:
        print("benchmarks/instructions.py needs valgrind on PATH", file=sys.stderr)
        return 2
    measured = _measure(args.steps, args.cache_sim)
    plain, scope = measured["plain"], measured["scope"]
    print(
        f"per step, {args.steps} steps of the 1 ms MLP (callgrind{', simulated caches' if args.cache_sim else ''})"
    )
    print(f"{'':20s} {'plain':>12s} {'with Scope':>12s} {'added':>10s}")
    for name in plain:
        added = scope[name] - plain[name]
        print(
            f"{name:20s} {plain[name]:12,.0f} {scope[name]:12,.0f} {added:+10,.0f}  ({100 * added / plain[name]:+.2f}%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
