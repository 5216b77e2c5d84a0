"""Error metrics (SageAttention's convention), always computed in float64."""

from __future__ import annotations

import torch


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Cosine similarity, relative L1 (Σ|o−r| / Σ|r|) and RMSE of ``out`` against ``ref``."""
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    rel_l1 = ((o - r).abs().sum() / r.abs().sum().clamp(min=1e-300)).item()
    rmse = (o - r).pow(2).mean().sqrt().item()
    return {"cos": cos, "rel_l1": rel_l1, "rmse": rmse}
