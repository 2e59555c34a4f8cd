"""GPU debug of the sweep NaN: V=127 N=1 'policy' op."""
import os, sys, json, traceback
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "tests")
import torch
import test_launch_plan_sweep as S
mode = sys.argv[1]
if mode == "nocache":
    import ratiokl.torch._cached_launch as C
    C.CachedLaunch._launch = lambda self, grid, args, kwargs: self.kernel[grid](*args, **kwargs)
if mode == "nanpool":
    big = torch.full((1 << 28,), float("nan"), device="cuda"); del big
def one(V, n, op="policy", agg="token-mean", dtype="float32"):
    x = S._inputs(n, V, dtype, n % 2 == 1)
    fast, slow = S._torch_ops(x, "triton", op, agg), S._torch_ops(x, "native", op, agg)
    bad = {k: (fast[k].flatten()[:4].tolist(), slow[k].flatten()[:4].tolist())
           for k in fast if not torch.equal(torch.isfinite(fast[k]), torch.isfinite(slow[k]))}
    return bad
for V in (127, 15, 2047, 8191, 128, 126, 100):
    for n in (1, 2, 3, 7):
        try:
            bad = one(V, n)
        except Exception as e:
            bad = repr(e)
        print(mode, V, n, "BAD" if bad else "ok", bad if bad else "", flush=True)
# options bisect at V=127 N=1
for op in ("policy", "policy_fwd", "policy_ref_logps", "policy_entropy", "policy_cispo"):
    print(mode, "op", op, one(127, 1, op), flush=True)
