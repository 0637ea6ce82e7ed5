"""Real 2-rank gloo jobs under FSDP2 (`fully_shard`): the torch-level Scope and Lightning's ModelParallelStrategy,
plus a tensor-parallel job whose communication pytscope does not measure. Assertions read the run directory.

Timing assertions compare the ranks of one run, with effects injected by busy-waiting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import fsdp_worker
import numpy as np
import pytest
import torch.multiprocessing as mp

from pytscope_core.demo import free_port
from pytscope_core.records import COL
from pytscope_core.rundir import load_run, read_events, read_rows
from pytscope_core.summary import summarize
from pytscope_core.watchdog import HANG_EXIT_CODE, classify_hang

pytestmark = pytest.mark.multiproc

QUICK = dict(width=256, batch=256, blocks=2, repeat=1)  # a few ms per step: for what is not about timing
ROOT = Path(__file__).resolve().parents[1]


def report(path):
    run = load_run(path)
    return summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings)).to_dict()


def codes(summary, severities=("HIGH", "MED")):
    return {f["code"] for f in summary["findings"] if f["severity"] in severities}


def test_rank_slowed_by_a_fifth_is_named_and_the_fast_ranks_wait_inside_fsdp_is_sync_wait(tmp_path):
    # Persistence (>= 70% of steps slower, z >= 3) must hold with another process on the cores: there a
    # tenth was slower in only 66-80% of the 120 steps (failed 2 runs in 7), so the effect is a fifth. Most
    # of each step is work of a fixed wall time (MEASUREMENTS item 11): rank 1 slower in 99% of steps, 4 of 4.
    fsdp_worker.run(2, dict(run_dir=str(tmp_path), steps=120, batch=256, work_ms=100.0, slow_fraction=0.20))
    s = report(tmp_path)
    assert s["run"]["parallelism"] == "fsdp2" and s["run"]["comm_measured"] is True
    assert s["run"]["steps"] == 120 and s["scope"]["errors"] == []
    assert s["timing"]["phases"]["comm"]["share"] > 0.02  # FSDP's waits are no longer forward or backward
    assert s["distributed"]["stragglers"] == [1]
    straggler = [f for f in s["findings"] if f["code"] == "DIST.STRAGGLER"]
    assert straggler and straggler[0]["ranks"] == [1] and straggler[0]["severity"] in ("HIGH", "MED")
    fast, slow = s["distributed"]["per_rank"]
    lag = slow["local_ms"] - fast["local_ms"]
    print(f"local work {fast['local_ms']:.1f} / {slow['local_ms']:.1f} ms, comm {fast['comm_ms']:.1f} / "
          f"{slow['comm_ms']:.1f} ms, sync wait {fast['sync_wait_ms']:.1f} / {slow['sync_wait_ms']:.1f} ms")  # fmt: skip
    assert lag > 0.04 * fast["local_ms"]
    # Rank 0 waits for rank 1 in the all-gathers and reduce-scatters: its extra comm is sync wait, and the
    # transfer estimate stays what the last rank to arrive pays.
    # (Medians of noisy per-step values on shared cores: the step means below are the tighter check.)
    assert fast["sync_wait_ms"] > 0.5 * lag and slow["sync_wait_ms"] < 0.3 * lag, s["distributed"]
    assert s["distributed"]["transfer_ms"] < fast["comm_ms"] - 0.5 * lag
    arrays = load_run(tmp_path).arrays
    comm, local = arrays.comm_ms[arrays.counted], (arrays.wall_ms - arrays.comm_ms)[arrays.counted]
    assert np.mean(comm[:, 0] - comm[:, 1]) > 0.8 * np.mean(local[:, 1] - local[:, 0])
    rows = read_rows(tmp_path)
    assert (rows[:, COL["grad_syncs"]] == 1).all()  # one reduce-scatter round per step, on both ranks


def test_healthy_fsdp_run_is_clean(tmp_path):
    # Work of a fixed wall time on both ranks (MEASUREMENTS item 11): the ranks' median local work within 0.3%
    # in 4 runs, against up to 2.5% in 8 with the default matmul-only steps.
    fsdp_worker.run(2, dict(run_dir=str(tmp_path), steps=60, batch=256, work_ms=100.0))
    s = report(tmp_path)
    assert s["run"]["steps"] == 60 and s["timing"]["steps_counted"] >= 50
    phases = s["timing"]["phases"]
    assert phases["comm"]["share"] > 0.02
    # Backward begins inside the wait for the root's all-gather (FSDP's pre-backward hook on the output runs
    # before the output's pre-hook): it resumes after that wait (9.6% here), and is not `other` (was 0.0%).
    assert phases["backward"]["share"] > 0.03 and phases["other"]["share"] < phases["backward"]["share"]
    assert s["distributed"]["stragglers"] == []
    # Step-time jitter on two shared cores is real machine noise, not a false alarm about the job (test_ddp).
    assert codes(s) - {"TIMING.JITTER"} == set(), s["findings"]


def median_phases(rows, rank, first_step=5):
    """A rank's median ms per phase over its steps after warm-up."""
    mine = rows[(rows[:, COL["rank"]] == rank) & (rows[:, COL["step"]] >= first_step)]
    return {p: float(np.median(mine[:, COL[f"{p}_ms"]])) for p in ("backward", "comm", "other")}


