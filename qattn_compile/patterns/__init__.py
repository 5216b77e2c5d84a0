"""Attention site finders: each returns :class:`AttentionSite` records for an FX graph."""

from .sdpa import find_sdpa_sites
from .site import AttentionSite


def find_attention_sites(gm) -> list[AttentionSite]:
    """Every attention site of a dynamo FX graph, in graph order."""
    return find_sdpa_sites(gm)


__all__ = ["AttentionSite", "find_attention_sites", "find_sdpa_sites"]
