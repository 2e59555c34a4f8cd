"""Framework-neutral steps, written once for PyTorch and JAX.

The modules here compute on ``[R, T]`` / ``[N]`` arrays of either framework through a
small array adapter ``xp`` that each framework supplies (``ratiokl.torch._arrays.XP``,
``ratiokl.jax._arrays.XP``); they import neither framework, so ``import ratiokl`` stays
light. An adapter offers, with the array API's names and meaning where it has them:

* elementwise: ``where(cond, x, y)`` (``x`` / ``y`` arrays or Python numbers), ``exp``,
  ``expm1``, ``log``, ``isinf``, ``isfinite``, ``maximum(x, number)``, ``clip(x, lo, hi)``
  (NaN stays NaN); ``exp_temporary(x)``, ``sub_temporary(x, y)`` and
  ``maximum_temporary(x, number)``: the same, but they may write into ``x``, a temporary;
* reductions and layout: ``sum(x, axis=None, keepdims=False)``, ``max(x, axis)``,
  ``exp_sums(d)`` (``(sum(exp(d)), sum(exp(d) * d))`` over the last axis, one ``exp``
  per element), ``count(mask)`` (an
  integer 0-d array), ``stack(arrays)``, ``broadcast_to(x, shape)``, ``zeros_like``,
  ``ones_like``, ``as_float(x)`` (the adapter's compute dtype ``float_dtype``: float32,
  or float64 in the adapter ``for_dtype(float64)`` gives, which float64 logits or log-probs
  select), ``as_index(x)`` (the framework's index integer);
* what the array API lacks: ``stop_gradient(x)``, and along the last axis
  ``positions(like)`` (``0 .. T-1`` broadcast to ``like``'s shape), ``cummax(x)``,
  ``reverse_cummin(x)``, ``shift(x, step, fill)`` (right by ``step > 0``, left by
  ``step < 0``, ``fill`` entering) and ``take(x, index)`` (``take_along_axis``).

Arrays also use their common methods and operators (``reshape``, ``shape``, ``+ - * /``,
comparisons, ``& | ~``). Options are static Python values (``ratiokl.spec``'s frozen
option objects); arrays may be traced (``jax.jit``, ``torch.compile``).

The adapters are hand-written (about 60 lines each) rather than ``array-api-compat``'s
``array_namespace(x)``: a third of what the core calls is outside the array API anyway
(stop-gradient, cumulative max / min, shifts, ``take_along_axis`` on older releases), the
namespace lookup would cost host time on every call of a step whose host time matters,
and ``torch.compile(fullgraph=True)`` traces the plain torch ops without a wrapper layer.
The names follow the array API, so swapping a namespace in later is mechanical.

Modules: :mod:`ratiokl._core.sequences` (the sequences of ``loss_agg``, their segmented
sums, the rollout correction's log-weights), :mod:`ratiokl._core.objective` (the per-token
objective, the aggregations and the metrics), :mod:`ratiokl._core.rollout` (the rollout
correction's weights and metrics), :mod:`ratiokl._core.rows` (the native backends' row
statistics, log-probs and entropy, and their vocabulary-parallel combine),
:mod:`ratiokl._core.route` (the policy-loss routes' tail after validation, with the
route's hooks each adapter also offers), :mod:`ratiokl._core.checks` (validation),
:mod:`ratiokl._core.objective_route` and :mod:`ratiokl._core.backends`.
"""
