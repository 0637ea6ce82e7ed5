"""benchmarks/gpu_check.py --quick end to end: every check reports a status, the CUDA-only ones say why they
were skipped on a machine without a GPU, and every check that ran passed (exit code 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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

pytestmark = pytest.mark.multiproc


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
