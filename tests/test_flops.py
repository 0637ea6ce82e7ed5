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


def test_a_gradient_penalty_trains_under_the_flop_count(tmp_path):
    # torch.autograd.grad of a leaf input with create_graph=True (WGAN-GP, R1, PINNs): torch's FlopCounterMode
    # hooks the graph through its module tracker, and the counted step failed inside torch ("A leaf node was
    # passed to _will_engine_execute_node"). The count must leave the graph alone and total as torch's does.
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from pytscope_core import Scope
    from pytscope_core.rundir import load_run

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters())

    def penalised_step(x):
        out = model(x)
        (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.pow(2).mean() + grad_x.pow(2).sum(1).mean()).backward()

    scope = Scope(tmp_path, console=False, hang_timeout=None)
    scope.watch(model, opt)
    for _ in range(6):
        penalised_step(torch.randn(32, 8, requires_grad=True))
        opt.step()
        opt.zero_grad()
    scope.finish()

    # torch's own counter, on the same step with an input that is not a leaf (which its tracker survives)
    with FlopCounterMode(display=False) as counter:
        penalised_step(torch.randn(32, 8, requires_grad=True) * 1.0)
    opt.zero_grad()
    counted = load_run(tmp_path).context.flops_per_step
    assert scope.errors == []
    assert counted is not None and counted > 0
    assert counted == pytest.approx(counter.get_total_flops(), rel=0.01)
