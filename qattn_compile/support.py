"""What qattn's attention can serve, device aside: the one place for those rules.

Every path asks :func:`shape_refusal` — the GPU kernels (:func:`qattn_compile.kernels.supports`
adds the rules of the device: CUDA capability, FP8 tensor cores, grid limits), the op and the
rewrite (:func:`qattn_compile.ops.unsupported_reason`), hence ``qattn explain`` and the eager
API — so a CPU machine, which runs the reference, reports for a site what the GPU will do.
Shapes are ``[B, H, L, D]`` (ints or size hints).
"""

from __future__ import annotations

MAX_HEAD_DIM = 256
"""The widest head the kernels tile (Q·Kᵀ and P·V keep a whole head in registers)."""


def shape_refusal(q_shape, k_shape, v_shape) -> str | None:
    """Why no path serves attention of these shapes (a sentence naming them), or None."""
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return (f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}: the kernels take "
                "4-D [B, H, L, D]")
    d, dv = q_shape[-1], v_shape[-1]
    if k_shape[-1] != d:
        return f"query head dim {d} != key head dim {k_shape[-1]}"
    if min(d, dv) < 1:
        return f"head dim 0 (q {tuple(q_shape)}, v {tuple(v_shape)})"
    if max(d, dv) > MAX_HEAD_DIM:
        return (f"head dim {max(d, dv)} of q {tuple(q_shape)} / v {tuple(v_shape)} > "
                f"{MAX_HEAD_DIM}")
    if q_shape[0] != k_shape[0] or tuple(k_shape[:3]) != tuple(v_shape[:3]):
        return (f"batch/heads/length of q {tuple(q_shape)}, k {tuple(k_shape)}, "
                f"v {tuple(v_shape)} disagree")
    if k_shape[1] == 0 or q_shape[1] % k_shape[1]:
        return f"query heads {q_shape[1]} not a multiple of key/value heads {k_shape[1]}"
    return None


def alibi_refusal(slopes_shape, batch: int, heads: int) -> str | None:
    """Why ALiBi slopes of ``slopes_shape`` do not fit queries of ``batch`` × ``heads`` heads
    (one slope per query head: ``[heads]`` or ``[batch, heads]``), or None."""
    if tuple(slopes_shape) in ((heads,), (batch, heads)):
        return None
    return (f"alibi_slopes of shape {tuple(slopes_shape)}: expected [{heads}] or "
            f"[{batch}, {heads}] (one slope per query head)")