def test_a_root_whose_output_is_its_last_units_times_backward_and_the_work_after_the_step(tmp_path):
    # No output layer: the root's output is its last block's, so that tensor carries both units' hooks. Two
    # begins before either end left one FSDP wait open to the end of backward; with the loop's own top it
    # stayed open past the optimizer step, so the work after it (40 ms here) was comm, not other (0.3 ms).
    fsdp_worker.run(
        2, dict(run_dir=str(tmp_path), steps=40, head=False, backward_ms=60.0, after_step_ms=40.0, **QUICK)
    )
    s = report(tmp_path)
    assert s["run"]["steps"] == 40 and s["scope"]["errors"] == []
    rows = read_rows(tmp_path)
    fast, slow = median_phases(rows, 0), median_phases(rows, 1)
    assert fast["other"] > 30 and slow["other"] > 30, (fast, slow)
    assert slow["backward"] > 45 and slow["backward"] - fast["backward"] > 30, (fast, slow)
    assert s["distributed"]["stragglers"] == [1]


def test_rank_that_stops_at_step_30_is_named_in_the_hang(tmp_path):
    start = time.monotonic()
    with pytest.raises(mp.ProcessExitedException) as info:
        fsdp_worker.run(2, dict(run_dir=str(tmp_path), steps=60, block_at=30, hang_timeout=5.0, **QUICK))
    assert info.value.exit_code == HANG_EXIT_CODE
    assert time.monotonic() - start < 60
    s = report(tmp_path)
    hang = [f for f in s["findings"] if f["code"] == "DIST.HANG"]
    # Rank 0 waits in the root's all-gather of step 30: "waiting in a collective", so rank 1 is the one named.
    assert hang and hang[0]["ranks"] == [1] and hang[0]["steps"] == [30], hang
    assert "rank 0" in hang[0]["detail"] and "waiting in the FSDP all-gather" in hang[0]["detail"]
    assert [f["code"] for f in s["findings"] if f["severity"] == "HIGH"] == ["DIST.HANG"], s["findings"]
    arrays = load_run(tmp_path).arrays
    assert [int(arrays.steps[np.isfinite(arrays.wall_ms[:, i])].max()) for i in range(2)] == [29, 29]


def test_a_hang_in_an_fsdp_collective_does_not_call_a_forward_all_gather_gradient_sync():
    # A heartbeat's "collective" may be the forward's all-gather (a peer stuck fetching its batch): the title
    # read "the 30th FSDP all-gather or reduce-scatter of gradient sync".
    beat = {"step": 29, "phase": "collective", "idle_s": 400.0, "syncs": 29}
    f = classify_hang({0: beat, 1: {**beat, "phase": "data"}}, 2, 10.0)
    assert (
        f is not None and f.title == "rank 1 never reached the 30th FSDP all-gather and reduce-scatter round"
    )
    assert "gradient sync" not in f.title + f.detail


def test_a_rank_that_skipped_its_backward_is_named_not_the_network(tmp_path):
    # Rank 1 `continue`s after its loss at step 30: it waits in the next batch's forward all-gather, rank 0 in
    # its backward's reduce-scatter, both at step 30 with the same gradient syncs. It read as one stuck
    # collective ("network, NCCL/gloo"), naming nobody.
    with pytest.raises(mp.ProcessExitedException) as info:
        fsdp_worker.run(
            2, dict(run_dir=str(tmp_path), steps=60, skip_backward_at=30, hang_timeout=5.0, **QUICK)
        )
    assert info.value.exit_code == HANG_EXIT_CODE
    hang = [e["finding"] for e in read_events(tmp_path)[0] if e["type"] == "hang"]
    assert hang and hang[0]["ranks"] == [1] and hang[0]["steps"] == [30], hang
    assert "waits in a collective the others are not in" in hang[0]["title"], hang[0]["title"]
    assert "ran a forward where the others ran a backward" in hang[0]["detail"], hang[0]["detail"]
    assert "in its 1st forward's backward" in hang[0]["detail"] and "network" not in hang[0]["detail"]


