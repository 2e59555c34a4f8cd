"""A Hugging Face causal LM's head transform, read from its config.

The model classes of ``transformers`` (5.x) turn ``h @ W.T + b`` into their logits with
at most one scale and one soft cap, each set by a config field:

- Cohere's ``logit_scale`` and Falcon-H1's ``lm_head_multiplier`` multiply;
- Granite's ``logits_scaling`` divides (HyperCLOVA X's multiplies);
- Gemma 2's ``final_logit_softcapping`` (Gemma 3 / 3n / 4, VaultGemma, nanochat) caps:
  ``c * tanh(x / c)``.

:func:`head_transform` gives them as the ``logit_scale`` / ``logit_softcap`` keywords of
:func:`ratiokl.torch.loss.linear_selected_logprobs`, whose logits are
``c * tanh((h @ W.T + b) * s / c)`` before the temperature: the model's own.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, NoReturn, Optional

__all__ = ["head_transform"]

#: The multiplying fields, in the order they are read (a config sets at most one).
_MULTIPLIERS = ("logit_scale", "lm_head_multiplier")
#: Model types whose ``logits_scaling`` multiplies (every other one divides).
_MULTIPLYING_LOGITS_SCALING = ("hyperclovax",)
#: Fields that scale the logits in no ``transformers`` model class this module knows.
_UNKNOWN = ("output_multiplier",)
#: ``{model_type: field}`` where the ``transformers`` class ignores a field that the
#: model's remote code applies (MPT's ``logit_scale``): which forward runs is unknown here.
_AMBIGUOUS = {"mpt": "logit_scale"}


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def head_transform(config: Any, refuse: Callable[[str, Any, str], NoReturn]
                   ) -> Dict[str, Optional[float]]:
    """``{"logit_scale": s, "logit_softcap": c or None}`` that make ratiokl's logits the
    model's own, from ``config`` (a ``transformers`` config; its text config is read).

    ``refuse(field, value, why)`` is called (and must raise) for a field that is set to
    something ratiokl cannot take: a scale or soft cap that is not a positive finite
    number, a field no known model class applies, or MPT's ``logit_scale`` (applied by
    its remote code only).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _UNKNOWN:
        value = getattr(text, name, None)
        if value is not None and value != 1.0:
            refuse(f"model.config.{name}", value, "no transformers model class scales its "
                   "logits by this field, so ratiokl does not know how the model applies it")
    ambiguous = _AMBIGUOUS.get(getattr(text, "model_type", None))
    if ambiguous is not None and getattr(text, ambiguous, None) is not None:
        refuse(f"model.config.{ambiguous}", getattr(text, ambiguous), "transformers' model "
               "class ignores it and the model's remote code applies it; ratiokl cannot "
               "tell which of the two forwards the model runs")
    scale = 1.0
    for name in _MULTIPLIERS:
        value = getattr(text, name, None)
        if value is not None:
            if not _positive(value):
                refuse(f"model.config.{name}", value, "the logits are multiplied by it, and "
                       "ratiokl's logit_scale is a positive finite number")
            scale *= float(value)
    value = getattr(text, "logits_scaling", None)
    if value is not None:
        if not _positive(value):
            refuse("model.config.logits_scaling", value, "the logits are divided by it, and "
                   "ratiokl's logit_scale is a positive finite number")
        multiplies = getattr(text, "model_type", None) in _MULTIPLYING_LOGITS_SCALING
        scale *= float(value) if multiplies else 1.0 / float(value)
    softcap = getattr(text, "final_logit_softcapping", None)
    if softcap is not None and not _positive(softcap):
        refuse("model.config.final_logit_softcapping", softcap,
               "ratiokl's logit_softcap is a positive finite number or None")
    return {"logit_scale": scale,
            "logit_softcap": None if softcap is None else float(softcap)}
