"""How close a result must be to its reference: one table, by dtype (DESIGN.md, "Tests that mean
something").

    dtype       step     chain     what the columns mean
    float64     1e-12    1e-10     step:  one attention's forward (a softmax and two matmuls), the same
    float32     1e-6     1e-5             formula in another order: kernels against each other, against
    float16     2e-3     1e-2             the float64 oracle, against torch in the same dtype
    bfloat16    2e-2     5e-2      chain: a gradient, or projections around the attention (a few
                                          such steps one after another)

float64 columns are the oracle's: a wrong mask, scale or merge is off by far more than 1e-10. The
other rows follow each dtype's epsilon (float32 ~1.2e-7, float16 ~9.8e-4, bfloat16 ~7.8e-3); the low
precision types accumulate in float32, so their error is the rounding of the inputs and of the output.
Where torch itself is the yardstick, `assert_within_torch_error` applies DESIGN's float32 rule (at
most 2x torch's own error against the float64 oracle, plus 1e-6).

Every comparison is absolute (rtol=0): attention's outputs are convex combinations of the values,
O(1) for the tests' inputs.
"""

from __future__ import annotations

import numpy as np
import torch

_STEP = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
_CHAIN = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
_NUMPY = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return _NUMPY[np.dtype(dtype)]


def _tensors(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (tuple, list)) and len(x) > 0 and all(map(_tensors, x)))


def dtype_of(x) -> torch.dtype:
    """The dtype of a tensor or an array (a NumPy float dtype as torch's); of a tuple of tensors, its first's."""
    if isinstance(x, torch.Tensor):
        return x.dtype
    if _tensors(x):
        return dtype_of(x[0])
    return _torch_dtype(np.asarray(x).dtype)


def tolerance(dtype, *, chain: bool = False) -> float:
    """The largest |got - want| allowed for a result in ``dtype`` (torch or NumPy): one attention
    step, or (``chain=True``) a gradient or a chain of steps. See the table above."""
    return (_CHAIN if chain else _STEP)[_torch_dtype(dtype)]


def assert_close(got, want, dtype=None, *, chain: bool = False, err_msg: str = "") -> None:
    """``got`` equals ``want`` within ``tolerance(dtype)`` (default: ``got``'s dtype), absolutely.
    Tensors (or tuples of them, compared pairwise) or arrays, either side. NaN as the underlying check
    has it (torch's: never equal; NumPy's: equal where both are NaN): no comparison got looser here."""
    atol = tolerance(dtype_of(got) if dtype is None else dtype, chain=chain)
    if _tensors(got) and _tensors(want):
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=err_msg or None)
        return
    np.testing.assert_allclose(_numpy(got), _numpy(want), atol=atol, rtol=0, err_msg=err_msg)


def _numpy(x):
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return (x.double() if x.dtype in (torch.bfloat16, torch.float16) else x).numpy()
    return x


def max_error(x, reference) -> float:
    """The largest |x - reference| (float64 arithmetic)."""
    return float(np.max(np.abs(np.asarray(_numpy(x), np.float64) - np.asarray(_numpy(reference), np.float64)), initial=0.0))


def rms_error(x, reference) -> float:
    """The root mean square of x - reference (float64 arithmetic)."""
    diff = np.asarray(_numpy(x), np.float64) - np.asarray(_numpy(reference), np.float64)
    return float(np.sqrt(np.mean(diff**2))) if diff.size else 0.0


def assert_within_torch_error(ours, theirs, reference, *, floor: float = 1e-6, err_msg: str = "",
                              typical: bool = False) -> None:
    """DESIGN's rule for a low-precision result: our error against the float64 ``reference`` is at
    most twice torch's own (``theirs``, computed by torch in the same dtype) plus ``floor``.

    ``typical``: for results that sum in another order than torch's, where which of a few hundred
    values happens to be rounded worst is a toss: the rule holds for the root mean square error,
    and the largest error stays within four times torch's (a single wrong value still fails)."""
    if typical:
        mine, torchs = rms_error(ours, reference), rms_error(theirs, reference)
        assert mine <= 2 * torchs + floor / 10, (
            f"{err_msg}: rms error {mine:.3g} against torch's {torchs:.3g} (allowed 2x + {floor / 10:g})")
        worst, torchs_worst = max_error(ours, reference), max_error(theirs, reference)
        assert worst <= 4 * torchs_worst + floor, (
            f"{err_msg}: largest error {worst:.3g} against torch's {torchs_worst:.3g} (allowed 4x + {floor:g})")
        return
    mine, torchs = max_error(ours, reference), max_error(theirs, reference)
    assert mine <= 2 * torchs + floor, f"{err_msg}: error {mine:.3g} against torch's {torchs:.3g} (allowed 2x + {floor:g})"
