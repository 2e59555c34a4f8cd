"""Reproducer (no ratiokl) for issue 47 item 6: a gloo group that outlives its destruction.

With torch 2.13 (CPU), importing ``torch._dynamo`` (which ``torch._inductor``, and so
Triton's kernel binding, imports) for the first time *after* ``init_process_group`` keeps
the default gloo group alive after ``destroy_process_group()``: its threads
(``pt_tcpstore_uv``, ``gloo_tcp_loop``, two ``pt_gloo_runloop``) are still running when the
interpreter exits, where their teardown can abort the process ("terminate called without
an active exception", exit -6). Imported before ``init_process_group``, nothing is left.

    python scripts/repro_gloo_group_leak.py after    # prints 5 threads left
    python scripts/repro_gloo_group_leak.py before   # prints 1 thread left (the main one)
"""

from __future__ import annotations

import gc
import os
import socket
import sys

import torch
import torch.distributed as dist


def _threads() -> list:
    """The names of this process's OS threads."""
    task = "/proc/self/task"
    return [open(f"{task}/{t}/comm").read().strip() for t in sorted(os.listdir(task))]


def main(order: str) -> int:
    if order == "before":
        import torch._dynamo  # noqa: F401
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    if order == "after":
        import torch._dynamo  # noqa: F401
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()
    gc.collect()
    left = _threads()
    print(f"torch {torch.__version__}, torch._dynamo imported {order} init: "
          f"{len(left)} thread(s) left after destroy_process_group: {left}")
    return 0 if len(left) == 1 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "after"))
