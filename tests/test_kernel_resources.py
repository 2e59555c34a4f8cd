"""The headline launches compiled for sm_90 on this CPU machine: no spills, pipelined loops,
and the fused loss's register budget (``scripts/kernel_resources.py``).

The launches are recorded from the real launch functions on meta tensors (bf16,
N = 8192, V = 151,936), so a kernel or heuristic change that adds spills, drops the
software pipelining or pushes the one-kernel loss past its register budget fails here,
before any device time: that is how the always-on entropy's 72 -> 128 registers went
unseen for a session (docs/performance.md, "Software-pipelined streaming loops").
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kernel_resources.py"
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(not (BIN / "cuobjdump").exists() or not (BIN / "ptxas").exists(),
                                reason="this Triton wheel ships no ptxas / cuobjdump")

#: Registers per thread the headline plans may use with the Triton the H200 image has
#: (3.6: its ptxas decides the count). Measured 64, 71, 71, 55 and 56: the fused loss's
#: gradient plan held 128 before its loops were pipelined and took 2.02 ms against 1.67
#: (H200, user timing), then 94 until the entropy sum stopped keeping the logits alive.
BUDGETS = {"policy_loss fwd+bwd": 72, "policy_loss fwd+bwd, entropy_coef": 72,
           "policy_loss fwd": 72, "selected_logprobs": 64,
           "selected_logprobs(return_entropy)": 64}
#: The kernels whose loops stream logits and must load the next tiles while one is reduced.
STREAMING = {"logp_forward_kernel", "logp_backward_kernel", "policy_loss_kernel"}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Every headline launch's resources, compiled into a cache of this process's own (the
    other test workers may compile the same kernels into the shared one at the same time).
    Triton 3.9's warning that a compile left floating-point fusion to its default (which
    3.10 changes) is an error here: the script sets it as the launches get it."""
    spec = importlib.util.spec_from_file_location("kernel_resources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    launches = module.headline_launches(8192, 151_936, torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.filterwarnings("error", "TRITON_DEFAULT_FP_FUSION", UserWarning)
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        return [module.resources(op, launch) for op, found in launches.items()
                for launch in found]


def test_every_headline_launch_compiles_without_spills(table) -> None:
    assert {r.op for r in table} >= set(BUDGETS)
    assert [r for r in table if r.spill_bytes] == []


def test_the_streaming_loops_are_pipelined(table) -> None:
    streaming = [r for r in table if r.kernel in STREAMING]
    assert streaming and [r for r in streaming if not r.pipelined] == []


@pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                    reason="the budgets hold for Triton 3.6's ptxas (the H200 image's)")
def test_the_headline_kernels_stay_within_their_register_budgets(table) -> None:
    used = {r.op: r.registers for r in table
            if r.op in BUDGETS and r.kernel in STREAMING}
    assert used.keys() == BUDGETS.keys()
    assert {op: n for op, n in used.items() if n > BUDGETS[op]} == {}, used
