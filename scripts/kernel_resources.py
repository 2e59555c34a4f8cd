"""Registers, spills and shared memory of the kernels each op launches, compiled for sm_90 here.

No GPU needed: Triton compiles for the H100 / H200 (sm_90) with the ``ptxas`` its wheel
ships, and its ``cuobjdump`` reads the resources (the counts match the H200's ``n_regs``).
The launches are the real ones: each op's launch function (``ratiokl.torch._launch``)
runs on ``meta`` tensors with a ``kernels`` that records every ``kernel[grid](...)``
instead of launching, so the signature, the constexprs and the warps are those the GPU
gets for the same shapes. Usage, from the repository root::

    PYTHONPATH=src python scripts/kernel_resources.py [--rows 8192] [--vocab 151936]
        [--dtype bfloat16] [--json PATH]

Prints one line per launch: op, kernel, registers per thread, spills (bytes), shared
memory (bytes), and whether its loops are software-pipelined (``cp.async`` in the PTX).
Use it to see what a kernel change costs before spending device time
(docs/performance.md, "Software-pipelined streaming loops").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ratiokl._codes import KL
from ratiokl.torch import _launch

TARGET = GPUTarget("cuda", 90, 32)
#: Floating-point fusion (FMA contraction), as the launches get it on Triton 3.6-3.9 (the
#: register budgets of tests/test_kernel_resources.py were measured with it). Passed, not
#: left to the default: Triton 3.9 warns (UserWarning) that its default turns to off in
#: 3.10 whenever a compile leaves it unset.
FP_FUSION = True
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_POINTER = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.int64: "i64", torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}


class Launch(NamedTuple):
    """One recorded ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


class Resources(NamedTuple):
    op: str
    kernel: str
    registers: int
    spill_bytes: int  # local memory per thread (spilled registers)
    shared_bytes: int  # static + the pipeliner's buffers
    pipelined: bool


def recording(launches: List[Launch]) -> Callable[[Any], Any]:
    """A ``kernels`` mapping for the launch functions that records instead of launching."""

    class _Grid:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(Launch(self.kernel, args, kwargs))

    return _Grid


def _source(launch: Launch) -> Tuple[ASTSource, Dict[str, Any]]:
    """The compile input of a recorded launch, specialised as Triton specialises a launch:
    pointers 16-byte aligned, integers equal to 1 constant, multiples of 16 marked."""
    kernel, options = launch.kernel, {"enable_fp_fusion": FP_FUSION}
    params = kernel.params
    values = dict(zip(kernel.arg_names, launch.args))
    for name, value in launch.kwargs.items():
        if name in kernel.arg_names:
            values[name] = value
        else:
            options[name] = value
    signature, constants, attrs = {}, {}, {}
    for index, param in enumerate(params):
        name, value = param.name, values.get(param.name, param.default)
        if param.is_constexpr or value is None:
            signature[name] = "constexpr"
            constants[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTER[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constants[(index,)] = 1
            else:
                signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                if value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: no signature type for {name}={value!r}")
    return ASTSource(kernel, signature, constants, attrs), options


def resources(op: str, launch: Launch) -> Resources:
    """Compile one launch for sm_90 and read its registers, spills and shared memory."""
    source, options = _source(launch)
    compiled = triton.compile(source, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", cubin], check=True,
                               capture_output=True, text=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spills = int(re.search(r"LOCAL:(\d+)", usage).group(1))  # per-thread local memory
    return Resources(op, launch.kernel.__name__, registers, spills,
                     int(compiled.metadata.shared), "cp.async" in compiled.asm["ptx"])


def headline_launches(n_rows: int, vocab: int, dtype: torch.dtype) -> Dict[str, List[Launch]]:
    """Every op's launches at ``[n_rows, vocab]`` logits of ``dtype`` (reference log-probs
    for the loss, reference logits for ``ratio_kl``; meta tensors, nothing computed)."""
    meta = dict(device="meta")
    policy = torch.empty(n_rows, vocab, dtype=dtype, **meta)
    ids = torch.empty(n_rows, dtype=torch.int64, **meta)
    mask = torch.empty(n_rows, dtype=torch.bool, **meta)
    row = torch.empty(n_rows, dtype=torch.float32, **meta)
    temp = torch.empty(1, dtype=torch.float32, **meta)
    coefs = torch.empty(5, dtype=torch.float32, **meta)
    k3 = KL.K3.value
    ops: Dict[str, Callable[[Callable], Any]] = {
        "selected_logprobs": lambda k: _launch.row_forward(
            k, policy, None, ids, mask, None, None, temp, KL.NONE.value),
        "selected_logprobs(return_entropy)": lambda k: _launch.entropy_forward(
            k, policy, ids, mask, temp),
        "ratio_kl (ref logits)": lambda k: _launch.row_forward(
            k, policy, policy, ids, mask, row, None, temp, k3),
        "logp backward": lambda k: _launch.row_backward(
            k, policy, ids, mask, temp, row, row, row, row, row, row),
        "policy_loss fwd+bwd": lambda k: _launch.fused_policy_loss(
            k, policy, None, ids, mask, row, row, temp, row, 1, None, row, coefs, True, k3,
            False, 20.0, 0, False, False, None),
        "policy_loss fwd+bwd, entropy_coef": lambda k: _launch.fused_policy_loss(
            k, policy, None, ids, mask, row, row, temp, row, 1, None, row, coefs, True, k3,
            False, 20.0, 0, True, False, None),
        "policy_loss fwd": lambda k: _launch.fused_policy_loss(
            k, policy, None, ids, mask, row, row, temp, row, 1, None, row, coefs, False, k3,
            False, 20.0, 0, False, False, None),
    }
    recorded = {}
    for op, call in ops.items():
        launches: List[Launch] = []
        call(recording(launches))
        recorded[op] = launches
    return recorded


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    found = []
    for op, launches in headline_launches(args.rows, args.vocab, getattr(torch, args.dtype)).items():
        for launch in launches:
            r = resources(op, launch)
            found.append(r)
            print(f"{r.op:36s} {r.kernel:24s} {r.registers:4d} registers {r.spill_bytes:4d} B "
                  f"spilled {r.shared_bytes:6d} B shared{'  pipelined' if r.pipelined else ''}")
    if args.json:
        args.json.write_text(json.dumps([r._asdict() for r in found], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