def test_gradient_accumulation_is_one_step_per_window_and_the_ranks_stay_in_step(tmp_path):
    # Four micro-batches per step, reduce-scatter on the last only; gathers every 10 steps meet on the
    # count of reduce-scatter rounds, which must stay equal on both ranks.
    fsdp_worker.run(2, dict(run_dir=str(tmp_path), steps=30, accumulate=4, interval=10, **QUICK))
    s = report(tmp_path)
    assert s["run"]["steps"] == 30 and s["scope"]["errors"] == []
    assert "DIST.DESYNC" not in codes(s, ("HIGH", "MED", "LOW"))
    rows = read_rows(tmp_path)
    assert rows.shape[0] == 60
    assert (rows[:, COL["micro_batches"]] == 4).all() and (rows[:, COL["grad_syncs"]] == 1).all()
    assert (rows[:, COL["comm_ms"]] > 0).all()  # every micro-batch's all-gathers are comm
    phases = rows[:, [COL[f"{p}_ms"] for p in ("data", "forward", "backward", "comm", "optimizer", "other")]]
    np.testing.assert_allclose(phases.sum(axis=1), rows[:, COL["wall_ms"]], rtol=1e-9, atol=1e-6)
    assert not [e for e in read_events(tmp_path)[0] if e.get("type") == "counts_check"]


def test_tensor_parallel_job_says_communication_is_not_measured_instead_of_guessing(tmp_path, capfd):
    # Rank 1 is much slower, but its peer waits for it inside tensor-parallel all-reduces pytscope does not
    # time: no straggler verdict (in either direction), and every report says why.
    fsdp_worker.run(
        2, dict(run_dir=str(tmp_path), steps=30, wrapper="tp", spin_ms=15.0, console=True, **QUICK)
    )
    live = capfd.readouterr().out
    assert live.count("communication not measured") >= 1 and "tensor-parallel" in live
    s = report(tmp_path)
    assert s["run"]["parallelism"] == "tensor_parallel" and s["run"]["comm_measured"] is False
    assert "not measured" in s["run"]["comm_note"]
    assert s["timing"]["phases"]["comm"]["share"] is None
    assert s["distributed"]["stragglers"] == [] and s["distributed"]["per_rank"][1]["local_ms"] is None
    assert not {"DIST.STRAGGLER", "DIST.LOAD_IMBALANCE", "DIST.COMM_BOUND"} & codes(s, ("HIGH", "MED", "LOW"))
    budget = {x["name"]: x for x in s["efficiency"]["budget"]}
    assert budget["sync wait (imbalance)"]["measured"] is False and "useful compute" not in budget
    text = (tmp_path / "summary.txt").read_text()
    assert text.count("not measured") >= 4  # run summary, comm phase, distributed, budget lines


def run_lightning_fsdp_job(tmp_path, *args):
    """tests/scripts/lightning_fsdp_job.py with `args`, to the end; its run directory."""
    pytest.importorskip("lightning")
    run_dir = tmp_path / "run"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    script = ROOT / "tests" / "scripts" / "lightning_fsdp_job.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--run-dir", str(run_dir), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "scope disabled" not in proc.stderr and "not measured" not in proc.stderr
    return run_dir


def test_lightning_model_parallel_strategy_goes_through_the_same_path(tmp_path):
    run_dir = run_lightning_fsdp_job(tmp_path, "--steps", "40", "--spin-ms", "40")
    s = report(run_dir)
    assert s["run"]["parallelism"] == "fsdp2" and s["run"]["comm_measured"] is True
    assert s["timing"]["phases"]["comm"]["share"] > 0.02
    assert s["distributed"]["stragglers"] == [1]
    fast, slow = s["distributed"]["per_rank"]
    assert fast["sync_wait_ms"] > 0.5 * (slow["local_ms"] - fast["local_ms"]) > 5
    rows = read_rows(run_dir)
    for rank in (0, 1):  # Lightning's global_step, and one reduce-scatter round per step on each rank
        mine = rows[rows[:, COL["rank"]] == rank]
        assert (
            sorted(mine[:, COL["step"]].tolist()) == list(range(40))
            and (mine[:, COL["grad_syncs"]] == 1).all()
        )


def test_lightning_with_a_root_whose_output_is_its_last_units_names_the_slow_backward(tmp_path):
    # An nn.Sequential of sharded blocks as the root, the loss's pre-hook beginning backward: every rank's whole
    # backward was comm (0.06 ms of backward against 50 ms spent in it), and the slow rank went unnamed.
    run_dir = run_lightning_fsdp_job(tmp_path, "--steps", "30", "--no-head", "--backward-spin-ms", "60")
    s = report(run_dir)
    assert s["scope"]["errors"] == []
    rows = read_rows(run_dir)
    fast, slow = median_phases(rows, 0), median_phases(rows, 1)
    assert slow["backward"] > 45 and slow["backward"] - fast["backward"] > 30, (fast, slow)
    assert s["distributed"]["stragglers"] == [1]


def test_a_units_parameter_groups_are_read_from_the_list_or_from_the_single_group_of_older_torch() -> None:
    # torch 2.6-2.10 keep one `_fsdp_param_group` (None for a unit without parameters of its own); later
    # releases a list `_fsdp_param_groups`. An AttributeError here disabled the scope for every FSDP2 run.
    from types import SimpleNamespace

    from pytscope_core.fsdp import param_groups

    group = object()
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[group], _fsdp_param_group=group)) == [group]
    assert param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
