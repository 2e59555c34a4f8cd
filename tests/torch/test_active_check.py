"""``active_check_kernel`` (the ``check_ids`` test of the Triton backends) through Triton's
interpreter, against the framework-op test it replaces, around its block boundary."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from ratiokl._kernels.active_check import CHECK_BLOCK  # noqa: E402
from ratiokl.torch import _checks, _launch  # noqa: E402

SIZES = [0, 1, CHECK_BLOCK - 1, CHECK_BLOCK, CHECK_BLOCK + 1, 2 * CHECK_BLOCK + 7]
BAD_TEMPERATURES = [0.0, -1.0, math.inf, math.nan]


def _expected(ids, mask, vocab, temperature):
    bad = _checks._bad_rows(ids, mask, vocab, temperature)
    return [bool(bad["action_ids"].any()) if "action_ids" in bad else False,
            bool(bad["temperature"].any()) if "temperature" in bad else False]


def _case(n, seed, id_dtype):
    g = torch.Generator().manual_seed(seed)
    vocab = 50
    ids = torch.randint(0, vocab, (n,), generator=g).to(id_dtype)
    mask = torch.rand(n, generator=g) < 0.7
    temp = 0.5 + torch.rand(n, generator=g)
    return ids, mask, vocab, temp


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_flags_match_the_framework_test(n, id_dtype):
    ids, mask, vocab, temp = _case(n, n, id_dtype)
    assert _launch.active_flags(ids, mask, vocab, temp).tolist() == [0, 0]
    if n == 0:
        return
    inactive = (~mask).nonzero().flatten()
    active = mask.nonzero().flatten()
    # Bad values on inactive rows never set a flag.
    if len(inactive):
        ids[inactive[-1]], temp[inactive[0]] = vocab + 3, math.nan
    assert _launch.active_flags(ids, mask, vocab, temp).tolist() == \
        _expected(ids, mask, vocab, temp) == [False, False]
    if not len(active):
        return
    for bad_id in (-1, vocab):  # each side of [0, V), in the last active row
        bad = ids.clone()
        bad[active[-1]] = bad_id
        flags = _launch.active_flags(bad, mask, vocab, temp).tolist()
        assert flags == [1, 0] == [int(x) for x in _expected(bad, mask, vocab, temp)]
    for value in BAD_TEMPERATURES:
        bad = temp.clone()
        bad[active[0]] = value
        flags = _launch.active_flags(ids, mask, vocab, bad).tolist()
        assert flags == [0, 1] == [int(x) for x in _expected(ids, mask, vocab, bad)]
    # Nothing tested: both flags stay 0 whatever the rows hold.
    assert _launch.active_flags(ids * 0 - 1, mask, None, None).tolist() == [0, 0]


@pytest.mark.parametrize("value", [2.0, *BAD_TEMPERATURES])
def test_one_temperature_for_every_row(value):
    """A 0-d temperature expanded over the rows (stride 0), as the route passes it."""
    ids, mask, vocab, _ = _case(CHECK_BLOCK + 3, 1, torch.int64)
    temp = torch.tensor(value).expand(2, (CHECK_BLOCK + 3) // 2 + 1).reshape(-1)[:len(ids)]
    expected = [0, int(not 0.0 < value < math.inf)]
    assert _launch.active_flags(ids, mask, vocab, temp).tolist() == expected


def test_strided_inputs_of_the_leading_shape():
    ids, mask, vocab, temp = _case(2 * 64, 2, torch.int64)
    wide_ids = torch.stack([ids, ids]).T.reshape(64, 4)[:, ::2]  # non-contiguous views
    wide_mask = torch.stack([mask, mask]).T.reshape(64, 4)[:, ::2]
    active = wide_mask.nonzero()[0]
    wide_ids[active[0], active[1]] = vocab
    assert _launch.active_flags(wide_ids, wide_mask, vocab, None).tolist() == [1, 0]


def test_flags_go_to_the_slot_given_and_only_its_first_two_entries():
    """``out=`` (the pinned host slot on a GPU): the kernel writes its two flags there and
    returns it; the slot's padding to 16 bytes is never touched."""
    ids, mask, vocab, temp = _case(CHECK_BLOCK + 5, 3, torch.int64)
    ids[mask.nonzero()[0, 0]] = vocab
    slot = torch.full((4,), 7, dtype=torch.int32)
    assert _launch.active_flags(ids, mask, vocab, temp, out=slot) is slot
    assert slot.tolist() == [1, 0, 7, 7]
    temp[mask.nonzero()[-1, 0]] = math.nan
    _launch.active_flags(ids * 0, mask, vocab, temp, out=slot)
    assert slot.tolist() == [0, 1, 7, 7]
