"""One gloo rank (world 1) of ``test_vocab_group_shutdown``: ``backend="interpret"`` with
``vocab_group`` and its backward, a native call that raises the bad-id ``ValueError``, then
``destroy_process_group()``. Prints the OS threads the process still runs."""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist

from ratiokl.torch import loss

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=1)
group = dist.group.WORLD
logits = torch.randn(4, 7, requires_grad=True)
ids, mask = torch.tensor([0, 3, 6, 2]), torch.ones(4, dtype=torch.bool)
loss.selected_logprobs(logits, ids, mask, vocab_group=group, backend="interpret").sum().backward()
try:
    loss.selected_logprobs(logits, ids + 7, mask, vocab_group=group, backend="native")
except ValueError as err:
    assert "is outside [0, 7)" in str(err), err
else:
    raise AssertionError("an out-of-range active id was accepted")
del group
dist.destroy_process_group()
gc.collect()
print(" ".join(open(f"/proc/self/task/{t}/comm").read().strip()
               for t in sorted(os.listdir("/proc/self/task"))))
