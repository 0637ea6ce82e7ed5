"""Does the diagnosis find a slow rank, how soon, and does it stay quiet on healthy jobs and flat losses?

**Noise model** (simulated ranks), taken from real CPU runs in docs/MEASUREMENTS.md:

* local work per rank and step = 9.5 ms (item 10: healthy 2-rank Lightning local work 9.6 / 9.4 ms)
  x a per-rank fixed offset, lognormal sigma 0.012 (those two healthy medians differ by 2%)
  x a per-step factor shared by all ranks, lognormal sigma 0.03 (machine-wide jitter)
  x a per-rank per-step factor, lognormal sigma 0.04 (item 3: healthy runs have one rank ahead in 33-65% of
  steps with medians up to ~0.2 ms apart, which needs a per-step difference sd of ~0.5 ms)
  x a spike factor: with probability 1% a step of a rank takes 1.2-2x (GC, scheduler).
* exposed communication = transfer 2.0 ms (item 10: healthy blocked 2.0 / 2.0 ms), lognormal sigma 0.1,
  + the wait for the slowest rank of the step; so every rank's wall is the slowest local work + transfer.
* local work is split into data 5%, forward 30%, backward 50%, optimizer 10%, other 5%.

A straggler multiplies one random rank's local work by 1.02, 1.05, 1.10 or 1.20 among 4, 8 and 64 ranks. For
each seed the run is diagnosed on growing prefixes (every 25 steps up to 1,000, warm-up 5); "steps to
detection" is the first prefix where `DIST.STRAGGLER` names the slow rank. A finding that names another rank
counts as a misnamed detection. Healthy runs (no slowdown, 50 seeds per size) are diagnosed on every prefix
(what a live user sees) and at the end; any `DIST.STRAGGLER` there is false.

**Flat losses**: 1,000 curves of 500 steps at level 2.0 with Gaussian noise (sd 5%) and 1% upward spikes
(x1.5); one more family with AR(1) noise (phi 0.5). Called worsening = convergence trend "worsening", a
`CONVERGENCE.NO_PROGRESS` finding of HIGH severity (its "getting worse" form) or a rise after a fall.

**Early loss spikes**: 1,000 curves per shape of 120 counted steps, an exponential fall (0.3 + 2.0 exp(-t/tau),
tau 5, 15, 40) or flat at 2.0, Gaussian noise sd 5%; how often a spike is called before step 50 in the clean
curve, and how often one x2.5 step placed in steps 20-49 is found.

**Later loss spikes**: 1,000 curves per shape and noise of 300 counted steps, flat at 2.0 or still falling
(0.3 + 4.7 exp(-t/25), as a small model's first epoch; 5 / sqrt(t + 1)), with Gaussian noise of sd 5% or 20%, or
right-skewed noise (gamma, sd 30%, as a converged cross-entropy's batches); how often a spike is called from
step 50 on in the clean curve, and how often one x2.5 or x5 step placed in steps 50-299 is found there.

**Plateaus**: 1,000 curves per noise level (sd 1%, 5%, 10%, 20%) of 600 counted steps that fall (0.5 + 3.0
exp(-t/25)) until step 150 and stay flat after; how often "stopped improving" is said, and how far from step
150 it places the start. And 1,000 curves per noise level and shape that still fall to the end over 1,000
steps: two power laws (2.0 + 3.0 t^-0.3, as language models fall, and 0.5 + 3.0 t^-0.5), an exponential
(0.3 + 2.0 exp(-t/300)) and a straight line (3.0 - 0.002 t): a plateau said there is false.

**Rises after a fall**: 1,000 curves per noise level that fall as the plateau's, sit flat until step 300 and
then rise linearly by 20% by step 600; how often "rising since" is said, and how far from step 300 it places
the turn. A rise said on the fell-then-flat curves above (with independent noise, and with slowly wandering
AR(1) noise, phi 0.9), or on the still-falling ones, is false.

**Real gloo runs**: 2 spawned processes train a small DDP MLP under `Scope`; rank 1 busy-waits every step
for the slowdown x its own plain step time (measured before training, same on both ranks); the run
directory is then diagnosed on growing prefixes like the simulations. Each slowdown runs `--gloo-runs` times
(3): on 2 shared cores a run's ranks differ by more than a 5-10% delay from run to run (the other rank, the
ingest thread and the watchdog share the cores), so one run says little. Each run prints the local-work gap
it measured next to the delay injected.

Budgets (SPEC 9): 10% among 4 found within 200 steps; no false straggler; under 1% false worsening.
Slowdowns below the straggler rule's 4.5% excess floor (analysis/distributed.py) are not reported by design.
`--quick` runs a smoke size.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LOCAL_MS = 9.5
RANK_SIGMA = 0.012
SHARED_SIGMA = 0.03
STEP_SIGMA = 0.04
SPIKE_P = 0.01
TRANSFER_MS = 2.0
TRANSFER_SIGMA = 0.1
SPLIT = np.array([0.05, 0.30, 0.50, 0.0, 0.10, 0.05])  # data, forward, backward, (comm), optimizer, other
COMM = 3
WARMUP = 5


@dataclass
class Detection:
    ranks: int
    slowdown: float
    seeds: int
    found_by_200: int = 0
    found: int = 0
    misnamed: int = 0
    steps_to_detect: list[int] | None = None


def simulate(steps: int, ranks: int, slowdown: float, slow_rank: int, rng: np.random.Generator) -> np.ndarray:
    """(steps, ranks, 6) float32 phases in ms under the noise model in the module docstring."""
    offset = np.exp(RANK_SIGMA * rng.standard_normal(ranks))
    shared = np.exp(SHARED_SIGMA * rng.standard_normal((steps, 1)))
    own = np.exp(STEP_SIGMA * rng.standard_normal((steps, ranks)))
    spikes = np.where(rng.random((steps, ranks)) < SPIKE_P, rng.uniform(1.2, 2.0, (steps, ranks)), 1.0)
    local = LOCAL_MS * offset * shared * own * spikes
    local[:, slow_rank] *= 1.0 + slowdown
    transfer = TRANSFER_MS * np.exp(TRANSFER_SIGMA * rng.standard_normal((steps, 1)))
    comm = transfer + (local.max(axis=1, keepdims=True) - local)
    phases = local[:, :, None] * SPLIT
    phases[:, :, COMM] = comm
    return phases.astype(np.float32)


def straggler_ranks(phases: np.ndarray, loss: np.ndarray | None = None) -> tuple[int, ...] | None:
    """The ranks DIST.STRAGGLER names for these phases, or None when it does not fire."""
    from pytscope_core.analysis import diagnose
    from pytscope_core.arrays import RunArrays
    from pytscope_core.context import RunContext

    arrays = RunArrays.from_arrays(phases, loss=loss, warmup=WARMUP)
    for f in diagnose(arrays, RunContext(world_size=phases.shape[1], warmup=WARMUP)):
        if f.code == "DIST.STRAGGLER":
            return f.ranks
    return None


def first_detection(phases: np.ndarray, slow_rank: int, every: int) -> tuple[int | None, bool]:
    """(first prefix length naming `slow_rank`, whether another rank was named before that)."""
    misnamed = False
    for n in range(every, phases.shape[0] + 1, every):
        named = straggler_ranks(phases[:n])
        if named is None:
            continue
        if slow_rank in named and len(named) == 1:
            return n, misnamed
        misnamed = True
    return None, misnamed


def detection_sweep(
    sizes: list[int], slowdowns: list[float], seeds: int, steps: int, every: int
) -> list[Detection]:
    out = []
    for ranks in sizes:
        for slowdown in slowdowns:
            d = Detection(ranks, slowdown, seeds, steps_to_detect=[])
            for seed in range(seeds):
                rng = np.random.default_rng([ranks, int(slowdown * 1000), seed])
                slow_rank = int(rng.integers(ranks))
                n, misnamed = first_detection(
                    simulate(steps, ranks, slowdown, slow_rank, rng), slow_rank, every
                )
                d.misnamed += misnamed
                if n is not None:
                    d.found += 1
                    d.found_by_200 += n <= 200
                    assert d.steps_to_detect is not None
                    d.steps_to_detect.append(n)
            out.append(d)
            print(f"  {ranks:3d} ranks, +{100 * slowdown:4.0f}%: {_detection_text(d)}", flush=True)
    return out


def _detection_text(d: Detection) -> str:
    steps = d.steps_to_detect or []
    med = f"median {statistics.median(steps):.0f} steps" if steps else "never"
    return f"found {d.found}/{d.seeds} (by step 200: {d.found_by_200}/{d.seeds}), {med} to detection" + (
        f", another rank named first in {d.misnamed}" if d.misnamed else ""
    )


def false_stragglers(sizes: list[int], seeds: int, steps: int, every: int) -> dict[int, tuple[int, int]]:
    """Per size: (healthy seeds flagged at the end, healthy seeds flagged on any prefix)."""
    out = {}
    for ranks in sizes:
        at_end = any_prefix = 0
        for seed in range(seeds):
            rng = np.random.default_rng([ranks, 7777, seed])
            phases = simulate(steps, ranks, 0.0, 0, rng)
            at_end += straggler_ranks(phases) is not None
            any_prefix += any(straggler_ranks(phases[:n]) is not None for n in range(every, steps + 1, every))
        out[ranks] = (at_end, any_prefix)
        print(
            f"  {ranks:3d} ranks healthy: false DIST.STRAGGLER at the end {at_end}/{seeds}, on any prefix {any_prefix}/{seeds}",
            flush=True,
        )
    return out


def false_worsening(curves: int, steps: int, phi: float) -> int:
    from pytscope_core.analysis import analyze, run_rules
    from pytscope_core.arrays import RunArrays
    from pytscope_core.context import RunContext
    from pytscope_core.findings import Severity

    worse = 0
    rng = np.random.default_rng([4242, int(phi * 100)])
    phases = simulate(steps, 2, 0.0, 0, rng)
    for _ in range(curves):
        e = rng.standard_normal(steps)
        if phi:
            for i in range(1, steps):
                e[i] += phi * e[i - 1]
            e *= np.sqrt(1 - phi**2)  # keep the marginal sd at 5%
        loss = 2.0 * (1 + 0.05 * e)
        loss *= np.where(rng.random(steps) < SPIKE_P, 1.5, 1.0)
        a = analyze(
            RunArrays.from_arrays(phases, loss=loss, warmup=WARMUP), RunContext(world_size=2, warmup=WARMUP)
        )
        high = any(f.code == "CONVERGENCE.NO_PROGRESS" and f.severity == Severity.HIGH for f in run_rules(a))
        worse += a.convergence.trend.trend == "worsening" or high or a.convergence.rise is not None
    return worse


def early_spikes(curves: int, tau: float | None) -> tuple[int, int]:
    """Early training: 120 counted steps of 0.3 + 2.0 exp(-t / tau) (flat at 2.0 when tau is None), Gaussian
    noise of sd 5%. Returns (curves with a spike found before SPIKE_WINDOW steps: false alarms, curves whose
    loss x2.5 at a random step in [SPIKE_MIN_HISTORY, SPIKE_WINDOW) was found there)."""
    from pytscope_core.analysis.convergence import SPIKE_MIN_HISTORY, SPIKE_WINDOW, find_spikes

    rng = np.random.default_rng([77, int(tau or 0)])
    t = np.arange(120)
    level = np.full(t.size, 2.0) if tau is None else 0.3 + 2.0 * np.exp(-t / tau)
    false = found = 0
    for _ in range(curves):
        loss = level * (1 + 0.05 * rng.standard_normal(t.size))
        false += any(s.step < SPIKE_WINDOW for s in find_spikes(loss, t))
        at = int(rng.integers(SPIKE_MIN_HISTORY, SPIKE_WINDOW))
        loss[at] *= 2.5
        found += any(s.step == at for s in find_spikes(loss, t))
    return false, found


LATER_T = np.arange(300)
LATER_SHAPES = {
    "flat": np.full(LATER_T.size, 2.0),
    "exp(-t/25)": 0.3 + 4.7 * np.exp(-LATER_T / 25),
    "1/sqrt(t)": 5.0 / np.sqrt(LATER_T + 1),
}


def later_spikes(curves: int, shape: str, noise: str) -> tuple[int, int, int]:
    """Later training: 300 counted steps of one of LATER_SHAPES times noise "5%" or "20%" (Gaussian) or
    "skewed" (gamma, sd 30%, mean 1). Returns (curves with a spike found from SPIKE_WINDOW on: false alarms,
    curves whose loss x2.5 at a random step in [SPIKE_WINDOW, 300) was found there, the same for x5)."""
    from pytscope_core.analysis.convergence import SPIKE_WINDOW, find_spikes

    rng = np.random.default_rng([78, len(shape), len(noise)])
    t, level = LATER_T, LATER_SHAPES[shape]
    false, found = 0, {2.5: 0, 5.0: 0}
    for _ in range(curves):
        if noise == "skewed":
            loss = level * rng.gamma(1 / 0.3**2, 0.3**2, t.size)
        else:
            loss = level * (1 + float(noise.rstrip("%")) / 100 * rng.standard_normal(t.size))
        false += any(s.step >= SPIKE_WINDOW for s in find_spikes(loss, t))
        at = int(rng.integers(SPIKE_WINDOW, t.size))
        for factor in found:
            spiked = loss.copy()
            spiked[at] *= factor
            found[factor] += any(s.step == t[at] for s in find_spikes(spiked, t))
    return false, found[2.5], found[5.0]


def plateaus(curves: int, noise: float) -> tuple[int, float, int]:
    """(fell-then-flat curves with a plateau found, median |found start - 150| in steps, still-falling curves
    (four shapes, `curves` each) with a plateau said)."""
    from pytscope_core.analysis.convergence import plateau_start

    rng = np.random.default_rng([99, int(noise * 1000)])
    t = np.arange(600)
    fell = np.where(t < 150, 0.5 + 3.0 * np.exp(-t / 25), 0.5 + 3.0 * np.exp(-150 / 25))
    found, errors = 0, []
    for _ in range(curves):
        p = plateau_start(fell * (1 + noise * rng.standard_normal(t.size)))
        if p is not None:
            found += 1
            errors.append(abs(p[0] - 150))
    t = np.arange(1, 1001)
    false = 0
    for level in (2.0 + 3.0 * t**-0.3, 0.5 + 3.0 * t**-0.5, 0.3 + 2.0 * np.exp(-t / 300), 3.0 - 0.002 * t):
        for _ in range(curves):
            false += plateau_start(level * (1 + noise * rng.standard_normal(t.size))) is not None
    return found, float(np.median(errors)) if errors else math.nan, false


WANDER_PHI = 0.9


def rises(curves: int, noise: float) -> tuple[int, float, int, int, int]:
    """(curves that fell, sat flat until step 300 and then rose 20% by step 600 with a rise found, median
    |found turn - 300| in steps, fell-then-flat curves with a rise said: with independent noise and with
    slowly wandering noise (AR(1), WANDER_PHI), still-falling curves (four shapes, `curves` each) with a rise
    said)."""
    from pytscope_core.analysis.convergence import rise_start

    rng = np.random.default_rng([77, int(noise * 1000)])
    t = np.arange(600)
    fell = np.where(t < 150, 0.5 + 3.0 * np.exp(-t / 25), 0.5 + 3.0 * np.exp(-150 / 25))
    rose = np.where(t < 300, fell, fell[-1] * (1 + 0.2 * (t - 300) / 300))
    found, errors, false_flat, false_wander = 0, [], 0, 0
    for _ in range(curves):
        r = rise_start(rose * (1 + noise * rng.standard_normal(t.size)))
        if r is not None:
            found += 1
            errors.append(abs(r.step - 300))
        false_flat += rise_start(fell * (1 + noise * rng.standard_normal(t.size))) is not None
        e = rng.standard_normal(t.size)
        for i in range(1, t.size):
            e[i] += WANDER_PHI * e[i - 1]
        false_wander += rise_start(fell * (1 + noise * np.sqrt(1 - WANDER_PHI**2) * e)) is not None
    t = np.arange(1, 1001)
    false_falling = 0
    for level in (2.0 + 3.0 * t**-0.3, 0.5 + 3.0 * t**-0.5, 0.3 + 2.0 * np.exp(-t / 300), 3.0 - 0.002 * t):
        for _ in range(curves):
            false_falling += rise_start(level * (1 + noise * rng.standard_normal(t.size))) is not None
    return found, float(np.median(errors)) if errors else math.nan, false_flat, false_wander, false_falling


# -- real 2-rank gloo runs --------------------------------------------------------------------------------------


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _gloo_worker(rank: int, world: int, port: int, slowdown: float, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pytscope_core.demo import demo_model
    from pytscope_core.scope import Scope

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = demo_model()
        gen = torch.Generator().manual_seed(rank)
        batches = [
            (torch.randn(256, 64, generator=gen), torch.randint(0, 10, (256,), generator=gen))
            for _ in range(16)
        ]
        # This rank's own plain step time, before DDP: the busy-wait is a share of it.
        plain_opt = torch.optim.SGD(model.parameters(), lr=0.0)
        times = []
        for x, y in batches * 2:
            t0 = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            plain_opt.step()
            plain_opt.zero_grad()
            times.append((time.perf_counter() - t0) * 1e3)
        spin_ms = slowdown * statistics.median(times[5:]) if rank == world - 1 else 0.0
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        loader = [batches[i % len(batches)] for i in range(steps)]
        scope = Scope(Path(out) / "run", interval=50, console=False)
        scope.watch(ddp, opt)
        for x, y in loader:
            if spin_ms:
                _spin(spin_ms)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            scope.log(loss=loss)
        scope.finish()
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({"spin_ms": spin_ms, "errors": scope.errors}))
    finally:
        dist.destroy_process_group()


def gloo_run(slowdown: float, steps: int, every: int, tmp: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from pytscope_core.demo import free_port
    from pytscope_core.rundir import load_run

    out = tmp / f"gloo-{int(slowdown * 100)}"
    out.mkdir(parents=True)
    mp.start_processes(
        _gloo_worker,
        args=(2, free_port(), slowdown, steps, str(out)),
        nprocs=2,
        start_method="spawn",
        join=True,
    )
    info = json.loads((out / "rank1.json").read_text())
    run = load_run(out / "run")
    phases = run.arrays.phases
    local = run.arrays.local_ms[run.arrays.counted]
    first, misnamed = first_detection(phases, 1, every)
    return {
        "slowdown": slowdown,
        "spin_ms": info["spin_ms"],
        "local_ms": [float(np.nanmedian(local[:, r])) for r in range(local.shape[1])],
        "named_at_end": straggler_ranks(phases),
        "first": first,
        "misnamed": misnamed,
        "errors": info["errors"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke size")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per (ranks, slowdown)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the real 2-rank runs")
    parser.add_argument("--gloo-runs", type=int, default=None, help="real 2-rank runs per slowdown (3)")
    parser.add_argument(
        "--loss-only",
        action="store_true",
        help="only the loss checks (worsening, early and later spikes, plateaus, rises)",
    )
    args = parser.parse_args(argv)
    q = args.quick
    sizes = [4, 8] if q else [4, 8, 64]
    slowdowns = [0.10] if q else [0.02, 0.05, 0.10, 0.20]
    seeds = args.seeds or (3 if q else 20)
    steps, every = (200, 25) if q else (1000, 25)
    healthy_seeds = 5 if q else 50
    curves = 50 if q else 1000

    print(
        f"noise model: local {LOCAL_MS} ms x rank offset (sigma {RANK_SIGMA}) x shared (sigma {SHARED_SIGMA}) x own "
        f"(sigma {STEP_SIGMA}) x spikes (p {SPIKE_P}, 1.2-2x); transfer {TRANSFER_MS} ms (sigma {TRANSFER_SIGMA})"
    )
    t0 = time.perf_counter()
    results: list[Detection] = []
    false: dict[int, tuple[int, int]] = {}
    if not args.loss_only:
        print(f"straggler detection: {seeds} seeds, diagnosed every {every} steps up to {steps}")
        results = detection_sweep(sizes, slowdowns, seeds, steps, every)
        print(f"false stragglers: {healthy_seeds} healthy seeds per size, {steps} steps")
        false = false_stragglers(sizes, healthy_seeds, steps, every)
    print(f"flat noisy losses: {curves} curves of 500 steps per family")
    worse_iid = false_worsening(curves, 500, 0.0)
    worse_ar = false_worsening(curves, 500, 0.5)
    print(
        f"  called worsening: iid {worse_iid}/{curves} ({100 * worse_iid / curves:.1f}%), AR(1) 0.5 {worse_ar}/{curves} ({100 * worse_ar / curves:.1f}%)"
    )
    print(
        f"early loss spikes: {curves} curves of 120 steps per shape, 5% noise, one x2.5 spike in steps 20-49"
    )
    for tau in (5.0, 15.0, 40.0, None):
        false_early, found = early_spikes(curves, tau)
        shape = "flat" if tau is None else f"exp(-t/{tau:.0f})"
        print(
            f"  {shape:>11}: spike found {100 * found / curves:5.1f}%; a spike called where there is none "
            f"(steps < 50) {100 * false_early / curves:.1f}%"
        )
    print(
        f"later loss spikes: {curves} curves of 300 steps per shape and noise, one x2.5 or x5 spike in steps 50-299"
    )
    for shape in LATER_SHAPES:
        for noise in ("5%", "20%", "skewed"):
            false_later, low, high = later_spikes(curves, shape, noise)
            print(
                f"  {shape:>10}, {noise:>6} noise: x2.5 found {100 * low / curves:5.1f}%, x5 {100 * high / curves:5.1f}%; "
                f"a spike called where there is none (steps >= 50) {100 * false_later / curves:.1f}%"
            )
    for noise in (0.01, 0.05, 0.10, 0.20):
        found, error, false_plateau = plateaus(curves, noise)
        print(
            f"  plateaus, {100 * noise:.0f}% noise: fell then flat from step 150, said {100 * found / curves:.1f}% "
            f"(start off by a median {error:.0f} steps); still falling, said {false_plateau}/{4 * curves}"
        )
    for noise in (0.01, 0.05, 0.10, 0.20):
        found, error, false_flat, false_wander, false_falling = rises(curves, noise)
        print(
            f"  rises, {100 * noise:.0f}% noise: fell, flat, then up 20% from step 300, said {100 * found / curves:.1f}% "
            f"(turn off by a median {error:.0f} steps); fell then flat, said {false_flat}/{curves} (AR(1) "
            f"{WANDER_PHI} noise: {false_wander}/{curves}); still falling, said {false_falling}/{4 * curves}"
        )
    print(f"  (simulations took {time.perf_counter() - t0:.1f} s)")

    gloo: list[dict[str, Any]] = []
    if not (args.no_gloo or args.loss_only):
        runs = args.gloo_runs or (1 if q else 3)
        print(
            f"real 2-rank gloo runs (rank 1 busy-waits slowdown x its plain step time), {runs} per slowdown"
        )
        with tempfile.TemporaryDirectory(prefix="pytscope-detect-") as tmp:
            for slowdown in [0.10] if q else [0.0, 0.02, 0.05, 0.10, 0.20]:
                for i in range(runs):
                    r = gloo_run(slowdown, 150 if q else 400, every, Path(tmp) / str(i))
                    gloo.append(r)
                    local = " / ".join(f"{v:.2f}" for v in r["local_ms"])
                    print(
                        f"  +{100 * slowdown:3.0f}% (spin {r['spin_ms']:.2f} ms): local work {local} ms (gap "
                        f"{r['local_ms'][1] - r['local_ms'][0]:+.2f}); DIST.STRAGGLER at the end names "
                        f"{list(r['named_at_end']) if r['named_at_end'] else 'nobody'}; first named rank 1 at step "
                        f"{r['first']}"
                        + ("; rank 0 named first" if r["misnamed"] else "")
                        + (f"; errors {r['errors']}" if r["errors"] else ""),
                        flush=True,
                    )

    print()
    print("verdicts")
    ten4 = next((d for d in results if d.ranks == 4 and d.slowdown == 0.10), None)
    if ten4 is not None:
        ok = ten4.found_by_200 == ten4.seeds and not ten4.misnamed
        print(
            f"  10% among 4 found within 200 steps: {ten4.found_by_200}/{ten4.seeds} seeds: {'met' if ok else 'MISSED'}"
        )
    total_false = sum(v[1] for v in false.values())
    if false:
        print(
            f"  no false DIST.STRAGGLER (any prefix, all sizes): {total_false} false: {'met' if total_false == 0 else 'MISSED'}"
        )
    print(
        f"  under 1% false worsening (iid): {100 * worse_iid / curves:.1f}%: {'met' if worse_iid < 0.01 * curves else 'MISSED'}"
    )
    ten = [r for r in gloo if r["slowdown"] == 0.10]
    if ten:
        named = sum(r["named_at_end"] == (1,) and r["first"] is not None and r["first"] <= 200 for r in ten)
        print(
            f"  real gloo 10%: rank 1 named by step 200 and at the end in {named}/{len(ten)} runs: "
            f"{'met' if named == len(ten) else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
