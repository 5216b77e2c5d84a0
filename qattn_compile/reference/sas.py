"""TurboAttention's SAS exponential (sparse activated softmax), in plain PyTorch.

For ``x <= 0`` (a score minus its row max), ``exp(x) = 2^y`` with ``y = x·log2(e)``:

- ``n = floor(y)`` (an integer <= 0) and ``f = y − n`` in ``[0, 1)``;
- ``2^f ≈ p(f) = ((c3·f + c2)·f + c1)·f + c0`` (Horner, in the input's float dtype),
  ``(c0, c1, c2, c3) =`` :data:`SAS_POLY`;
- ``2^n`` is exact (``torch.ldexp``; kernels build it from the exponent bits
  ``(n + 127) << 23``). For ``n < -126`` (below the smallest normal float32) the result is 0,
  as a bit construction that does not produce subnormals gives.
- ``x < threshold`` gives exactly 0 (the "sparse" part; also ``x = -inf``).

The polynomial is the minimax fit of the *relative* error of ``2^f`` on ``[0, 1]`` under the
constraints ``c0 = 1`` (so ``exp(0) = 1`` exactly: a row's max gets ``P = 1``) and
``p(1) = c0 + c1 + c2 + c3 = 2`` (so the approximation is continuous where ``n`` steps).
:func:`fit_sas_poly` reproduces it (Lawson's iteratively reweighted least squares on a dense
grid). Its max relative error on ``[0, 1]`` is :data:`SAS_MAX_REL_ERROR` ≈ 1.03e-4 (exact
arithmetic). In float32, rounding ``y = x·log2(e)`` adds up to about ``|x|·6e-8`` relative
error (≈ 4e-7 at the default threshold -6), the polynomial's own rounding ~1e-7.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SAS_POLY: tuple[float, float, float, float] = (
    1.0,
    0.695424347723987,
    0.22630768219335784,
    0.07826797008265514,
)
"""Coefficients ``(c0, c1, c2, c3)`` of ``2^f ≈ c0 + c1·f + c2·f² + c3·f³`` on ``[0, 1)``."""

SAS_MAX_REL_ERROR = 1.031e-4
"""Bound on ``|p(f) / 2^f − 1|`` over ``f ∈ [0, 1]`` (measured: 1.0304e-4)."""

LOG2E = 1.4426950408889634
"""log2(e), the factor taking natural-log scores to base-2 exponents."""

_MIN_NORMAL_EXP = -126


def sas_poly(f: Tensor) -> Tensor:
    """``p(f)`` by Horner's rule with :data:`SAS_POLY`, in f's dtype (f: any shape)."""
    c0, c1, c2, c3 = SAS_POLY
    return ((c3 * f + c2) * f + c1) * f + c0


def sas_exp(x: Tensor, threshold: float = -6.0) -> Tensor:
    """SAS approximation of ``exp(x)`` for ``x <= 0`` (same shape and float dtype as x).

    ``x < threshold`` (``threshold < 0``) and ``x = -inf`` give exactly 0; positive inputs
    are outside the method's domain and are clamped to 0 (giving 1).
    """
    if not threshold < 0:
        raise ValueError(f"sas threshold must be negative, got {threshold}")
    floor_y = math.floor(threshold * LOG2E) - 1
    y = (x.clamp(max=0.0) * LOG2E).clamp(min=float(floor_y))
    n = torch.floor(y)
    f = y - n
    value = torch.ldexp(sas_poly(f), n)
    dropped = (x < threshold) | (n < _MIN_NORMAL_EXP)
    return torch.where(dropped, torch.zeros_like(value), value)


def fit_sas_poly(points: int = 2001, iterations: int = 1000) -> tuple[float, float, float, float]:
    """Refit :data:`SAS_POLY`: constrained minimax of the relative error of ``2^f`` on [0, 1].

    With ``c0 = 1`` and ``c1 = 1 − c2 − c3`` (so ``p(1) = 2``),
    ``p(f) = 1 + f + c2·(f² − f) + c3·(f³ − f)`` has two free coefficients; Lawson's
    algorithm (weighted least squares whose weights grow with each point's error) converges
    to the minimax solution on a grid of ``points`` samples. Computed in float64 (weights are
    floored at 1e-200 to keep them out of the slow subnormal range); returns
    ``(c0, c1, c2, c3)``.
    """
    f = torch.linspace(0.0, 1.0, points, dtype=torch.float64)
    target = torch.exp2(f)
    basis = torch.stack((f * f - f, f * f * f - f), dim=1) / target[:, None]
    rhs = (target - 1.0 - f) / target
    weights = torch.full_like(f, 1.0 / points)
    coeffs = torch.zeros(2, dtype=torch.float64)
    for _ in range(iterations):
        root = weights.sqrt()
        coeffs = torch.linalg.lstsq(basis * root[:, None], rhs * root).solution
        weights = weights * (basis @ coeffs - rhs).abs()
        weights = (weights / weights.sum()).clamp_min(1e-200)
    c2, c3 = coeffs.tolist()
    return (1.0, 1.0 - c2 - c3, c2, c3)
