"""What pytscope costs an FSDP2 step: microseconds per sharded unit per step, and the whole-step overhead.

Run it as `python benchmarks/overhead.py --fsdp` (or this file directly). Two measurements, each in spawned
gloo processes on CPU with one thread per process:

* **per unit and step**: one process (world size 1: FSDP2 runs all its hooks, the collectives are local
  copies), a tiny model (8 x 8 linear units, batch 4, SGD) with 4 and with 32 `fully_shard` units, so the
  step is almost nothing but per-unit work. Many short blocks with and without `Scope` alternate (ABBA...);
  under additive noise from other processes the fastest block of each arm is the steadiest estimate, so the
  cost is the difference of the two arms' minimum block medians (the median over pairs of the per-pair
  difference is shown too). The cost per unit is the slope between 4 and 32 units ((cost(32) - cost(4)) / 28),
  the rest is the per-step cost any model pays.
* **whole step**: two ranks, seven units (six 384 x 384 blocks and the root), batch 512, Adam, a step of
  roughly 100-200 ms on 2 shared cores: blocks with and without `Scope` alternate; per pair the ratio of
  median step times (per-step cost) and of mean step times (with the gathers every 50 steps), median over
  pairs with a bootstrap 95% interval, and the overhead the per-unit cost predicts for that step. On 2 shared
  cores the A/B interval is several percent wide: it cannot resolve 1%, the per-unit prediction can. Budget:
  <= 1% of a realistic (>= 50 ms) step.

`--quick` runs a smoke size in about a minute (numbers not meaningful).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

BUDGET = 0.01
UNITS = (4, 32)
STEP_UNITS = 7


def _bootstrap(values: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float]:
    a = np.asarray(values)
    if a.size < 2:
        return (float(a[0]), float(a[0])) if a.size else (math.nan, math.nan)
    meds = np.median(a[np.random.default_rng(seed).integers(0, a.size, (n, a.size))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _model(units: int, width: int, in_dim: int) -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(units - 1)]
    model = torch.nn.Sequential(torch.nn.Linear(in_dim, width), *blocks, torch.nn.Linear(width, 4))
    for block in blocks:
        fully_shard(block)
    return fully_shard(model)


def _block(model: Any, opt: Any, x: Any, y: Any, steps: int, run_dir: Path | None) -> list[float]:
    """Per-step wall times in ms (loop top to loop top), under a fresh `Scope` when `run_dir` is given."""
    import torch.nn.functional as F

    from pytscope_core.scope import Scope

    scope = None
    if run_dir is not None:
        scope = Scope(run_dir, interval=50, console=False, hang_timeout=None)
        scope.watch(model, opt)
    times: list[float] = []
    last = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scope is not None:
            scope.log(loss=loss)
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    if scope is not None:
        scope.finish()
        if scope.errors:
            raise RuntimeError(f"scope errors: {scope.errors}")
    return times


def _worker(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        gen = torch.Generator().manual_seed(rank)
        for units in spec["units"]:
            model = _model(units, spec["width"], spec["in_dim"])
            opt = (torch.optim.Adam if spec["adam"] else torch.optim.SGD)(model.parameters(), lr=1e-3)
            x = torch.randn(spec["batch"], spec["in_dim"], generator=gen)
            y = torch.randint(0, 4, (spec["batch"],), generator=gen)
            _block(model, opt, x, y, 10, None)  # lazy init, allocator warm-up
            pairs: list[dict[str, list[float]]] = []
            for i in range(spec["pairs"]):
                res: dict[str, list[float]] = {}
                for arm in ("plain", "scope") if i % 2 == 0 else ("scope", "plain"):
                    run_dir = Path(spec["tmp"]) / f"u{units}-{i}" if arm == "scope" else None
                    res[arm] = _block(model, opt, x, y, spec["steps"], run_dir)[spec["skip"] :]
                pairs.append(res)
            out[str(units)] = pairs
    finally:
        dist.destroy_process_group()
    Path(spec["tmp"], f"result{rank}.json").write_text(json.dumps(out))


def _spawn(world: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from pytscope_core.demo import free_port

    mp.start_processes(
        _worker, args=(world, free_port(), spec), nprocs=world, start_method="spawn", join=True
    )
    return dict(json.loads(Path(spec["tmp"], "result0.json").read_text()))


def per_unit_cost(pairs: int, steps: int, tmp: Path) -> dict[str, float]:
    """us per step that pytscope adds with 4 and with 32 units, the slope per unit, and the step times."""
    spec = dict(units=list(UNITS), width=8, in_dim=8, batch=4, adam=False, pairs=pairs, steps=steps, skip=20)
    result = _spawn(1, {**spec, "tmp": str(tmp / "units")})
    out: dict[str, float] = {}
    for units in UNITS:
        pairs_u = result[str(units)]
        diffs = [1e3 * (np.median(p["scope"]) - np.median(p["plain"])) for p in pairs_u]
        fastest = {arm: min(np.median(p[arm]) for p in pairs_u) for arm in ("plain", "scope")}
        out[f"cost_{units}_us"] = float(1e3 * (fastest["scope"] - fastest["plain"]))
        out[f"pairs_{units}_us"] = float(statistics.median(diffs))
        out[f"pairs_{units}_ci"] = _bootstrap(diffs)  # type: ignore[assignment]
        out[f"step_{units}_ms"] = float(fastest["plain"])
    lo, hi = UNITS
    out["per_unit_us"] = (out[f"cost_{hi}_us"] - out[f"cost_{lo}_us"]) / (hi - lo)
    out["per_step_us"] = out[f"cost_{lo}_us"] - lo * out["per_unit_us"]
    return out


def step_overhead(pairs: int, steps: int, tmp: Path) -> dict[str, Any]:
    """Ratios with/without pytscope on a 2-rank, 7-unit FSDP2 step (rank 0's timings)."""
    spec = dict(
        units=[STEP_UNITS], width=384, in_dim=32, batch=512, adam=True, pairs=pairs, steps=steps, skip=5
    )
    result = _spawn(2, {**spec, "tmp": str(tmp / "step")})[str(STEP_UNITS)]
    med = [float(np.median(p["scope"]) / np.median(p["plain"])) for p in result]
    mean = [float(np.mean(p["scope"]) / np.mean(p["plain"])) for p in result]
    return {
        "base_ms": float(statistics.median(np.median(p["plain"]) for p in result)),
        "median_ratio": statistics.median(med),
        "median_ci": _bootstrap(med),
        "mean_ratio": statistics.median(mean),
        "mean_ci": _bootstrap(mean, seed=1),
        "pairs": pairs,
    }


def run(quick: bool) -> dict[str, Any]:
    import torch

    print(f"torch {torch.__version__}, FSDP2 on gloo (CPU), 1 thread per process, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="pytscope-fsdp-bench-") as name:
        tmp = Path(name)
        units = per_unit_cost(2 if quick else 16, 40 if quick else 80, tmp)
        step = step_overhead(1 if quick else 6, 12 if quick else 30, tmp)
    lo, hi = UNITS
    print()
    print("FSDP2 cost per step: fastest blocks' difference (median of per-pair differences, bootstrap 95%)")
    for u in UNITS:
        ci = units[f"pairs_{u}_ci"]
        print(
            f"  {u:2d} units: +{units[f'cost_{u}_us']:7.1f} us ({units[f'pairs_{u}_us']:+.1f} "
            f"[{ci[0]:+.1f}, {ci[1]:+.1f}]) on a {units[f'step_{u}_ms']:.2f} ms step"  # type: ignore[index]
        )
    print(f"  per unit per step (slope {lo} -> {hi} units): {units['per_unit_us']:.1f} us")
    print(f"  per step, any model (intercept):              {units['per_step_us']:.1f} us")
    estimate = (units["per_step_us"] + STEP_UNITS * units["per_unit_us"]) / 1e3 / step["base_ms"]
    r, c = step["median_ratio"], step["median_ci"]
    m, mc = step["mean_ratio"], step["mean_ci"]
    print()
    print(f"whole step, 2 ranks, {STEP_UNITS} units, base {step['base_ms']:.1f} ms, {step['pairs']} pairs:")
    print(
        f"  per-step (median):      {100 * (r - 1):+.2f}% [{100 * (c[0] - 1):+.2f}, {100 * (c[1] - 1):+.2f}]"
    )
    print(
        f"  incl. gathers (mean):   {100 * (m - 1):+.2f}% [{100 * (mc[0] - 1):+.2f}, {100 * (mc[1] - 1):+.2f}]"
    )
    print(f"  from the per-unit cost: {100 * estimate:+.2f}%  (budget <= {100 * BUDGET:.0f}%)")
    return {"units": units, "step": step, "estimate": estimate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke size; numbers not meaningful")
    args = parser.parse_args(argv)
    run(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
