"""Device peak table and flop counting."""

from __future__ import annotations

import ast
import pathlib

import pytest

from pytscope_core import flops
from pytscope_core.flops import PEAK_FLOPS, FlopEstimate, peak_flops_for


@pytest.mark.parametrize(
    "name,key",
    [
        ("NVIDIA H100 80GB HBM3", "h100 sxm"),
        ("nvidia  h100   80gb hbm3 ", "h100 sxm"),
        ("NVIDIA H100 PCIe", "h100 pcie"),
        ("NVIDIA A100-SXM4-80GB", "a100 sxm"),
        ("NVIDIA A100-PCIE-40GB", "a100 pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA L40S", "l40s"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_known_devices(name, key):
    assert peak_flops_for(name) == PEAK_FLOPS[key]


def test_unknown_devices_give_none():
    assert peak_flops_for("cpu") is None
    assert peak_flops_for("") is None and peak_flops_for(None) is None
    assert peak_flops_for("NVIDIA GeForce RTX 4090") is None
    assert peak_flops_for("NVIDIA H100 80GB HBM3 (prototype)") is None  # exact match only


def test_torch_not_imported_at_module_level():
    tree = ast.parse(pathlib.Path(flops.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("torch" in ast.dump(n) for n in top)


def count_step(at_step, steps, body):
    """Drive a FlopEstimate as the hooks do: begin at each step's forward (which ends a count of an earlier
    step), end at the close of the run."""
    results = []
    est = FlopEstimate(at_step, results.append)
    for step in steps:
        est.begin(step)
        body()
    if est.counting:
        est.end()
    return results


def test_measure_flops_of_a_matmul():
    torch = pytest.importorskip("torch")
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    assert count_step(2, [1, 2, 3], lambda: a @ b) == [2 * 8 * 16 * 4]  # only step 2 is counted


def test_measure_flops_of_forward_and_backward():
    torch = pytest.importorskip("torch")
    w = torch.ones(16, 4, requires_grad=True)
    x = torch.ones(8, 16)
    # forward 2*8*16*4, backward: grad of w only (x needs none) = one more matmul of the same size
    assert count_step(1, [1], lambda: (x @ w).sum().backward()) == [2 * (2 * 8 * 16 * 4)]


def test_measure_flops_failure_gives_none():
    assert count_step(1, [1], lambda: None) == [None]  # nothing counted: MFU stays n/a


def test_dense_peaks_per_precision():
    assert peak_flops_for("NVIDIA H200", "bf16") == 989e12  # dense, not the 1,979 TFLOP/s sparse figure
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "fp32") == 66.9e12
    assert peak_flops_for("NVIDIA H200 NVL") == 835e12
    assert peak_flops_for("NVIDIA H200", "fp64") is None
