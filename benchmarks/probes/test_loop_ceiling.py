"""benchmarks/probes/loop_ceiling.py's bare attention loop computes attention (Triton interpreter on
CPU, 2 heads; the benchmark itself times it on the H100). A ceiling measured on a loop that
computed something else would say nothing about our kernel."""

import importlib.util
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="interpreter test; the benchmark runs on the GPU")


@pytest.fixture
def loop_ceiling(monkeypatch):
    path = Path(__file__).resolve().parent / "loop_ceiling.py"
    spec = importlib.util.spec_from_file_location("loop_ceiling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "HEADS", 2)
    monkeypatch.setattr(module, "MAX_PASS_CONFIG", (64, 64, 4, 1))  # tiles that divide n
    return module


@pytest.mark.parametrize("qk, pv", [("fp8", "fp8"), ("int8", "fp8"), ("int8", "int8-row"),
                                    ("int8", "int8-tile"), ("int8", "oracle-max"),
                                    ("fp8", "oracle-max"), ("int8", "two-pass")])
def test_bare_loop_matches_softmax_attention(loop_ceiling, qk, pv):
    n, d, cfg = 192, 32, (64, 64, 4, 1)
    q, k, v, vt, qk_scale = loop_ceiling.inputs(n, d, qk, pv, device="cpu")
    ref = loop_ceiling.reference(q, k, v, n, qk_scale, heads=2)

    def rel_l1(scale):
        m_ref = None
        if pv == "oracle-max":
            m_ref = loop_ceiling.row_max_log2(q, k, n, scale)
        elif pv == "two-pass":  # the first pass must fill every row
            m_ref = torch.full((loop_ceiling.HEADS * n,), float("nan"))
        out = loop_ceiling._run(q, k, vt, n, d, cfg, False, scale, pv, m_ref)
        return ((out - ref).abs().sum() / ref.abs().sum()).item()

    # P rounded to e4m3 gives ~2.5 % on the GPU; the interpreter's fp32→fp8 conversion
    # mis-rounds some values on top (~5 % here); INT8 P ~1–3 %. A softmax scale 20 % off
    # gives ~26 %.
    err, err_wrong_scale = rel_l1(qk_scale), rel_l1(1.2 * qk_scale)
    assert err < 0.1, err
    assert err_wrong_scale > 3 * err, (err, err_wrong_scale)


@pytest.mark.parametrize("qk", ["int8", "fp8"])
def test_first_pass_finds_each_rows_max(loop_ceiling, qk):
    """``two-pass``'s first pass gives the host's row max (the max is taken on the raw scores
    and scaled once). Each of the three 64-key tiles holds some rows' max, so a pass that
    skipped a key tile (or a row) would differ."""
    n, d = 192, 32
    q, k, _, _, qk_scale = loop_ceiling.inputs(n, d, qk, "two-pass", device="cpu")
    got = loop_ceiling.row_max_on_device(q, k, n, d, qk_scale)
    want = loop_ceiling.row_max_log2(q, k, n, qk_scale)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
