"""How the cross-rank machinery scales with the number of ranks: real processes up to 16, simulation beyond.

Three measurements:

1. **Real gathers** (W = 2, 4, 8, 16 spawned gloo processes on this machine, a tiny DDP model, interval 20):
   per gather, the time `Scope`'s exchange takes on rank 0 and on the other ranks (median over gathers, then
   over ranks), the time to create the scope's gloo group (as the scope creates it: lazy connections; and a
   full mesh, `TORCH_GLOO_LAZY_INIT=0`, for comparison; the slowest rank's), and the payload bytes each rank
   sends and receives per gather, computed from the tensors' sizes (`Gatherer.traffic`). With W processes
   on 2 cores, the times measure the machine's scheduling as much as the scope; the bytes are exact.
2. **Rank 0's ingest at scale** (W = 1,024, 4,096, 16,384 simulated ranks: synthetic rows, no processes):
   one interval of 50 steps from every rank goes through `LiveDiagnosis` as rank 0's ingest thread runs
   it: `record` (rows appended to the run on disk, counts and replica checks, live window) and `diagnose`
   (analysis over the live window, rules, and the metrics an integration's logger receives). Median over
   intervals 3-5 of 5 (imports, first page faults and the filling window come before), timed without
   tracemalloc; its peak (numpy buffers included) is taken over a second, identical pass.
3. **Heartbeat checks** against a real `torch.distributed.TCPStore` on loopback: W heartbeat keys kept fresh
   by 4 writer threads at the rate the watchdog's beat period gives W ranks (`beat_period`), while rank 0's
   check (`read_beats` in one `multi_get`, JSON, `classify_hang`: what rank 0 does each beat once it has
   itself made no progress for hang_timeout; before that it reads nothing) runs back to back; median time
   per check.

`--quick` runs W = 2, 4 / 1,024 / 1,024 in well under a minute (numbers not meaningful).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

STEPS_PER_INTERVAL = 50
TARGET_S = 0.5  # rank 0's ingest + live diagnosis of one interval at 16,384 ranks, on one core


# -- 1. real processes ------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, out: str, steps: int, interval: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pytscope_core import Scope

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scope = Scope(Path(out) / "run", interval=interval, console=False, hang_timeout=None)
    scope.watch(ddp, opt)
    for _ in range(steps):
        x = torch.randn(32, 16)
        loss = F.cross_entropy(ddp(x), (x[:, 0] > 0).long())
        loss.backward()
        opt.step()
        opt.zero_grad()
        scope.log(loss=loss)
    session = scope.session
    assert session is not None and scope.coordinator.gatherer is not None
    result: dict[str, Any] = {
        "gather_ms": list(session.gather_ms),  # interval gathers only: the final one comes at finish()
        "traffic": list(session.traffic),
        "create_lazy_ms": scope.coordinator.gatherer.create_ms,
    }
    scope.finish()
    dist.barrier()
    os.environ["TORCH_GLOO_LAZY_INIT"] = "0"  # a full mesh, as without the scope's choice
    t0 = time.perf_counter()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    result["create_mesh_ms"] = (time.perf_counter() - t0) * 1e3
    dist.destroy_process_group(group)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def real_gathers(world: int, steps: int, interval: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    from pytscope_core.demo import free_port

    with tempfile.TemporaryDirectory(prefix="pytscope-scale-") as tmp:
        args = (world, free_port(), tmp, steps, interval)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn", join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    others = results[1:]
    return {
        "world": world,
        "gathers": len(results[0]["gather_ms"]),
        "rank0_ms": statistics.median(results[0]["gather_ms"]),
        "others_ms": statistics.median(statistics.median(r["gather_ms"]) for r in others),
        "create_lazy_ms": max(r["create_lazy_ms"] for r in results),
        "create_mesh_ms": max(r["create_mesh_ms"] for r in results),
        "rank0_sent": statistics.median(s for s, _ in results[0]["traffic"]),
        "rank0_received": statistics.median(r for _, r in results[0]["traffic"]),
        "other_sent": max(s for r in others for s, _ in r["traffic"]),
        "other_received": max(v for r in others for _, v in r["traffic"]),
    }


# -- 2. rank 0's ingest at scale --------------------------------------------------------------------------------
def interval_rows(world: int, first_step: int, rng: np.random.Generator, slow_rank: int) -> np.ndarray:
    """One interval of every rank's rows, rank after rank as the gather delivers them."""
    from pytscope_core.records import COL, NCOLS, PHASE_COLS

    steps = np.arange(first_step, first_step + STEPS_PER_INTERVAL)
    rows = np.full((world, steps.size, NCOLS), np.nan)
    phases = np.exp(0.05 * rng.standard_normal((world, steps.size, 6))) * [0.3, 3.0, 5.0, 0.0, 0.5, 0.2]
    phases[slow_rank, :, 1:3] *= 1.3
    local = phases.sum(axis=2)
    phases[:, :, 3] = local.max(axis=0) - local + 1.5  # everyone waits for the slowest, plus the transfer
    rows[:, :, list(PHASE_COLS)] = phases
    rows[:, :, COL["rank"]] = np.arange(world)[:, None]
    rows[:, :, COL["segment"]] = 0
    rows[:, :, COL["step"]] = steps
    rows[:, :, COL["wall_ms"]] = phases.sum(axis=2)
    rows[:, :, COL["start_s"]] = 1.7e9 + steps * 0.012
    rows[:, :, COL["excluded_ms"]] = 0.0
    rows[:, :, COL["loss"]] = 2.0 * np.exp(-steps / 500.0)
    rows[:, :, COL["samples"]] = 32
    rows[:, :, COL["mem_bytes"]] = 2e9
    rows[:, :, COL["grad_syncs"]] = 1
    rows[:, :, COL["micro_batches"]] = 1
    return rows.reshape(-1, NCOLS)


