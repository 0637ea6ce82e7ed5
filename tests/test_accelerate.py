"""Real multi-process tests of the Accelerate integration: `examples/accelerate_ddp.py` under torchrun.

Every test launches the example on CPU (gloo) with its own free port, so it can run beside other tests,
then reads the run directory rank 0 wrote. Faults are real: a rank that busy-waits, every rank SIGKILLed
mid-run and resumed from `accelerator.save_state`, gradient accumulation, misuse of `finish()`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytscope_core.arrays import RunArrays
from pytscope_core.records import COL
from pytscope_core.rundir import load_run, read_events, read_rows
from pytscope_core.summary import summarize

pytest.importorskip("accelerate")

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "accelerate_ddp.py")
JOB = str(Path(__file__).resolve().parent / "scripts" / "accelerate_job.py")
ENV = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.multiproc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    *args: str, nproc: int = 2, ok: bool = True, script: str = EXAMPLE
) -> subprocess.CompletedProcess[str]:
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = ["torchrun", "--nproc_per_node", str(nproc), "--master_port", str(free_port()), script, *args]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def report(run_dir: Path) -> dict[str, Any]:
    run = load_run(run_dir)
    assert run.problems == []
    return summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings)).to_dict()


def codes(summary: dict[str, Any]) -> list[str]:
    return [f["code"] for f in summary["findings"]]


@pytest.mark.parametrize("dynamo_backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_busy_rank_is_the_only_straggler(tmp_path: Path, dynamo_backend: str | None) -> None:
    # Compiled: Accelerate wraps the DDP model in torch.compile's module; what it holds is still DDP.
    run_dir = tmp_path / "run"
    compiled = ("--dynamo-backend", dynamo_backend) if dynamo_backend else ()
    # A large injected effect (10 ms on a ~12 ms step): the test holds with another process on the cores.
    launch(
        "--straggler",
        "--spin-ms",
        "10",
        "--steps",
        "150",
        "--interval",
        "25",
        "--run-dir",
        str(run_dir),
        "--no-console",
        *compiled,
    )
    s = report(run_dir)
    assert s["run"]["world_size"] == 2 and s["run"]["steps"] == 150
    assert s["run"]["parallelism"] == "ddp" and s["scope"]["errors"] == []
    assert s["distributed"]["stragglers"] == [1]
    assert (
        s["data"]["steps_checked"] >= 15 and s["data"]["duplicated_share"] == 0
    )  # prepare() sharded the data
    straggler = [f for f in s["findings"] if f["code"] == "DIST.STRAGGLER"]
    assert [f["ranks"] for f in straggler] == [[1]]
    per_rank = {r["rank"]: r for r in s["distributed"]["per_rank"]}
    lag = per_rank[1]["local_ms"] - per_rank[0]["local_ms"]
    # 10 ms of busy-waiting per step on rank 1: about 9 ms on a quiet machine, 3.9 ms once with a third
    # CPU-bound process on the 2 cores (it slowed rank 0's own work). A wait counted as local work gives 0.
    assert lag > 2.5
    # The fast rank's wait for the straggler is billed as sync wait, not as transfer: the transfer estimate
    # is what the last rank to arrive pays. (Whether that transfer crosses DIST.COMM_BOUND's 20% depends on
    # how fast gloo is on the machine, so the test does not assert on that finding.)
    assert per_rank[0]["sync_wait_ms"] > 0.6 * lag, s["distributed"]
    assert per_rank[1]["sync_wait_ms"] < 0.2 * per_rank[0]["sync_wait_ms"]  # the straggler waits least
    assert s["distributed"]["transfer_ms"] < per_rank[0]["comm_ms"] - 0.6 * lag
    shares = [p["share"] for p in s["timing"]["phases"].values()]
    assert sum(shares) == pytest.approx(1.0, abs=1e-6)


def test_kill_and_resume_continues_the_same_run(tmp_path: Path) -> None:
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    common = (
        "--straggler",
        "--spin-ms",
        "10",
        "--steps",
        "200",
        "--interval",
        "10",
        "--run-dir",
        str(run_dir),
        "--no-console",
    )
    killed = launch(*common, "--save-at", "100", "--kill-at", "130", "--checkpoint-dir", str(ckpt), ok=False)
    assert killed.returncode != 0
    assert (ckpt / "custom_checkpoint_0.pkl").exists()
    before = read_rows(run_dir)
    # Steps after the checkpoint were gathered before the kill: the resumed launch replays them.
    assert before[:, COL["step"]].max() >= 120 and set(before[:, COL["segment"]]) == {0.0}

    launch(*common, "--resume", str(ckpt))
    rows = read_rows(run_dir)
    for rank in (0, 1):
        mine = rows[rows[:, COL["rank"]] == rank]
        seg0 = mine[mine[:, COL["segment"]] == 0][:, COL["step"]]
        seg1 = mine[mine[:, COL["segment"]] == 1][:, COL["step"]]
        assert seg1.min() == 101 and seg1.max() == 200 and len(np.unique(seg1)) == len(seg1) == 100
        assert set(seg0[seg0 > 100]) <= set(range(101, 131))  # what the killed launch did after the save

    s = report(run_dir)
    assert s["run"]["steps"] == 200 and s["run"]["restarts"] == 1
    assert (s["run"]["first_step"], s["run"]["last_step"]) == (1, 200)
    segments = s["run"]["segments"]
    assert [g["index"] for g in segments] == [0, 1] and segments[1]["resumed_from_step"] == 100
    assert s["run"]["goodput"]["replayed_s"] > 0  # the superseded steps 101..~120 are charged as lost
    run = load_run(run_dir)
    assert run.arrays.n_steps == 200 and run.arrays.replayed.shape[0] >= 2 * 20
    seg = run.arrays.segment[:, 0]
    assert (seg[:100] == 0).all() and (seg[100:] == 1).all()
    assert np.isfinite(run.arrays.phases).all()  # both segments' phases, every step on every rank
    # Each segment on its own shows the straggler: the killed launch's rows are diagnosable, not just kept.
    for segment in (0, 1):
        alone = RunArrays.from_rows(rows[rows[:, COL["segment"]] == segment], warmup=5)
        assert summarize(alone, run.context).distributed.stragglers == (1,), segment
    events, _ = read_events(run_dir)
    assert [e["index"] for e in events if e["type"] == "segment"] == [0, 1]
    assert any(e["type"] == "finding" for e in events)  # live findings were written
    assert s["distributed"]["stragglers"] == [1]


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launch("--grad-accum", "4", "--steps", "10", "--interval", "5", "--run-dir", str(run_dir), "--no-console")
    rows = read_rows(run_dir)
    for rank in (0, 1):
        mine = rows[rows[:, COL["rank"]] == rank]
        assert sorted(mine[:, COL["step"]]) == list(range(1, 11))  # 40 batches -> 10 steps
        assert (mine[:, COL["micro_batches"]] == 4).all()
        assert (mine[:, COL["grad_syncs"]] == 1).all()  # accumulate() skips the all-reduce 3 times in 4
        assert (mine[:, COL["samples"]] == 4 * 1024).all()  # the example's BATCH per micro-batch
    assert report(run_dir)["run"]["steps"] == 10


def test_single_process_without_torchrun(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--steps", "120", "--interval", "40", "--run-dir", str(run_dir), nproc=1)
    s = report(run_dir)
    assert s["run"]["world_size"] == 1 and s["run"]["steps"] == 120
    assert s["convergence"]["trend"] == "improving"
    assert "Step-time breakdown" in proc.stdout and str(run_dir) in proc.stdout


def test_finish_twice_is_harmless(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--finish-twice", "--steps", "40", "--interval", "20", "--run-dir", str(run_dir))
    assert proc.stdout.count("Step-time breakdown") == 1  # one summary, printed by rank 0 only
    assert json.loads((run_dir / "summary.json").read_text())["run"]["steps"] == 40


def test_forgotten_finish_still_reports_at_exit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--forget-finish", "--steps", "40", "--interval", "15", "--run-dir", str(run_dir))
    assert proc.stdout.count("Step-time breakdown") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["run"]["steps"] == 40 and summary["run"]["world_size"] == 2
    assert summary["scope"]["errors"] == []


def test_a_forgotten_finish_after_end_training_says_it_was_forgotten(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launch("--end-without-finish", "--steps", "40", "--interval", "15", "--run-dir", str(run_dir))
    errors = json.loads((run_dir / "summary.json").read_text())["scope"]["errors"]
    assert any("finish() was not called; at exit the process group was destroyed" in e for e in errors), (
        errors
    )
    assert load_run(run_dir).arrays.n_steps == 40


def test_finish_after_end_training_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch("--finish-after-end", "--steps", "40", "--interval", "15", "--run-dir", str(run_dir))
    assert proc.stderr.count("call finish() before") == 1  # said once, by rank 0, not once per rank
    errors = json.loads((run_dir / "summary.json").read_text())["scope"]["errors"]
    assert any("after the process group was destroyed" in e for e in errors)
    assert "Scope errors" in proc.stdout  # and the printed summary says it too
    # Every rank's steps are in the run: rank 1's last ones from its own file.
    run = load_run(run_dir)
    assert run.arrays.n_steps == 40 and np.isfinite(run.arrays.wall_ms).all()


def prepared_regression(accelerator: Any, steps: int, batch: int) -> tuple[Any, Any, Any]:
    """A Linear(8, 1) regression, its SGD optimizer and a loader of `steps` batches, prepared."""
    import torch

    x = torch.randn(steps * batch, 8)
    dataset = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(dataset, batch_size=batch))


def test_live_metrics_reach_accelerate_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, one process: every gather's metrics arrive through accelerator.log at the gather's step."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    import torch
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    from pytscope_accelerate import AccelerateScope

    class Recording(GeneralTracker):
        name = "recording"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[dict[str, Any], int | None]] = []

        @property
        def tracker(self) -> Any:
            return self

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            pass

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.logged.append((dict(values), step))

    tracker = Recording()
    accelerator = Accelerator(log_with=[tracker])
    accelerator.init_trackers("pytscope-test")
    model, optimizer, loader = prepared_regression(accelerator, steps=30, batch=16)
    scope = AccelerateScope(
        accelerator,
        tmp_path / "run",
        interval=10,
        warmup=2,
        console=False,
        flops_per_step=3e5,
        peak_flops=1e9,
    )
    scope.watch(model, optimizer, loader)
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scope.log(loss=loss)
    summary = scope.finish()
    accelerator.end_training()
    # Live diagnosis runs at gathers, as often as its time budget allows: at least the first one.
    steps = [step for _, step in tracker.logged]
    assert steps and steps[0] == 10 and all(s % 10 == 0 for s in steps) and steps == sorted(set(steps))
    assert all(
        "pytscope/step_ms" in values and values["pytscope/step_ms"] > 0 for values, _ in tracker.logged
    )
    assert summary.run.steps == 30
    assert (
        steps[-1] == 30 and tracker.logged[-1][0]["pytscope/step_ms"] == summary.timing.median_ms
    )  # the end's
    # MFU through the adapter: in every live metrics record and in the summary.
    assert all(values["pytscope/mfu"] > 0 for values, _ in tracker.logged)
    assert summary.efficiency.mfu == pytest.approx(3e5 / (summary.timing.mean_ms / 1e3) / 1e9)


def test_a_step_the_fp16_scaler_skipped_is_a_step_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `optimizer.zero_grad()` first in each iteration, as in Accelerate's examples: the step the scaler skipped
    # merged into the next (48 batches, 36 steps). Accelerate makes no scaler on CPU: given the one a GPU's
    # fp16 run has, which `AcceleratedOptimizer.step` steps through.
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    import torch
    from accelerate import Accelerator

    from pytscope_accelerate import AccelerateScope

    accelerator = Accelerator()
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    model, optimizer, loader = prepared_regression(accelerator, steps=48, batch=4)
    scope = AccelerateScope(accelerator, tmp_path / "run", interval=8, console=False, hang_timeout=None)
    scope.watch(model, optimizer, loader)
    for i, (xb, yb) in enumerate(loader):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb) * (math.inf if i % 4 == 3 else 1.0)
        accelerator.backward(loss)
        optimizer.step()
        assert accelerator.optimizer_step_was_skipped == (i % 4 == 3)
    scope.finish()
    arrays = load_run(tmp_path / "run").arrays
    assert arrays.optimizer_steps[:, 0].tolist() == [0.0 if i % 4 == 3 else 1.0 for i in range(48)]
    assert (arrays.micro_batches[:, 0] == 1).all()


def test_a_wait_of_the_loops_own_is_communication(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    import torch
    from accelerate import Accelerator

    from pytscope_accelerate import AccelerateScope

    accelerator = Accelerator()
    model, optimizer, loader = prepared_regression(accelerator, steps=6, batch=4)
    scope = AccelerateScope(accelerator, tmp_path / "run", console=False, hang_timeout=None)
    scope.watch(model, optimizer, loader)
    for xb, yb in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
        with scope.collective():  # as around another library's collective
            time.sleep(0.02)
    scope.finish()
    comm = load_run(tmp_path / "run").arrays.comm_ms[:, 0]
    assert len(comm) == 6 and (comm >= 15.0).all(), comm


def test_stop_ends_the_scope_where_the_loop_caught_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process, one process: `stop(reason)` (the README's advice where an error is caught) keeps the steps
    taken and says why the run ended; the scope is released, so a later `finish()` changes nothing."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    import torch
    from accelerate import Accelerator

    from pytscope_accelerate import AccelerateScope

    accelerator = Accelerator()
    model, optimizer, loader = prepared_regression(accelerator, steps=40, batch=8)
    scope = AccelerateScope(accelerator, tmp_path / "run", interval=10, console=False)
    scope.watch(model, optimizer, loader)
    try:
        for i, (xb, yb) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scope.log(loss=loss)
            if i == 24:
                raise ValueError("bad batch")
    except ValueError as exc:
        scope.stop(f"the loop caught {exc!r}")
    scope.finish()
    accelerator.end_training()
    run = load_run(tmp_path / "run")
    assert run.arrays.n_steps == 25
    notes = json.loads((tmp_path / "run" / "summary.json").read_text())["scope"]["notes"]
    assert any("the loop caught ValueError('bad batch')" in n for n in notes), notes


def test_blocked_rank_is_reported_as_hang_and_the_job_ends(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = launch("--run-dir", str(run_dir), "--steps", "100", "--interval", "10", "--block-at", "30",
                  "--hang-timeout", "5", ok=False)  # fmt: skip
    assert proc.returncode != 0 and time.monotonic() - start < 60, proc.stderr[-3000:]
    hang = [f for f in report(run_dir)["findings"] if f["code"] == "DIST.HANG"]
    assert hang and hang[0]["ranks"] == [1] and hang[0]["steps"] == [30], hang
    assert "spin" in (run_dir / "stacks" / "rank1.txt").read_text()
    assert "Thread" in (run_dir / "stacks" / "rank0.txt").read_text()


def test_an_unsharded_loader_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launch("--same-data", "--steps", "40", "--interval", "20", "--run-dir", str(run_dir), "--no-console")
    found = [f for f in report(run_dir)["findings"] if f["code"] == "DATA.DUPLICATE_SHARDS"]
    assert found and found[0]["ranks"] == [0, 1]


def test_waits_in_the_loops_own_collectives_are_sync_wait_and_the_straggler_named(tmp_path: Path) -> None:
    # The last rank works 10 ms more after each optimizer step; then the loop reduces its loss and waits for
    # everyone: the other rank waits there, never in the gradient all-reduce. Counted as its own work, that
    # wait made both ranks look alike and the straggler went unnamed.
    run_dir, result = tmp_path / "run", tmp_path / "result.json"
    launch(
        *("--steps", "120", "--late-spin-ms", "10", "--collectives"),
        *("--run-dir", str(run_dir), "--result", str(result)),
        script=JOB,
    )
    dist = report(run_dir)["distributed"]
    assert dist["stragglers"] == [1], dist
    local = {r["rank"]: r["local_ms"] for r in dist["per_rank"]}
    wait = {r["rank"]: r["sync_wait_ms"] for r in dist["per_rank"]}
    lag = local[1] - local[0]
    assert lag > 2.5, dist  # (2.5: as in test_busy_rank_is_the_only_straggler)
    assert wait[0] > 0.6 * lag and wait[1] < 0.2 * wait[0], dist
    assert json.loads(result.read_text())["collectives_as_they_were"]  # finish() put them back


def test_a_loop_started_again_after_a_caught_error_ends_the_scope_before_it(tmp_path: Path) -> None:
    # As find_executable_batch_size after an out-of-memory error: the first attempt raises at its 5th step,
    # the exception is caught and the loop starts again with a new AccelerateScope. The first scope used to
    # live on: its watchdog called the second attempt's progress a hang, and its summary came last.
    run_dir, result = tmp_path / "run", tmp_path / "result.json"
    proc = launch(
        *("--steps", "30", "--attempts", "2", "--hang-timeout", "2", "--step-sleep-s", "0.15"),
        *("--run-dir", str(run_dir), "--result", str(result)),
        script=JOB,
    )
    assert "DIST.HANG" not in proc.stdout + proc.stderr
    assert json.loads(result.read_text()) == {"steps": 30, "registered": 1, "collectives_as_they_were": True}
    first = load_run(run_dir)
    assert all("a new AccelerateScope took over" in why for _, why in first.context.rank_notes), first.context
    assert load_run(Path(f"{run_dir}-2")).arrays.n_steps == 30
    assert proc.stdout.rstrip().endswith(f"run directory: {run_dir}-2  (pytscope report {run_dir}-2)")


def test_a_prepared_model_that_trains_unwatched_is_said_at_the_first_forward(tmp_path: Path) -> None:
    # Two models prepared (an encoder and a head, both DDP on several processes), only the encoder watched:
    # the head's gradient all-reduce would be timed as backward, silently. In process, with an accelerator
    # that says it has two processes.
    import torch

    from pytscope_accelerate import AccelerateScope
    from pytscope_core.parallelism import unwatched_models

    class TwoProcesses:
        num_processes, mixed_precision = 2, "no"

        def __init__(self, *models: torch.nn.Module) -> None:
            self._models = list(models)

    encoder, head, frozen = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
    frozen.requires_grad_(False)
    ddp_like = torch.nn.Module()
    ddp_like.module = encoder  # what the encoder's DDP wrapper holds
    assert unwatched_models([encoder, head, frozen], [ddp_like]) == [head]
    for watched, said in (([encoder], True), ([encoder, head], False)):
        scope = AccelerateScope(TwoProcesses(encoder, head, frozen), tmp_path / str(said), console=False)
        for model in watched:
            scope.watch(model)
        assert scope.scope.notes == []  # not before the first forward: watch() may still come
        head(encoder(torch.randn(2, 4))).sum().backward()
        notes = " ".join(scope.scope.notes)
        assert ("returned 1 more model(s) that train than watch() was given (Linear)" in notes) == said, notes
        scope.finish()


def test_a_finished_scope_leaves_the_checkpoint_to_the_next_training_in_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two trainings in one process (as `free_memory()` is documented for): the first scope finished, still
    registered, made the second run's checkpoints carry two objects, which a resume registering one refused."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    import torch
    from accelerate import Accelerator

    from pytscope_accelerate import AccelerateScope

    accelerator = Accelerator()
    for name in ("first", "second"):
        model, optimizer, loader = prepared_regression(accelerator, steps=6, batch=8)
        scope = AccelerateScope(accelerator, tmp_path / name, console=False, hang_timeout=None)
        accelerator.register_for_checkpointing(scope)
        scope.watch(model, optimizer, loader)
        for xb, yb in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
        if name == "first":
            scope.finish()
            accelerator.free_memory()
    accelerator.save_state(str(tmp_path / "ckpt"))
    scope.finish()
    assert accelerator._custom_objects == [scope]
    assert len(list((tmp_path / "ckpt").glob("custom_checkpoint_*.pkl"))) == 1
    accelerator.end_training()
