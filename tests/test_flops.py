"""Device peak table and flop counting."""

from __future__ import annotations

import ast
import pathlib

import pytest

from pytscope_core import flops
from pytscope_core.flops import PEAK_FLOPS, measure_flops_per_step, peak_flops_for


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


def test_measure_flops_of_a_matmul():
    torch = pytest.importorskip("torch")
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    assert measure_flops_per_step(lambda: a @ b) == 2 * 8 * 16 * 4


def test_measure_flops_failure_gives_none():
    def boom():
        raise RuntimeError("no")

    assert measure_flops_per_step(boom) is None