def rank0_ingest(world: int, intervals: int = 5) -> dict[str, Any]:
    """Times without tracemalloc (it taxes every allocation), then the same again for the memory peak."""
    from pytscope_core.context import Segment
    from pytscope_core.live import LiveDiagnosis
    from pytscope_core.reporter import RunReporter

    rng = np.random.default_rng(world)
    batches = [interval_rows(world, 1 + i * STEPS_PER_INTERVAL, rng, world - 1) for i in range(intervals)]
    meta = {"world_size": world, "interval": STEPS_PER_INTERVAL, "warmup": 5, "device": "cpu"}
    out: dict[str, Any] = {"world": world, "rows_mib": batches[0].nbytes / 2**20}
    for traced in (False, True):
        record_s, diagnose_s = [], []
        with tempfile.TemporaryDirectory(prefix="pytscope-ingest-") as tmp:
            reporter = RunReporter(Path(tmp), meta, console=False)
            segment = Segment(0, time.time(), 0, world)
            live = LiveDiagnosis(reporter, segment, 5, [], metrics_sink=lambda m, s: None)
            if traced:
                tracemalloc.start()
            for i, rows in enumerate(batches):
                n = (i + 1) * STEPS_PER_INTERVAL
                headers = np.tile(
                    [float(n), float(n), float(n), float(STEPS_PER_INTERVAL), np.nan, np.nan], (world, 1)
                )
                t0 = time.perf_counter()
                live.record(headers, rows, i + 1, n)
                t1 = time.perf_counter()
                live.diagnose(n)
                live.publish_metrics(n)
                record_s.append(t1 - t0)
                diagnose_s.append(time.perf_counter() - t1)
            if traced:
                out["peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
                tracemalloc.stop()
            else:
                counted = slice(2, None)  # the first intervals pay imports, page faults and a filling window
                out["record_s"] = statistics.median(record_s[counted])
                out["diagnose_s"] = statistics.median(diagnose_s[counted])
                out["total_s"] = out["record_s"] + out["diagnose_s"]
                stragglers = [f.ranks for f in live.findings if f.code == "DIST.STRAGGLER"]
                out["straggler_found"] = stragglers == [(world - 1,)]
            reporter.close()
    return out


# -- 3. heartbeat checks against a real TCPStore ----------------------------------------------------------------
def heartbeat_checks(world: int, checks: int = 7, writers: int = 4, min_s: float = 3.0) -> dict[str, float]:
    import torch.distributed as dist

    from pytscope_core.watchdog import beat_period, classify_hang, read_beats

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys = [f"pytscope/0/hb/{r}" for r in range(1, world)]

    def beat(r: int) -> str:
        step = {
            "step": 1234,
            "origin": 1,
            "phase": "forward",
            "idle_s": 0.012,
            "syncs": 1234,
            "t": time.time(),
        }
        return json.dumps({**step, "rank": r})

    for r, k in enumerate(keys, start=1):
        server.set(k, beat(r))
    period = beat_period(world, None)
    stop = threading.Event()
    written = [0] * writers

    def write(i: int) -> None:  # each writer refreshes its share of the keys once per beat period, evenly
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        mine = list(range(i, len(keys), writers))
        gap = period / max(1, len(mine))
        due = time.perf_counter()
        while not stop.is_set():
            for j in mine:
                client.set(keys[j], beat(j + 1))
                written[i] += 1
                due += gap
                if stop.wait(max(0.0, due - time.perf_counter())):
                    return

    threads = [threading.Thread(target=write, args=(i,), daemon=True) for i in range(writers)]
    for t in threads:
        t.start()
    times, present = [], set()  # type: ignore[var-annotated]
    t_start = time.perf_counter()
    while len(times) < checks or time.perf_counter() - t_start < min_s:
        t0 = time.perf_counter()
        beats = {0: {"step": 1234, "phase": "forward", "idle_s": 0.0, "syncs": 1234, "age_s": 0.0}}
        now = time.time()
        for r, raw in read_beats(server, keys, present).items():
            b = json.loads(raw)
            b["age_s"] = max(0.0, now - float(b["t"]))
            beats[r + 1] = b
        assert classify_hang(beats, world, 120.0) is None and len(beats) == world
        times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    stop.set()
    for t in threads:
        t.join(5)
    return {
        "world": world,
        "check_ms": statistics.median(times[1:]) * 1e3,  # the first check also finds every key present
        "checks": len(times),
        "period_s": period,
        "store_ops_per_s": (sum(written) + len(times) * world) / elapsed,  # writes + keys read
        "budget_ops_per_s": 2 * world / period,  # every rank's beat + rank 0's read of it, per second
    }


# -- report ---------------------------------------------------------------------------------------------------
def _slope_per_1000(points: list[dict[str, Any]], key: str) -> float:
    w = np.array([p["world"] for p in points], dtype=float)
    y = np.array([p[key] for p in points], dtype=float)
    return float(np.polyfit(w, y, 1)[0] * 1000) if len(points) > 1 else float(y[0] / w[0] * 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    args = parser.parse_args(argv)
    real_worlds = (2, 4) if args.quick else (2, 4, 8, 16)
    sim_worlds = (1024,) if args.quick else (1024, 4096, 16384)
    steps, interval = (40, 20) if args.quick else (120, 20)
    out: dict[str, Any] = {}

    print(f"1. real gathers: W spawned gloo ranks, tiny DDP model, {steps} steps, interval {interval}")
    print(
        "   W   rank 0 ms  others ms  group lazy ms  group mesh ms  others sent B  others recv B  rank 0 recv B"
    )
    out["real"] = []
    for world in real_worlds:
        r = real_gathers(world, steps, interval)
        out["real"].append(r)
        print(
            f"  {world:2d}  {r['rank0_ms']:9.2f}  {r['others_ms']:9.2f}  {r['create_lazy_ms']:13.1f}  "
            f"{r['create_mesh_ms']:13.1f}  {r['other_sent']:13.0f}  {r['other_received']:13.0f}  "
            f"{r['rank0_received']:13.0f}"
        )
    received = {r["other_received"] for r in out["real"]}
    print(
        f"   bytes received per non-zero rank per interval: {sorted(received)} (constant in W: {len(received) == 1})"
    )

    print(f"2. rank 0's ingest of one {STEPS_PER_INTERVAL}-step interval, simulated ranks (one thread)")
    print("       W  record s  diagnose s  total s  rows MiB  peak MiB  straggler found")
    out["ingest"] = []
    for world in sim_worlds:
        r = rank0_ingest(world)
        out["ingest"].append(r)
        print(
            f"  {world:6d}  {r['record_s']:8.3f}  {r['diagnose_s']:10.3f}  {r['total_s']:7.3f}  "
            f"{r['rows_mib']:8.0f}  {r['peak_mib']:8.0f}  {r['straggler_found']}"
        )
    largest = out["ingest"][-1]
    if len(sim_worlds) > 1:  # a growth law needs more than one size (not with --quick)
        verdict = "met" if largest["total_s"] < TARGET_S else "MISSED"
        print(
            f"   growth: record {_slope_per_1000(out['ingest'], 'record_s') * 1e3:.1f} ms and diagnose "
            f"{_slope_per_1000(out['ingest'], 'diagnose_s') * 1e3:.1f} ms per 1,000 ranks per interval; "
            f"{largest['world']} ranks in {largest['total_s']:.2f} s (< {TARGET_S} s: {verdict})"
        )

    print("3. heartbeat checks on rank 0 against a TCPStore on loopback (4 writer threads)")
    print("   (check: what rank 0 reads once it has itself been stuck for hang_timeout; keys/s: the store's")
    print(
        "   throughput with checks back to back; watchdog keys/s: every rank's beat + one read, per period)"
    )
    print("       W  check ms  beat period s  store keys/s  watchdog keys/s")
    out["heartbeats"] = []
    for world in sim_worlds:
        r = heartbeat_checks(world)
        out["heartbeats"].append(r)
        print(
            f"  {world:6d}  {r['check_ms']:8.1f}  {r['period_s']:13.2f}  {r['store_ops_per_s']:12.0f}  "
            f"{r['budget_ops_per_s']:15.0f}"
        )
    if len(sim_worlds) > 1:
        print(f"   growth: {_slope_per_1000(out['heartbeats'], 'check_ms'):.1f} ms per 1,000 ranks per check")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
