"""The cached eager launch (``ratiokl.torch._cached_launch``), where it can be checked on a CPU.

The launch itself needs a GPU (``tests/gpu/test_cached_launch_gpu.py``); here:
the cache key tells apart every pair of arguments Triton's own specialisation
tells apart, parameters are passed in the kernel's order, and the installed
Triton still launches a compiled handle the way the fast path does.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from ratiokl._kernels.fused_loss import policy_loss_kernel, scale_rows_kernel  # noqa: E402
from ratiokl.torch._cached_launch import CachedLaunch, specialization_key  # noqa: E402


def _samples():
    t = torch.zeros(64)
    return [t, t[1:], t[4:], t.half(), t.bfloat16(), t.long(), t.bool(), 0, 1, 2, 15, 16, 32,
            -16, 2**31 - 1, 2**31, 2**40, 2**63, True, False, 1.5, 0.0, None]


def _triton_specialization(value):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, True, True)


def test_the_key_separates_whatever_triton_specialises_apart():
    samples = _samples()
    for a, b in itertools.combinations(samples, 2):
        if _triton_specialization(a) != _triton_specialization(b):
            assert specialization_key(0, (a,), {}) != specialization_key(0, (b,), {}), (a, b)


def test_the_key_covers_device_constexprs_and_options():
    t = torch.zeros(16)
    base = specialization_key(0, (t, 5), {"BLOCK": 64, "num_warps": 4})
    assert specialization_key(1, (t, 5), {"BLOCK": 64, "num_warps": 4}) != base
    assert specialization_key(0, (t, 5), {"BLOCK": 128, "num_warps": 4}) != base
    assert specialization_key(0, (t, 5), {"BLOCK": 64, "num_warps": 8}) != base
    # Same facts, other values: one key (the data pointer's alignment is what counts).
    assert specialization_key(0, (torch.ones(16), 7), {"BLOCK": 64, "num_warps": 4}) == base


def test_a_positional_constexpr_is_keyed_by_its_value():
    """The fused kernel's ``V`` is a constexpr passed by position: 126 and 127 share every
    runtime fact (not 1, not a multiple of 16) but are two compiled kernels. Keyed by their
    facts alone, 126 ran 127's kernel on the H200 (NaN losses in the launch-plan sweep)."""
    names = policy_loss_kernel.arg_names
    v_at = names.index("V")
    constexprs = CachedLaunch(policy_loss_kernel)._constexprs
    assert v_at in constexprs and names.index("N") not in constexprs
    args = [torch.zeros(16)] * v_at

    def key(vocab, n_rows=7, kernel_positions=constexprs):
        row = list(args) + [vocab]
        row[names.index("N")] = n_rows
        return specialization_key(0, tuple(row), {}, kernel_positions)

    assert key(126) != key(127)
    assert key(126, n_rows=5) == key(126, n_rows=9)  # a runtime integer: its facts alone
    assert key(126, kernel_positions=frozenset()) == key(127, kernel_positions=frozenset())


def test_parameters_are_passed_in_the_kernels_order():
    launch = CachedLaunch(scale_rows_kernel)
    names = scale_rows_kernel.arg_names
    order = launch._order(len(names) - 1, {"BLOCK_V": 64, "num_warps": 8})
    assert order == tuple(range(len(names) - 1)) + ("BLOCK_V",)
    assert launch._order(2, {"BLOCK_V": 64}) is None  # a missing parameter: Triton's path
    # A constexpr passed by position between runtime parameters keeps its place.
    pl_names = policy_loss_kernel.arg_names
    v_at = pl_names.index("V")
    kwargs = {name: 0 for name in pl_names[pl_names.index("HAS_REF"):]}
    order = CachedLaunch(policy_loss_kernel)._order(pl_names.index("HAS_REF"), kwargs)
    assert order[v_at] == v_at and order[-1] == "BLOCK_V"


def test_triton_launches_a_compiled_handle_as_the_fast_path_does():
    """The fast path repeats ``JITFunction.run``'s launch call; a Triton that changed it
    must fail here, not launch garbage."""
    source = inspect.getsource(triton.runtime.jit.JITFunction.run)
    call = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
            "kernel.packed_metadata, launch_metadata,")
    assert call in " ".join(source.split())
    assert "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, " \
           "*bound_args.values())" in " ".join(source.split())


_EDGES = (0, 1, 16, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1)


@given(st.lists(st.one_of(
    st.integers(-2**63, 2**64 - 1),
    st.sampled_from(_EDGES).flatmap(lambda e: st.integers(e - 17, e + 17)),
    st.booleans(), st.floats(allow_nan=False), st.none(),
    st.tuples(st.sampled_from((torch.float32, torch.bfloat16, torch.int64, torch.bool)),
              st.integers(0, 16)),
), min_size=2, max_size=2))
@settings(max_examples=400, deadline=None)
def test_one_key_never_covers_two_of_tritons_specialisations(pair):
    """Drawn pairs of launch arguments (integers around every boundary Triton specialises
    on, tensors at every byte offset, bools, floats, None): wherever Triton's own
    specialisation tells them apart, the cached launch's key does too (else one compiled
    kernel would run the other's launch)."""
    args = []
    for value in pair:
        if isinstance(value, tuple):  # (dtype, element offset): a view off 16-byte alignment
            dtype, offset = value
            value = torch.zeros(32, dtype=dtype)[offset:]
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 2**64:
            value = 2**64 - 1
        args.append(value)
    a, b = args
    if _triton_specialization(a) != _triton_specialization(b):
        assert specialization_key(0, (a,), {}) != specialization_key(0, (b,), {}), (a, b)
