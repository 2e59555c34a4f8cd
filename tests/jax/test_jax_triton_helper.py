"""The jax-triton helper (``ratiokl.jax._jax_triton``): one import for 0.3.1 and 0.4.x, the
keywords each release takes, and the errors (with versions) when one is missing or too old.
jax-triton itself needs a CUDA jaxlib, so a stand-in module records the calls here."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

from ratiokl import _requirements
from ratiokl._requirements import MissingDependency, version_problem
from ratiokl.jax import _jax_triton as jax_triton_helper




@pytest.mark.parametrize("version, name", [("0.3.1", "out_shape"), ("0.4.0", "out_type"),
                                           ("0.4.1", "out_type")])
def test_call_keywords_spell_the_output_for_the_release(version, name):
    keywords = jax_triton_helper.call_keywords(version, {"out_shape": "S", "grid": (1,)})
    assert keywords == {name: "S", "grid": (1,)}


def _fake_jax_triton(monkeypatch, versions: dict) -> list:
    """Installed versions as given, and a ``jax_triton`` module that records its calls
    and warns as 0.4 does about ``input_output_aliases``."""
    calls = []

    def triton_call(*args, **keywords):
        if keywords.get("input_output_aliases"):
            warnings.warn("input_output_aliases is deprecated. Pass inputs you want to "
                          "alias as Ref arguments instead", DeprecationWarning, stacklevel=2)
        if keywords.get("zeroed_outputs"):
            warnings.warn("zeroed_outputs is deprecated. Zero the buffer explicitly and pass"
                          " it as a Ref argument instead", DeprecationWarning, stacklevel=2)
        calls.append(keywords)
        return "launched"

    module = types.ModuleType("jax_triton")
    module.triton_call = triton_call
    monkeypatch.setitem(sys.modules, "jax_triton", module)
    lookup = lambda distribution: versions.get(distribution)  # noqa: E731
    monkeypatch.setattr(_requirements, "installed_version", lookup)
    monkeypatch.setattr(jax_triton_helper, "installed_version", lookup)
    return calls


def test_triton_call_on_0_4_passes_out_type_and_keeps_aliases_quiet(monkeypatch):
    calls = _fake_jax_triton(monkeypatch, {"triton": "3.7.1", "jax-triton": "0.4.1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = jax_triton_helper.triton_call(1, out_shape="S", grid=(1,),
                                               input_output_aliases={0: 0}, zeroed_outputs=(0,))
    assert result == "launched"
    assert calls == [{"out_type": "S", "grid": (1,), "input_output_aliases": {0: 0},
                      "zeroed_outputs": (0,)}]


def test_triton_call_keeps_other_warnings(monkeypatch):
    calls = _fake_jax_triton(monkeypatch, {"triton": "3.7.1", "jax-triton": "0.4.1"})
    module = sys.modules["jax_triton"]
    inner = module.triton_call

    def noisy(*args, **keywords):
        warnings.warn("something else", DeprecationWarning, stacklevel=2)
        return inner(*args, **keywords)

    monkeypatch.setattr(module, "triton_call", noisy)
    with pytest.warns(DeprecationWarning, match="something else"):
        jax_triton_helper.triton_call(out_shape="S", grid=(1,))
    assert calls == [{"out_type": "S", "grid": (1,)}]


def test_triton_call_on_0_3_passes_out_shape(monkeypatch):
    calls = _fake_jax_triton(monkeypatch, {"triton": "3.6.0", "jax-triton": "0.3.1"})
    jax_triton_helper.triton_call(out_shape="S", grid=(1,))
    assert calls == [{"out_shape": "S", "grid": (1,)}]


@pytest.mark.parametrize("versions, named", [
    ({"triton": "3.6.0", "jax-triton": "0.2.0"}, r"jax-triton 0\.2\.0 is installed; ratiokl "
                                                 r"needs jax-triton>=0\.3\.1"),
    ({"triton": "3.5.1", "jax-triton": "0.3.1"}, r"triton 3\.5\.1 is installed; ratiokl "
                                                 r"needs triton>=3\.6"),
    ({"triton": "3.6.0"}, r"`jax-triton` is not installed"),
])
def test_import_jax_triton_names_installed_and_needed(monkeypatch, versions, named):
    _fake_jax_triton(monkeypatch, versions)
    with pytest.raises(MissingDependency, match=named) as info:
        jax_triton_helper.import_jax_triton()
    assert "'ratiokl[jax-triton]'" in str(info.value)


def test_jax_backend_triton_too_old_raises_with_versions(monkeypatch):
    from ratiokl.jax import _route

    _fake_jax_triton(monkeypatch, {"triton": "3.6.0", "jax-triton": "0.2.0"})
    _route._jax_triton_error.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"backend='triton' cannot run here: jax-triton "
                                               r"0\.2\.0 is installed; ratiokl needs "
                                               r"jax-triton>=0\.3\.1"):
            _route.backend_name("triton")
        assert _route.backend_name("auto") == "native"
    finally:
        _route._jax_triton_error.cache_clear()


def test_torch_backend_with_too_old_triton_raises_with_versions(monkeypatch):
    torch = pytest.importorskip("torch")
    from ratiokl.torch import _route

    monkeypatch.setattr(_route, "_TRITON_PROBLEM", version_problem("triton", "3.5.0"))
    with pytest.raises(RuntimeError, match=r"backend='interpret' cannot run here: triton "
                                           r"3\.5\.0 is installed; ratiokl needs triton>=3\.6"):
        _route.backend_name("interpret", torch.device("cpu"))
    assert _route.backend_name("auto", torch.device("cpu")) == "native"


def test_check_lists_the_same_reason_for_jax_triton(monkeypatch):
    from ratiokl import harness
    from ratiokl.jax import _route

    _fake_jax_triton(monkeypatch, {"triton": "3.6.0", "jax-triton": "0.2.0"})
    _route._jax_triton_error.cache_clear()
    try:
        reason = harness.target_status("jax-triton")
        assert reason == version_problem("jax-triton", "0.2.0", extra="jax-triton")
    finally:
        _route._jax_triton_error.cache_clear()
