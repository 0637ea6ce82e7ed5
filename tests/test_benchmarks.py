"""Every benchmark's smoke run (`--quick`, or a few steps) still runs against the code it measures, so the
commands the README gives to reproduce its numbers keep working. No timing is asserted here: the numbers of a
smoke run mean nothing (budgets are measured by the benchmarks themselves, on a quiet machine).

Not here: `benchmarks/instructions.py` (needs valgrind) and `benchmarks/gpu_check.py` (tests/test_gpu_check.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    "args",
    [
        ["analysis_scale.py", "--quick"],
        ["detection.py", "--quick"],
        ["scale.py", "--quick"],
        ["overhead.py", "--quick"],
        ["overhead.py", "--fsdp", "--quick"],
        ["bytecodes.py", "--steps", "20"],
    ],
    ids=lambda args: " ".join(args),
)
def test_benchmark_smoke_run(tmp_path: Path, args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / args[0]), *args[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
