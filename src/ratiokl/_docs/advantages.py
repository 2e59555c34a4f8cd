"""The advantage estimators' docstrings, written once for PyTorch and JAX.

``ratiokl.torch.advantages`` and ``ratiokl.jax.advantages`` hold the signatures; the text
lives here, with ``$array`` (tensor / array), ``$compiled`` (``torch.compile`` / ``jax.jit``)
and ``$backends`` (what ``backend`` runs) filled per framework by :func:`documented`.
"""

from __future__ import annotations

from string import Template
from typing import Callable, Dict, TypeVar

F = TypeVar("F", bound=Callable)

PIECES: Dict[str, Dict[str, str]] = {
    "torch": {"array": "tensor", "compiled": "``torch.compile``",
              "backends": "``\"native\"`` (a scan of whole-tensor ops, ``log2 T`` steps), "
                          "``\"triton\"`` (one Triton kernel: a reverse scan over "
                          "``T`` per block of rows, tile by tile), ``\"interpret\"`` (that kernel on the "
                          "CPU) or ``\"auto\"`` (Triton on CUDA tensors, else native)"},
    "jax": {"array": "array", "compiled": "``jax.jit``",
            "backends": "every backend runs ``lax.associative_scan`` (XLA's scan, one pass "
                        "over ``T``); the name is checked as everywhere else"},
}

_GROUPS = """\
  group_ids: integer $array ``[B]``: each sample's group (any integers, any order, as
    verl's ``index``); or None with ``group_size``.
  group_size: consecutive groups of this many samples (must divide ``B``); or None.
  valid: ``[B]`` bool (or 0/1) $array, or None (all valid). Invalid samples (failed,
    truncated, filtered) enter no statistic and get advantage 0, whatever they hold."""

_RULES = """\
Shapes and dtypes: ``[...]`` = ``[B]``; any float dtype in, float32 out; no gradient.
Errors: a NaN or infinite score in a valid sample makes its own group NaN and nothing
else. Works under $compiled (groups are compacted by one sort: no data-dependent shape)."""

