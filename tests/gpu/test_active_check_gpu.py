"""The one-launch ``check_ids`` test on the GPU: the flags of the framework-op test, around
the kernel's block boundary, and the error naming the position from the same call."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 8192, 65537])
def test_flags_match_the_framework_test(n):
    from ratiokl.torch import _checks, _launch

    g = torch.Generator(device="cuda").manual_seed(n)
    vocab = 1000
    for trial in range(4):
        ids = torch.randint(-2, vocab + 2, (n,), generator=g, device="cuda")
        mask = torch.rand(n, generator=g, device="cuda") < (0.001 if trial < 2 else 0.5)
        temp = torch.rand(n, generator=g, device="cuda") * 2 - 0.01
        temp[torch.rand(n, generator=g, device="cuda") < 0.001] = math.nan
        bad = _checks._bad_rows(ids, mask, vocab, temp)
        expected = [int(bad["action_ids"].any()), int(bad["temperature"].any())]
        assert _launch.active_flags(ids, mask, vocab, temp).tolist() == expected


def test_a_bad_id_raises_naming_its_position():
    from ratiokl.torch.loss import selected_logprobs

    logits = torch.randn(4, 3000, 257, device="cuda")
    ids = torch.randint(0, 257, (4, 3000), device="cuda")
    ids[2, 2049] = 257
    with pytest.raises(ValueError, match=r"action_ids\[2, 2049\] = 257 is outside \[0, 257\)"):
        selected_logprobs(logits, ids, backend="triton")
