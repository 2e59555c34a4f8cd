"""Conformance cases: building one from inputs, and its on-disk form.

A case is one call of one operator: its inputs (logits stored as float32
values already rounded to the case's dtype, or to an input's own dtype where
``input_dtypes`` names one, so every framework casts them exactly), scalar options, upstream cotangents, float64 expected outputs and
the float64 expected gradient w.r.t. the policy logits, and per-output
tolerances -- or an expected error instead of expectations.

On disk a case is one ``.npz`` written byte-for-byte deterministically
(stored members, fixed timestamps, sorted names) and one manifest entry.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from ratiokl.harness._ops import OPS, Op
from ratiokl.spec.options import LOGIT_DTYPE_NAMES as LOGIT_DTYPES
from ratiokl.spec.tolerances import Tolerance

__all__ = ["Case", "build_case", "round_to_dtype", "read_npz", "write_npz", "LOGIT_DTYPES"]



def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded (to nearest even) to ``dtype`` and returned as float32 values."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = rounded.astype(np.uint32).view(np.float32)
        return np.where(np.isnan(x), np.float32(np.nan), out)
    raise ValueError(f"`dtype` must be one of {LOGIT_DTYPES}; got {dtype!r}")


@dataclass(frozen=True)
class Case:
    """One conformance case; ``arrays`` holds inputs, ``cotangent_*``, ``expected_*``.

    ``dtype`` is the dtype of every logits argument (``Op.logit_args``) except those
    ``input_dtypes`` gives their own (an lm_head's float32 ``weight`` beside bfloat16
    ``hidden``): :meth:`dtype_of` reads it. Each gradient has its argument's dtype.
    """

    name: str
    group: str
    op: str
    dtype: str
    arrays: Mapping[str, np.ndarray]
    options: Mapping[str, Any]
    tolerances: Mapping[str, Tolerance]
    expect_error: Optional[str] = None
    description: str = ""
    input_dtypes: Mapping[str, str] = field(default_factory=dict)

    @property
    def spec(self) -> Op:
        return OPS[self.op]

    def dtype_of(self, argument: str) -> str:
        """The dtype a logits argument is cast to: its own in ``input_dtypes``, else the
        case's."""
        return self.input_dtypes.get(argument, self.dtype)

    def arguments(self) -> Dict[str, Any]:
        """The operator's arguments present in the case: arrays, then scalar options (a
        JSON list, such as ``rollout_bounds``, back as the tuple it was)."""
        out = {k: self.arrays[k] for k in self.spec.arguments if k in self.arrays}
        out.update({k: tuple(v) if isinstance(v, list) else v
                    for k, v in self.options.items() if k in self.spec.arguments})
        return out

    @property
    def logits(self) -> np.ndarray:
        return self.arrays[self.spec.differentiate]

    @property
    def lead_shape(self) -> Tuple[int, ...]:
        shape = tuple(self.logits.shape)
        return shape if self.spec.token_values else shape[:-1]

    @property
    def row_mask(self) -> np.ndarray:
        """Boolean ``[...]``: the rows the operator treats as active."""
        key = self.spec.row_mask
        if key is None or key not in self.arrays:
            return np.ones(self.lead_shape, dtype=bool)
        return np.asarray(self.arrays[key], dtype=bool)

    @property
    def vocab(self) -> int:
        """``V``: the logits' last axis, or the lm_head weight's rows (``Op.vocab_arg``)."""
        key = self.spec.vocab_arg
        if self.spec.token_values:
            return 0
        return int(self.arrays[key].shape[0] if key else self.logits.shape[-1])

    @property
    def also_differentiated(self) -> Tuple[str, ...]:
        """The further arguments whose gradients this case compares (``Op.also_differentiate``
        present in the case)."""
        return tuple(k for k in self.spec.also_differentiate if k in self.arrays)

    def cotangents(self) -> Dict[str, np.ndarray]:
        return {o: self.arrays[f"cotangent_{o}"] for o in self.spec.cotangents}

    @property
    def rejected_argument(self) -> Optional[str]:
        """The argument the expected error must name (the group's name says which)."""
        if self.expect_error is None:
            return None
        return "temperature" if "temperature" in self.group else "action_ids"

    def manifest_entry(self) -> Dict[str, Any]:
        """The JSON-serialisable description of this case (without file and hash);
        ``input_dtypes`` only where an input has its own dtype."""
        own = {"input_dtypes": dict(sorted(self.input_dtypes.items()))} \
            if self.input_dtypes else {}
        return {
            "group": self.group,
            "op": self.op,
            "dtype": self.dtype,
            "lead_shape": list(self.lead_shape),
            "vocab": self.vocab,
            "options": dict(self.options),
            "tolerances": {k: t.as_dict() for k, t in sorted(self.tolerances.items())},
            "expect_error": self.expect_error,
            "description": self.description,
            **own,
        }


