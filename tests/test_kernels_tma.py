"""TMA-descriptor loads of K and V give the same attention as pointer loads (Triton
interpreter on CPU; benchmarks/probes/sweep.py checks the same on the H100).

The descriptor path changes only how tiles are read (zero-filled boxes instead of masked
loads); the arithmetic per tile is the same, so outputs must be bit-identical.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from qattn_compile.kernels import prepare_attention  # noqa: E402
from qattn_compile.kernels.heuristics import AttentionConfig  # noqa: E402
from qattn_compile.reference import exact_attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter test; benchmarks/probes/sweep.py checks the GPU"
)

POINTERS = AttentionConfig(32, 32, 4, 1)
DESCRIPTORS = AttentionConfig(32, 32, 4, 1, tma=True)


def _inputs(lq: int, lkv: int, dim: int, hq: int = 4, hkv: int = 2, seed: int = 0):
    """q ``[1, hq, lq, dim]``, k/v ``[1, hkv, lkv, dim]`` float16 N(0,1), K with channel
    outliers (every 8th channel shifted by 6)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, lq, dim, generator=gen)
    k = torch.randn(1, hkv, lkv, dim, generator=gen)
    k[..., ::8] += 6.0
    v = torch.randn(1, hkv, lkv, dim, generator=gen)
    return q.half(), k.half(), v.half()


def _run(q, k, v, preset, cfg, options=None, mask=None, causal=False, descriptors=None):
    """The kernel's output with tile ``cfg``; ``descriptors`` (default: ``cfg.tma``) is the
    load path the call must take."""
    call = prepare_attention(q, k, v, mask, causal, None, preset, options, config=cfg)
    expected = cfg.tma if descriptors is None else descriptors
    assert call.loads_by_tma == expected, (preset, tuple(call.ops.k.shape), call.ops.k.stride())
    return call.run()


@pytest.mark.parametrize(
    ("preset", "options"),
    [
        ("flash", None),
        ("int_flash", None),
        ("sage2_8b", None),
        ("sage2_4b", None),  # packed INT4 rows of 32/40 bytes: D=80 falls back to pointers
        ("fp8", {"granularity": "block"}),
        ("fp8", {"granularity": "q_token"}),
        ("fmha_int8", None),
        ("turbo", None),
    ],
)
@pytest.mark.parametrize(("lq", "lkv", "dim", "causal"), [(40, 72, 64, False), (72, 72, 80, True)])
def test_descriptor_path_matches_pointer_path(preset, options, lq, lkv, dim, causal):
    q, k, v = _inputs(lq, lkv, dim)
    expected = _run(q, k, v, preset, POINTERS, options, causal=causal)
    # INT4 rows of D/2 bytes: 40 at D=80 is no multiple of 16, so no descriptor can address K
    descriptors = not (preset == "sage2_4b" and dim == 80)
    got = _run(q, k, v, preset, DESCRIPTORS, options, causal=causal, descriptors=descriptors)
    assert torch.equal(got, expected)
    # and both are attention: error against exact attention like any kernel of the preset
    exact = exact_attention(q.double(), k.double(), v.double(), is_causal=causal)
    rel_l1 = ((got.double() - exact).abs().sum() / exact.abs().sum()).item()
    assert rel_l1 < (0.3 if preset == "sage2_4b" else 0.08), rel_l1


@pytest.mark.parametrize("lkv", [70, 33])
def test_ragged_lengths(lkv):
    """Lkv not a multiple of the tile: the boxes beyond Lkv read zeros, same output."""
    q, k, v = _inputs(33, lkv, 64)
    for preset in ("sage2_8b", "int_flash"):
        expected = _run(q, k, v, preset, POINTERS)
        assert torch.equal(_run(q, k, v, preset, DESCRIPTORS), expected)


def test_tensor_mask_with_fully_masked_row():
    """Tensor masks read the same tiles through descriptors; a fully masked query row gives
    0 either way."""
    q, k, v = _inputs(40, 72, 64)
    mask = torch.rand(1, 1, 40, 72, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 5, :] = False
    expected = _run(q, k, v, "int_flash", POINTERS, mask=mask)
    got = _run(q, k, v, "int_flash", DESCRIPTORS, mask=mask)
    assert torch.equal(got, expected)
    assert got[..., 5, :].abs().max() == 0
    assert got[..., 6, :].abs().max() > 0
