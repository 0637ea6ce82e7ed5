"""benchmarks/gpu_check.py --quick end to end: every check reports a status, the CUDA-only ones say why they
were skipped on a machine without a GPU, and every check that ran passed (exit code 0). Then the script's own
machinery, which a run on a GPU relies on when something goes wrong: a check past its time limit, the JSON
writer, the work folder's archive, the ranks' result files."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = {
    "torch",
    "lightning",
    "accelerate",
    "overhead_small",
    "overhead_large",
    "ddp_gpu_delay",
    "ddp_host_delay",
    "nccl",
}
CUDA_ONLY = {"ddp_gpu_delay", "nccl"}


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """The script as a module (it is no package's)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiproc
def test_quick_run_reports_every_check(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    log = f"exit {proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-3000:]}"
    assert out.exists(), log
    result = json.loads(out.read_text())
    checks = {c["name"]: c for c in result["checks"]}
    assert set(checks) == CHECKS, log
    assert {c["status"] for c in checks.values()} <= {"pass", "fail", "skipped"}
    failed = {name: c["reason"] for name, c in checks.items() if c["status"] == "fail"}
    assert not failed, failed
    assert proc.returncode == 0, log

    cuda = result["environment"]["device"] == "cuda"
    ran = CHECKS if cuda else CHECKS - CUDA_ONLY
    for name in ran:
        assert checks[name]["status"] == "pass", (name, checks[name]["reason"])
        assert checks[name]["criteria"] and all(c["ok"] for c in checks[name]["criteria"])
    if not cuda:
        for name in CUDA_ONLY:
            assert checks[name]["status"] == "skipped", checks[name]
            assert "CUDA" in checks[name]["reason"], checks[name]["reason"]
        assert result["environment"]["device_name"] == "cpu"
        assert checks["ddp_host_delay"]["numbers"]["device"] == "cpu"
    # The straggler check names rank 1 and bills rank 0's wait as sync wait, as the JSON shows.
    assert checks["ddp_host_delay"]["numbers"]["stragglers"] == [1]
    for name in CHECKS:
        assert name in proc.stdout  # one table row per check
    # --work keeps each check's run directory, to be read afterwards when a check fails.
    from pytscope_core.rundir import load_run

    (work,) = (tmp_path / "work").iterdir()  # this run's own subfolder
    assert load_run(work / "ddp-host" / "run").arrays.world_size == 2
    assert (work / "torch" / "summary.json").exists()
    assert (work / "accelerate" / "summary.json").exists()
    # ...and packs that folder into one archive beside the JSON, the file to take away from the GPU machine.
    assert result["complete"] and result["running"] == "" and result["timed_out"] == ""
    archive = tmp_path / "result.work.tar.gz"
    assert result["archive"]["path"] == str(archive) and result["archive"]["skipped_count"] == 0
    assert 0 < archive.stat().st_size <= 8 * 2**20
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert f"{work.name}/ddp-host/logs/process0.log" in names
    assert f"{work.name}/torch/summary.json" in names


HANG = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("gpu_check", {script!r})
gc = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gc
spec.loader.exec_module(gc)

def hang_in_a_worker(ctx):
    child = [sys.executable, "-c", "import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"]
    gc.run_processes([child], dict(os.environ), 600, ctx.tmp / "hang" / "logs")
    return gc.Check("hang", "never returns in time")

def hang_in_the_environment(ctx):
    time.sleep(600)

gc.CHECKS["hang"] = hang_in_a_worker
gc.CHECK_LIMIT_S.update(hang=4, setup={setup_limit})
if {in_setup!r}:
    gc.environment = hang_in_the_environment
sys.exit(gc.main(["--checks", "hang", "--out", {out!r}, "--work", {work!r}]))
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("where", ["check", "setup"])
def test_a_check_past_its_time_limit_is_cut_off_and_named(tmp_path: Path, where: str) -> None:
    """A hanging check (here one waiting on a worker process that sleeps) or a hanging setup ends the run at its
    time limit: the JSON names it as failed and timed out, the worker is killed with its log tail kept, every
    thread's stack is on stderr, the work folder is packed, and the exit code says so."""
    out, work = tmp_path / "result.json", tmp_path / "work"
    script = HANG.format(
        script=str(SCRIPT),
        out=str(out),
        work=str(work),
        in_setup=where == "setup",
        setup_limit=60 if where == "check" else 8,
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    log = f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 3, log
    result = json.loads(out.read_text())
    name = "hang" if where == "check" else "setup"
    assert result["timed_out"] == name and result["failed"] == [name] and not result["complete"], log
    (check,) = result["checks"]
    limit = 4 if where == "check" else 8
    assert check["name"] == name and check["reason"].startswith(f"timed out after {limit} s"), check
    assert limit - 0.5 < check["seconds"] < limit + 5
    stacks = "hang_in_a_worker" if where == "check" else "hang_in_the_environment"
    assert "(most recent call first)" in proc.stderr and stacks in proc.stderr, log
    assert Path(result["archive"]["path"]).exists(), result["archive"]
    if where == "setup":  # the JSON written before torch was imported: the environment without torch's part
        assert "python" in result["environment"] and "torch" not in result["environment"]
        return
    (tail,) = check["numbers"]["log_tail"].values()
    pid = int(tail[0].split()[1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed, and reaped, before the run ended
    with tarfile.open(result["archive"]["path"]) as tar:
        assert any(n.endswith("hang/logs/process0.log") for n in tar.getnames())


def test_the_json_holds_values_json_cannot(tmp_path: Path, gpu_check: ModuleType) -> None:
    """Written as their str() (non-finite floats as null, arrays as lists): a number a check could not make
    plain never costs the whole results file."""
    out = tmp_path / "result.json"
    progress = gpu_check.Progress(out, t_start=0.0, hard_deadline=math.inf)
    check = gpu_check.Check("torch", "")
    check.numbers.update(device=object(), where=tmp_path, nan=float("nan"), steps=np.arange(3), n=np.int64(4))
    check.numbers["lock"] = threading.Lock()  # not even copyable
    progress.checks.append(check)
    progress.write(done=True)
    numbers = json.loads(out.read_text())["checks"][0]["numbers"]
    assert numbers["device"].startswith("<object object") and numbers["where"] == str(tmp_path)
    assert numbers["nan"] is None and numbers["steps"] == [0, 1, 2] and numbers["n"] == 4
    assert "lock" in numbers["lock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no partial file left behind
    # A failure to write is said, not raised: the run goes on.
    assert gpu_check.write_json(tmp_path / "missing" / "result.json", {}).startswith("FileNotFoundError")


def test_the_archive_stays_under_its_limit_logs_first(tmp_path: Path, gpu_check: ModuleType) -> None:
    folder = tmp_path / "run"
    (folder / "ddp" / "logs").mkdir(parents=True)
    (folder / "ddp" / "logs" / "process0.log").write_text("Traceback ...\n")
    (folder / "big.f64").write_bytes(os.urandom(40_000))  # over the file limit
    for i in range(20):  # 200 KB that does not compress, for a 64 KiB archive
        (folder / f"steps{i:02d}.f64").write_bytes(os.urandom(10_000))
    dest = tmp_path / "result.work.tar.gz"
    info = gpu_check.pack(folder, dest, limit=64 * 1024, file_limit=32 * 1024)
    assert dest.stat().st_size == info["bytes"] <= 64 * 1024
    with tarfile.open(dest) as tar:
        names = tar.getnames()
        assert tar.extractfile("run/ddp/logs/process0.log").read() == b"Traceback ...\n"  # type: ignore[union-attr]
    assert names[0] == "run/ddp/logs/process0.log" and len(names) == info["files"] >= 4
    assert "big.f64 (40000 bytes)" in info["skipped"]
    assert info["skipped_count"] == 21 - len(names) + 1


def test_mfu_over_100_percent_fails_only_against_the_tables_peak(gpu_check: ModuleType) -> None:
    peaks = {"default": 989e12, "bf16": 989e12, "tf32": 494e12, "fp32": 67e12}
    nominal = gpu_check.Check("torch", "")
    gpu_check.mfu_ceiling(nominal, 1.5, 1e12, peaks, "peak 1e+12 FLOP/s (not from the table)")
    assert nominal.status == "pass" and "not judged" in nominal.numbers["notes"][0]
    table = gpu_check.Check("torch", "")
    gpu_check.mfu_ceiling(table, 1.5, 989e12, peaks, "peak 9.89e+14 FLOP/s (bf16)")
    assert table.status == "fail" and "MFU <= 100%" in table.reason
    gpu_check.mfu_ceiling(within := gpu_check.Check("torch", ""), 0.4, 494e12, peaks, "tf32")
    assert within.status == "pass" and within.criteria[0]["ok"]


def test_a_rank_that_wrote_its_result_then_aborted_is_a_note(tmp_path: Path, gpu_check: ModuleType) -> None:
    """An abort in torch.distributed's teardown after the work was done: the numbers stand, the log's last 60
    lines are kept. A rank with no result file fails the check."""
    log = "\n".join(f"line {i}" for i in range(100))
    res = gpu_check.ProcResult([0, -6], False, ["", log])
    paths = [tmp_path / "rank0.json", tmp_path / "rank1.json"]
    for r, path in enumerate(paths):
        path.write_text(json.dumps({"rank": r}))
    c = gpu_check.Check("ddp_host_delay", "")
    assert gpu_check.rank_results(c, "both ranks finished", res, paths) == [{"rank": 0}, {"rank": 1}]
    assert c.status == "pass" and "exit -6" in c.numbers["notes"][0]
    assert c.numbers["log_tail"] == {"process1": [f"line {i}" for i in range(40, 100)]}

    paths[1].unlink()
    c = gpu_check.Check("ddp_host_delay", "")
    assert gpu_check.rank_results(c, "both ranks finished", res, paths) is None
    assert c.status == "fail" and "both ranks finished" in c.reason and "process1" in c.numbers["log_tail"]