TEXT: Dict[str, str] = {
    "grpo": r"""GRPO's group-normalised advantages (Dr. GRPO with ``scale="none"``).

.. math::

    a_i = \frac{x_i - \bar x_{g(i)}}{s + \epsilon}

with :math:`\bar x_g` the mean of group :math:`g`'s valid scores and :math:`s` by ``scale``:
``"group"`` the group's std, ``"batch"`` the std of every valid score (TRL's
``scale_rewards="batch"``), ``"none"`` no division (:math:`a_i = x_i - \bar x`). verl's
``grpo`` / ``grpo_vectorized``: the defaults (``norm_adv_by_std_in_grpo=False``:
``scale="none"``); TRL: ``eps=1e-4, singleton="zero"`` and its ``scale_rewards``;
OpenRLHF ``group_norm``: ``eps=1e-9``, ``dr_grpo``: ``scale="none"``; RL-Kernel's
``group_advantages``: ``std="population"``.

Args:
  scores: float $array ``[B]``: one score (reward) per sequence.
$groups
  std: ``"unbiased"`` (``n - 1``, ``torch.std``: verl, TRL, OpenRLHF) or
    ``"population"`` (``n``).
  scale: ``"group"``, ``"batch"`` or ``"none"``.
  eps: added to the std.
  singleton: a group with one valid sample: ``"score"`` (verl: mean 0, std 1, so
    ``x / (1 + eps)``) or ``"zero"`` (TRL: 0). A group of equal scores gives exactly 0.

Returns:
  float32 ``[...]``: one advantage per sequence (``policy_loss`` takes it as is;
  :func:`spread` puts it on the tokens).

$rules

References: Shao et al. 2024 (GRPO, arXiv:2402.03300); Liu et al. 2025 (Dr. GRPO,
arXiv:2503.20783).
""",
    "rloo": r"""RLOO: each score minus the mean of its group's other valid scores.

.. math::

    a_i = x_i - \frac{1}{n - 1}\sum_{j \ne i} x_j = \frac{n}{n-1}(x_i - \bar x)

verl's ``rloo`` (``singleton="score"``: a lone sample keeps its score) and
``rloo_vectorized`` (``singleton="zero"``); OpenRLHF's ``rloo`` (groups of two or more).

Args:
  scores: float $array ``[B]``: one score per sequence.
$groups
  singleton: a group with one valid sample: ``"score"`` (its score) or ``"zero"``.

Returns:
  float32 ``[...]``: one advantage per sequence.

$rules

References: Ahmadian et al. 2024 (arXiv:2402.14740).
""",
    "reinforce_pp_baseline": r"""REINFORCE++-baseline: the group-centred score, whitened
over the batch.

.. math::

    c_i = x_i - \bar x_{g(i)}, \qquad a_i = (c_i - m) / \sqrt{v'}

with :math:`m`, :math:`v` the mean and variance of :math:`c` over the valid samples, each
weighted by ``lengths`` (verl and OpenRLHF whiten over tokens: pass each sequence's token
count), and :math:`v'` by ``whiten``. verl's ``reinforce_plus_plus_baseline``: the
defaults; OpenRLHF's ``reinforce_baseline``: ``whiten="population"``.

Args:
  scores: float $array ``[B]``: one score per sequence.
$groups
  lengths: ``[B]`` numeric $array, each sample's weight in the whitening (its number of
    response tokens), or None (1 each).
  whiten: ``"unbiased"`` (verl: :math:`v N/(N-1) + 10^{-8}`), ``"population"``
    (OpenRLHF: :math:`\max(v, 10^{-8})`) or ``"none"``.
  singleton: ``"score"`` (verl: a lone sample's mean is 0) or ``"zero"``.

Returns:
  float32 ``[...]``: one advantage per sequence.

$rules

References: Hu 2025 (REINFORCE++, arXiv:2501.03262).
""",
    "opo": r"""OPO: each score minus its group's length-weighted mean score.

.. math::

    a_i = x_i - \frac{\sum_{j \in g} \ell_j x_j}{\sum_{j \in g} \ell_j}

A group with one valid sample has baseline 0 (verl's ``opo``).

Args:
  scores: float $array ``[B]``: one score per sequence.
$groups
  lengths: ``[B]`` numeric $array: each sequence's number of response tokens (required).

Returns:
  float32 ``[...]``: one advantage per sequence.

$rules

References: Hao et al. 2025 (OPO, arXiv:2505.23585).
""",
    "grpo_passk": r"""GRPO pass@k: only each group's best sample gets an advantage.

.. math::

    a_{\mathrm{best}} = \frac{x_{(1)} - x_{(2)}}{s + \epsilon}

(:math:`x_{(1)}`, :math:`x_{(2)}` the largest and second largest valid score, :math:`s`
the group's std; ``scale="none"``: undivided); every other sample, and every sample of a
group with fewer than two valid samples (verl raises there), gets 0; tied best scores give
0. verl's ``grpo_passk``: the defaults (``norm_adv_by_std_in_grpo=False``: ``"none"``).

Args:
  scores: float $array ``[B]``: one score per sequence.
$groups
  std: ``"unbiased"`` (verl) or ``"population"``.
  scale: ``"group"`` or ``"none"``.
  eps: added to the std.

Returns:
  float32 ``[...]``: one advantage per sequence.

$rules

References: Chen et al. 2025 (Pass@k training, arXiv:2503.19595).
""",
    "gpg": r"""GPG: the group-centred score scaled by the batch's share of non-zero scores.

.. math::

    a_i = \alpha\, (x_i - \bar x_{g(i)}) / f, \qquad
    \alpha = \frac{\#\,\text{valid}}{\max(\#\,\text{valid non-zero scores}, 1)}

A group with one valid sample has mean 0 (verl's ``gpg``).

Args:
  scores: float $array ``[B]``: one score per sequence.
$groups
  f_norm: the divisor :math:`f` (verl's ``f_norm``).

Returns:
  float32 ``[...]``: one advantage per sequence.

$rules

References: Chu et al. 2025 (GPG, arXiv:2504.02546).
""",
    "gdpo": r"""GDPO: GRPO on each reward apart, summed with ``weights``, then whitened.

.. math::

    a_i = \mathrm{whiten}\Big(\sum_k w_k \frac{x_{ik} - \bar x_{g(i)k}}{s_{g(i)k} +
    \epsilon}\Big)

verl's ``gdpo``: the defaults with ``lengths`` (its whitening is over tokens).

Args:
  scores: float $array ``[B, K]``: ``K`` scores per sequence.
$groups
  weights: ``K`` Python numbers, or None (1 each).
  std: ``"unbiased"`` (verl) or ``"population"``.
  eps: added to each group std.
  singleton: ``"score"`` (verl) or ``"zero"``.
  lengths: ``[B]`` whitening weights (token counts), or None (1 each).
  whiten: ``"unbiased"``, ``"population"`` or ``"none"`` (as
    :func:`reinforce_pp_baseline`).

Returns:
  float32 ``[...]`` = ``[B]``: one advantage per sequence.

$rules

References: GDPO (arXiv:2601.05242).
""",
    "gae": r"""Generalized advantage estimation: one reverse scan over ``T``.

.. math::

    \delta_t = r_t + \gamma V_{\mathrm{next}} - V_t, \qquad
    A_t = \delta_t + \gamma\lambda A_{\mathrm{next}}, \qquad R_t = A_t + V_t

backwards in time, with :math:`V_{\mathrm{next}}`, :math:`A_{\mathrm{next}}` those of the
next unmasked position (0 past the end): masked positions are skipped as verl skips
observation tokens (neither their value nor their TD error enters, whatever they hold),
and get advantage and return 0. The advantages are then whitened over the unmasked tokens
(verl's ``gae``: the defaults; OpenRLHF's ``gae``: ``whiten="population"``, equal where
each row's mask is one contiguous span).

Args:
  rewards: float $array ``[B, T]``: token-level rewards.
  values: float $array ``[B, T]``: the critic's values.
  mask: ``[B, T]`` bool (or 0/1) $array: the response tokens.
  gamma: discount, a Python number in [0, 1].
  lam: GAE's :math:`\lambda`, a Python number in [0, 1].
  whiten: ``"unbiased"`` (verl), ``"population"`` (OpenRLHF) or ``"none"``.
  backend: $backends.

Returns:
  ``(advantages, returns)``: float32 ``[...]`` = ``[B, T]`` each, 0 where masked; the
  returns are not whitened.

Works under $compiled; no gradient.

References: Schulman et al. 2016 (GAE, arXiv:1506.02438).
""",
    "reinforce_pp": r"""REINFORCE++: discounted returns, whitened over the batch's tokens.

.. math::

    G_t = r_t + \gamma G_{\mathrm{next}}

backwards in time over the unmasked positions (masked ones are skipped and get 0): GAE
with :math:`V = 0`, :math:`\lambda = 1`. verl's ``reinforce_plus_plus``: the defaults;
OpenRLHF's ``reinforce``: ``whiten="population"``.

Args:
  rewards: float $array ``[B, T]``: token-level rewards.
  mask: ``[B, T]`` bool (or 0/1) $array: the response tokens.
  gamma: discount, a Python number in [0, 1].
  whiten: ``"unbiased"``, ``"population"`` or ``"none"``.
  backend: $backends.

Returns:
  ``(advantages, returns)``: float32 ``[...]`` = ``[B, T]`` each, 0 where masked.

References: Hu 2025 (REINFORCE++, arXiv:2501.03262).
""",
    "optimal_token_baseline": r"""verl's optimal token baseline: per step and group, weighted by path variance.

.. math::

    w_t = (1 - 2\pi_t + \textstyle\sum_v \pi_v^2)\,\rho_t^2, \quad
    W_t = \sum_{j \le t} w_j, \quad
    b_k = \frac{\sum_i G_{ik} W_{ik}}{\sum_i W_{ik} + \epsilon}, \quad
    A_{ik} = G_{ik} - b_k

over the unmasked tokens, with :math:`G` the return (the sum of the rewards from the token
on), :math:`\pi_t = \exp(\text{old\_logp}_t)` and :math:`\rho` the rollout importance
weights (1 without them); :math:`b_k` sums over the group's members that have a step
:math:`k`. A step is the position (``align="position"``, verl's
``optimal_token_baseline``) or the token's rank among its row's unmasked ones
(``align="active"``, verl's ``tir_optimal_token_baseline``, for multi-turn masks with gaps;
there a row with no unmasked token is no member). A group of one member has baseline 0.
``zero_tail``: where one member alone is the longest, its baseline is 0 from the second
longest member's length on (verl's ``handle_zero_tail``).

Args:
  rewards: float $array ``[B, T]``: token-level rewards.
  mask: ``[B, T]`` bool (or 0/1) $array: the response tokens.
  old_logps: float $array ``[B, T]``: the sampled tokens' log-probs under the policy
    that generated them.
  sum_pi_squared: float $array ``[B, T]``: :math:`\sum_v \pi_v^2` of that policy at each
    token (verl's actor computes it with ``calculate_sum_pi_squared``).
$groups
  is_weights: float $array ``[B, T]``: rollout importance weights, or None.
  align: ``"position"`` or ``"active"``.
  zero_tail: bool (default True, as verl).
  eps: added to the denominator (verl: ``1e-8``).
  backend: $backends (the returns' scan).

Returns:
  ``(advantages, returns)``: float32 ``[...]`` = ``[B, T]`` each, 0 where masked and on
  invalid samples' rows (the returns: 0 where masked).

Works under $compiled; no gradient. NaN in an unmasked token of a member reaches its own
group only.

References: verl's ``compute_optimal_token_baseline_advantage`` (the optimal baseline
:math:`b^* = E[G W] / E[W]` with the cumulative path variance :math:`W`).
""",
    "spread": r"""Per-sequence advantages on the tokens: ``where(mask, advantages[:, None], 0)``.

Args:
  advantages: float $array ``[B]``.
  mask: ``[B, T]`` bool (or 0/1) $array.

Returns:
  float32 ``[...]`` = ``[B, T]``.
""",
}


def render(name: str, framework: str) -> str:
    """The docstring of advantage function ``name`` in ``framework``."""
    pieces = dict(PIECES[framework])
    pieces["groups"] = Template(_GROUPS).substitute(pieces)
    pieces["rules"] = Template(_RULES).substitute(pieces)
    return Template(TEXT[name]).substitute(pieces)


def documented(framework: str) -> Callable[[F], F]:
    """A decorator that sets an advantage function's ``__doc__`` from its template."""
    def attach(function: F) -> F:
        function.__doc__ = render(function.__name__, framework)
        return function
    return attach
