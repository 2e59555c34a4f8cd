"""The public functions' docstrings, written once for PyTorch and JAX.

``ratiokl.torch.loss`` and ``ratiokl.jax.loss`` hold the signatures; the text of their six
functions lives here, one template per function (``logprobs.py``: ``selected_logprobs``,
``ratio_kl``; ``policy.py``: ``policy_loss``, ``policy_objective``; ``linear.py``: the two
ops from hidden states). A template is framework-neutral text with ``$name`` placeholders
for what truly differs between the frameworks (tensor or array, ``vocab_group`` or
``vocab_axis``, ``torch.compile`` or ``jit``, ...): small named pieces, one dict per
framework beside each template. :func:`documented` renders a function's template with its
framework's pieces and sets ``__doc__`` at definition, so ``help``, ``inspect.getdoc`` and
Sphinx autodoc read the full text (an editor that reads only the source shows none: look
here). ``tests/test_public_docstrings.py`` checks that each rendered text names every
parameter and that the two frameworks' texts differ only by their pieces.
"""

from __future__ import annotations

from string import Template
from typing import Callable, Dict, Literal, Mapping, Tuple, TypeVar

from ratiokl._docs import linear, logprobs, policy

Framework = Literal["torch", "jax"]
F = TypeVar("F", bound=Callable)

#: Pieces every template may use.
COMMON: Dict[str, Dict[str, str]] = {
    "torch": {
        "array": "tensor",
        "group": "vocab_group",
        "strides": ", any strides",
        "static": "",
        "wide_backend": ' (``"auto"`` picks it; e.g. for ``torch.autograd.gradcheck``)',
    },
    "jax": {
        "array": "array",
        "group": "vocab_axis",
        "strides": "",
        "static": " (static)",
        "wide_backend": ' under ``jax_enable_x64`` (``"auto"`` picks it)',
    },
}

#: name -> (template, {framework: pieces}), from every module.
TEMPLATES: Dict[str, Tuple[str, Mapping[str, Mapping[str, str]]]] = {
    name: (text, module.PIECES)
    for module in (logprobs, policy, linear) for name, text in module.TEXT.items()
}


def pieces(name: str, framework: Framework) -> Dict[str, str]:
    """The placeholders' values for ``name``'s template in ``framework``."""
    return {**COMMON[framework], **TEMPLATES[name][1][framework]}


def render(name: str, framework: Framework) -> str:
    """The docstring of public function ``name`` in ``framework`` (a missing piece raises)."""
    return Template(TEMPLATES[name][0]).substitute(pieces(name, framework))


def documented(framework: Framework) -> Callable[[F], F]:
    """A decorator that sets a public function's ``__doc__`` to its rendered template."""
    def attach(function: F) -> F:
        function.__doc__ = render(function.__name__, framework)
        return function
    return attach
