"""The shared numeric spec: float64 reference, option tables, tolerances.

Imports only NumPy. Every backend of both frameworks is tested against it. Its public
names are those of its modules, each listed once in that module's ``__all__``.
"""

from ratiokl.spec import (advantages, aggregation, kl, linear, loss_options, objective,
                          option_checks, options, policy_terms, ratio, reference, rollout,
                          token_baselines, tolerances)
# Before the star imports: the package's ``policy_loss`` is then the function.
from ratiokl.spec import policy_loss as _policy_loss
from ratiokl.spec.advantages import *  # noqa: F401,F403
from ratiokl.spec.aggregation import *  # noqa: F401,F403
from ratiokl.spec.kl import *  # noqa: F401,F403
from ratiokl.spec.linear import *  # noqa: F401,F403
from ratiokl.spec.loss_options import *  # noqa: F401,F403
from ratiokl.spec.objective import *  # noqa: F401,F403
from ratiokl.spec.option_checks import *  # noqa: F401,F403
from ratiokl.spec.options import *  # noqa: F401,F403
from ratiokl.spec.policy_loss import *  # noqa: F401,F403
from ratiokl.spec.policy_terms import *  # noqa: F401,F403
from ratiokl.spec.ratio import *  # noqa: F401,F403
from ratiokl.spec.reference import *  # noqa: F401,F403
from ratiokl.spec.rollout import *  # noqa: F401,F403
from ratiokl.spec.token_baselines import *  # noqa: F401,F403
from ratiokl.spec.tolerances import *  # noqa: F401,F403

__all__ = [*advantages.__all__, *aggregation.__all__, *kl.__all__, *linear.__all__,
           *loss_options.__all__,
           *objective.__all__, *option_checks.__all__, *options.__all__,
           *_policy_loss.__all__, *policy_terms.__all__, *ratio.__all__,
           *reference.__all__, *rollout.__all__, *token_baselines.__all__,
           *tolerances.__all__]
