"""JAX ``"triton"`` backend on the ``policy_loss`` fixtures of the newer options, on the CPU.

The backend's launches go through the interpreter stand-in of
``jax_triton.triton_call`` (``tests/jax_interpret.py``): the same fused kernel and
custom_vjp as on a GPU, judged by the shared conformance body like every target.
"""

from __future__ import annotations

import fnmatch

import pytest

pytest.importorskip("jax")
pytest.importorskip("triton")

from jax_interpret import use_interpreted_triton  # noqa: E402

from ratiokl import conformance  # noqa: E402

#: Fixture groups of the options whose kernel code is new (the rest: ``ratiokl check``
#: on a GPU); the interpreter takes seconds a case.
GROUPS = ("policy_cispo_*", "policy_entropy_*", "entropy_*", "policy_rollout_*")
CASES = [name for name in conformance.list_cases()
         if any(fnmatch.fnmatch(name, g) for g in GROUPS)]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("case_name", CASES)
def test_fixture_on_the_interpreted_jax_triton_backend(case_name: str, monkeypatch) -> None:
    use_interpreted_triton(monkeypatch)
    result = conformance.run_case(conformance.load_case(case_name), "jax-triton")
    assert result.passed, "\n".join(result.failures)
