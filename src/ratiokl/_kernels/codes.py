"""The option codes as the kernels' constexprs (defined once, in ``ratiokl._codes``).

A ``@triton.jit`` function may read a global only when it is a ``tl.constexpr``, so
each code the kernels compare against has its twin here.
"""

import triton.language as tl

from ratiokl._codes import KL, Objective

KL_NONE = tl.constexpr(int(KL.NONE))
K1 = tl.constexpr(int(KL.K1))
K2 = tl.constexpr(int(KL.K2))
K3 = tl.constexpr(int(KL.K3))
K1_PLUS = tl.constexpr(int(KL.K1_PLUS))
K3_PLUS = tl.constexpr(int(KL.K3_PLUS))
K3_IS = tl.constexpr(int(KL.K3_IS))
CISPO = tl.constexpr(int(Objective.CISPO))
