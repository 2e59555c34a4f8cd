"""The one-launch ``check_ids`` test on the GPU: the flags of the framework-op test, around
the kernel's block boundary, and the error naming the position from the same call."""

from __future__ import annotations

import math

import pytest
import torch

from assertions import assert_close

from ratiokl import spec

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
        slot, _ = _checks._FLAG_SLOTS.take(ids.device)  # the pinned slot the route uses
        _launch.active_flags(ids, mask, vocab, temp, out=slot)
        torch.cuda.synchronize()
        assert slot[:2].tolist() == expected


def test_a_bad_id_raises_naming_its_position():
    from ratiokl.torch.loss import selected_logprobs

    logits = torch.randn(4, 3000, 257, device="cuda")
    ids = torch.randint(0, 257, (4, 3000), device="cuda")
    ids[2, 2049] = 257
    with pytest.raises(ValueError, match=r"action_ids\[2, 2049\] = 257 is outside \[0, 257\)"):
        selected_logprobs(logits, ids, backend="triton")


def test_each_call_reads_its_own_flags_across_the_slot_ring():
    """More calls than pinned slots, bad and good in turn, the GPU kept busy between them
    (a call's flags must be read after its own kernel, never a neighbour's): each call
    raises exactly when its own ids are bad, and a good call's values are right."""
    from ratiokl.torch import _checks
    from ratiokl.torch.loss import selected_logprobs

    logits = torch.randn(64, 512, device="cuda")
    ids = torch.randint(0, 512, (64,), device="cuda")
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
    bad = ids.clone()
    bad[37] = -1
    for call in range(2 * _checks._FlagSlots.SLOTS + 3):
        torch.cuda._sleep(20_000)  # the check's flags land well after the host asks
        if call % 3 == 1:
            with pytest.raises(ValueError, match=r"action_ids\[37\] = -1 is outside"):
                selected_logprobs(logits, bad, backend="triton")
        else:
            out = selected_logprobs(logits, ids, backend="triton")
            assert_close(out, expected, spec.paths_tolerance(512), "logp")
