"""The option codes (``ratiokl._codes``): one definition behind the spec's tables, the kernels'
constexprs and the native paths."""

from __future__ import annotations

from typing import get_args

import pytest

from assertions import assert_close

from ratiokl import _codes, spec
from ratiokl.spec import Tolerance, options

#: A float64 central difference with step ``h = 1e-6`` against the derivative: truncation
#: ``h^2 |f'''| / 6`` (about 1e-11 here) plus rounding ``u |f| / h`` (about 5e-9 for the
#: estimators' values up to e^3 over d in [-3, 3]). A rule of numerical differentiation,
#: not of a float32 kernel, so not one of ``ratiokl.spec.tolerances``.
FINITE_DIFFERENCE = Tolerance(rtol=1e-6, atol=1e-6)


def test_each_table_names_every_string_of_its_type_once():
    for table, kind in ((spec.KL_ESTIMATORS, options.KLEstimator),
                        (spec.POLICY_KL_ESTIMATORS, options.PolicyKLEstimator),
                        (spec.OBJECTIVES, options.Objective)):
        assert tuple(table) == get_args(kind)
        assert len(set(table.values())) == len(table)


def test_the_tables_hold_the_enums_members_and_hand_out_plain_ints():
    assert set(spec.POLICY_KL_ESTIMATORS.values()) == set(_codes.KL) - {_codes.KL.NONE}
    assert set(spec.OBJECTIVES.values()) == set(_codes.Objective)
    code = spec.option_code("kl_estimator", "k3-is", spec.POLICY_KL_ESTIMATORS)
    assert type(code) is int and code == _codes.KL.K3_IS  # kernels take plain constexprs


def test_the_kernels_constexprs_are_the_enums_values():
    codes = pytest.importorskip("ratiokl._kernels.codes")
    pairs = {"KL_NONE": _codes.KL.NONE, "K1": _codes.KL.K1, "K2": _codes.KL.K2,
             "K3": _codes.KL.K3, "K1_PLUS": _codes.KL.K1_PLUS, "K3_PLUS": _codes.KL.K3_PLUS,
             "K3_IS": _codes.KL.K3_IS, "CISPO": _codes.Objective.CISPO}
    for name, member in pairs.items():
        value = getattr(codes, name).value
        assert type(value) is int and value == member, name


def test_the_aggregation_table_names_every_loss_agg_once():
    assert tuple(spec.AGGREGATIONS) == tuple(spec.LOSS_AGGS) == get_args(options.LossAgg)
    assert {row.denominator for row in spec.AGGREGATIONS.values()} == set(_codes.Denominator)


@pytest.mark.parametrize("agg", list(spec.LOSS_AGGS))
def test_the_weights_kernel_and_the_sequence_paths_follow_the_aggregation_table(agg):
    opts = spec.policy_loss_options(**{**spec.POLICY_LOSS_DEFAULTS, "loss_agg": agg})
    row = spec.AGGREGATIONS[agg]
    assert opts.seq_aggregation == opts.needs_segments == row.needs_sequences
    uniform = opts.uniform_weight(None, 7)
    if agg == "none":
        assert uniform == (1.0, False)
    elif row.needs_sequences:
        assert uniform is None
    else:  # the kernel counts the active tokens; any other D is a number the host knows
        if row.denominator == _codes.Denominator.TOKENS:
            assert uniform == (1.0, True)
        else:
            assert uniform == (spec.aggregation_denominator(agg, None, None, 7), False)


def test_the_kl_table_covers_every_policy_estimator_and_builds_on_the_three():
    assert set(spec.KL_VARIANTS) == set(spec.POLICY_KL_ESTIMATORS.values())
    for code in spec.KL_ESTIMATORS.values():  # ratio_kl's three are their own variant
        assert spec.KL_VARIANTS[code] == (code, code, False)
    basic = set(spec.KL_ESTIMATORS.values())
    assert all({v.value, v.gradient} <= basic for v in spec.KL_VARIANTS.values())


def test_each_estimators_derivative_is_that_of_its_value():
    import numpy as np

    d, h = np.linspace(-3.0, 3.0, 25), 1e-6
    for name, code in spec.KL_ESTIMATORS.items():
        # d logp = -d d: the central difference in d, negated.
        slope = -(spec.estimator_value(np, d + h, code)
                  - spec.estimator_value(np, d - h, code)) / (2 * h)
        assert_close(spec.estimator_dlogp(np, d, code), slope, FINITE_DIFFERENCE, name)
        np.testing.assert_array_equal(spec.kl_value(d, name), spec.estimator_value(np, d, code))