def _logit_scale(op: Op, args: Mapping[str, Any], mask: np.ndarray) -> float:
    """``max |logits / T|`` over active rows' finite entries of every logits argument."""
    temp = np.broadcast_to(np.asarray(args.get("temperature", 1.0), dtype=np.float64), mask.shape)
    scale = 0.0
    for key in op.logit_args:
        if args.get(key) is None:
            continue
        z = np.abs(np.asarray(args[key], dtype=np.float64)[mask] / temp[mask][:, None])
        z = z[np.isfinite(z)]
        scale = max(scale, float(z.max()) if z.size else 0.0)
    return scale


def build_case(
    name: str,
    group: str,
    op_name: str,
    dtype: str,
    inputs: Mapping[str, Any],
    *,
    options: Optional[Mapping[str, Any]] = None,
    cotangents: Optional[Mapping[str, np.ndarray]] = None,
    expect_error: Optional[str] = None,
    description: str = "",
    input_dtypes: Optional[Mapping[str, str]] = None,
) -> Case:
    """A case with float64 expectations from ``ratiokl.spec`` and tolerances from its table.

    ``inputs`` are arrays (logits arguments are rounded to ``dtype`` here, or to their own
    dtype in ``input_dtypes``: ``{"weight": "float32"}`` beside bfloat16 hidden states);
    ``options`` are scalars (``kl_estimator``, a scalar ``temperature``);
    ``cotangents`` maps each of the op's differentiable outputs to ``[...]``.
    With ``expect_error`` the call must raise that exception type instead.
    """
    op = OPS[op_name]
    options = dict(options or {})
    own = _input_dtypes(op, dtype, input_dtypes)
    dtypes = {key: own.get(key, dtype) for key in op.logit_args}
    arrays: Dict[str, np.ndarray] = {}
    for key, value in inputs.items():
        value = np.asarray(value)
        if key in op.logit_args:
            value = round_to_dtype(value, dtypes[key])
        elif value.dtype.kind == "f":
            value = value.astype(np.float32)
        arrays[key] = np.ascontiguousarray(value)
    args = {k: arrays[k] for k in op.arguments if k in arrays}
    args.update({k: v for k, v in options.items() if k in op.arguments})
    tolerances: Dict[str, Tolerance] = {}
    if expect_error is None:
        for out, value in op.reference(args).items():
            arrays[f"expected_{out}"] = np.asarray(value, dtype=np.float64)
        cot = {o: np.asarray(cotangents[o], dtype=np.float32) for o in op.cotangents}
        arrays.update({f"cotangent_{o}": c for o, c in cot.items()})
        grads = op.reference_grad(args, cot)
        if not op.also_differentiate:
            grads = {op.differentiate: grads}
        for key, grad in grads.items():
            suffix = "" if key == op.differentiate else f"_{key}"
            arrays[f"expected_grad{suffix}"] = np.asarray(grad, dtype=np.float64)
        if op.case_tolerances is not None:
            tolerances = op.case_tolerances(args, cot, dtypes)
        else:
            grad = arrays["expected_grad"]
            mask = Case(name, group, op_name, dtype, arrays, options, {}).row_mask
            finite = np.abs(grad[np.isfinite(grad)])
            grad_scale = float(finite.max()) if finite.size else 0.0
            tolerances = op.tolerances(op, dtypes[op.differentiate],
                                       _logit_scale(op, args, mask), grad_scale)
    return Case(name, group, op_name, dtype, arrays, options, tolerances, expect_error, description,
                own)


def _input_dtypes(op: Op, dtype: str, given: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """``given`` checked (logits arguments of ``op``, known dtypes), without the entries that
    repeat ``dtype``."""
    own: Dict[str, str] = {}
    for key, value in (given or {}).items():
        if key not in op.logit_args:
            raise ValueError(f"`input_dtypes` names {key!r}, which {op.name} does not cast; "
                             f"name one of {op.logit_args}")
        if value not in LOGIT_DTYPES:
            raise ValueError(f"`input_dtypes[{key!r}]` must be one of {LOGIT_DTYPES}; "
                             f"got {value!r}")
        if value != dtype:
            own[key] = value
    return own


def write_npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Arrays as ``.npz`` bytes that depend only on the arrays (no timestamps, sorted, stored)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            member = io.BytesIO()
            # order="C", not ascontiguousarray: a 0-d array (a scalar loss) stays 0-d.
            array = np.asarray(arrays[key], order="C")
            np.lib.format.write_array(member, array, allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system = 3
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue())
    return buf.getvalue()


def read_npz(data: bytes) -> Dict[str, np.ndarray]:
    """The arrays of ``.npz`` bytes (no pickles)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
