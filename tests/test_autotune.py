"""Autotuning of the attention kernel's tiles (qattn_compile.kernels.autotune) on CPU.

The kernels run under the Triton interpreter; timings are injected (an interpreter's wall
time says nothing about a GPU), so the tests check what the tuner does with them: the
fastest candidate is chosen and used, written to the cache file, read back without timing
again, and re-timed when the key or the file says so. The GPU side (tuning while Inductor
traces, a second compile not re-tuning) is in tests/test_lowering_gpu.py.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import logging  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

import qattn_compile  # noqa: E402
from qattn_compile import _compat  # noqa: E402
from qattn_compile.debug.table import kernel_variant  # noqa: E402
from qattn_compile.dynamo_backend import QattnBackend  # noqa: E402
from qattn_compile.kernels import autotune, heuristics, kernel_attention, prepare_attention  # noqa: E402
from qattn_compile.kernels.heuristics import (  # noqa: E402
    AttentionConfig,
    attention_candidates,
    attention_config,
)
from qattn_compile.presets import resolve_options  # noqa: E402
from qattn_compile.reference import exact_attention, reference_attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests (CPU); the GPU side is in tests/test_lowering_gpu.py",
)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """Every test gets an empty cache directory, no in-memory results and zeroed stats."""
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    autotune.clear_memory()
    autotune.stats.clear()
    yield
    autotune.clear_memory()


def _fake_timer(times_ms):
    """A ``time_call`` that runs the candidate once (it must work) and then reports the next
    of ``times_ms``; records how often it was called."""
    calls = []

    def time_call(fn, device):
        out = fn()
        assert not out.isnan().any()
        calls.append(out)
        return times_ms[len(calls) - 1]

    return time_call, calls


def _qkv(lq=45, d=64):
    return (torch.randn(1, 2, lq, d, dtype=torch.float16) for _ in range(3))


def test_fastest_candidate_is_used_cached_and_not_retimed(monkeypatch):
    candidates = attention_candidates("int_flash", 64, CPU, torch.float16)
    assert len(candidates) >= 2 and candidates[0] != candidates[1]
    times = [5.0, 1.0] + [9.0] * (len(candidates) - 2)  # the second candidate is fastest
    timer, calls = _fake_timer(times)
    monkeypatch.setattr(autotune, "time_call", timer)
    q, k, v = _qkv()
    opts = {"autotune": True}
    call = prepare_attention(q, k, v, preset="int_flash", options=opts)
    assert call.cfg == candidates[1]
    assert len(calls) == len(candidates) and autotune.stats["tuned"] == 1

    entries = json.loads(autotune.cache_path().read_text())["entries"]
    (name, entry), = entries.items()
    assert AttentionConfig(**entry["config"]) == candidates[1]
    assert len(entry["timings_ms"]) == len(candidates)
    assert json.loads(name)["preset"] == "int_flash"

    # a new process: memory empty, the file answers; nothing is timed again
    autotune.clear_memory()
    monkeypatch.setattr(autotune, "time_call", lambda fn, device: pytest.fail("re-tuned"))
    out = kernel_attention(q, k, v, preset="int_flash", options=opts)
    assert prepare_attention(q, k, v, preset="int_flash", options=opts).cfg == candidates[1]
    assert autotune.stats["tuned"] == 1 and autotune.stats["hits"] >= 2

    # the tuned tile computes the preset's math: the reference over the same key tile
    ref = reference_attention(q, k, v, preset="int_flash", key_tile=candidates[1].block_n)
    exact = exact_attention(q, k, v)
    err_k = ((out.double() - exact).abs().sum() / exact.abs().sum()).item()
    err_r = ((ref.double() - exact).abs().sum() / exact.abs().sum()).item()
    assert err_k <= 1.05 * err_r + 1e-3


def test_static_scales_traced_as_fake_tensors_do_not_reach_the_timed_kernels(monkeypatch):
    """Under torch.compile the static α that a ``scales: static`` call resolves are fake
    tensors; the tuner times real kernels on random inputs, so it must not launch with them
    (on the GPU every compiled static site with ``autotune`` failed with "Cannot access data
    pointer of Tensor")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qattn_compile.kernels import launch

    timer, calls = _fake_timer([2.0, 1.0] + [3.0] * 8)
    monkeypatch.setattr(autotune, "time_call", timer)
    with FakeTensorMode():
        traced = {name: torch.full((1, 2, 1), 3.0) for name in ("q", "k", "v")}
    q, k, v = _qkv(lq=40, d=32)
    opts = resolve_options("fmha_int8", {"scales": "static", "static_scales": {"q": 3.0, "k": 3.0, "v": 3.0},
                                         "autotune": True})
    candidates = attention_candidates("fmha_int8", 32, CPU, torch.float16)
    best = launch._autotuned("fmha_int8", opts, traced, q, k, v, None, True, None, candidates)
    assert best == candidates[1] and len(calls) == len(candidates)


def test_without_autotune_the_table_decides(monkeypatch):
    monkeypatch.setattr(autotune, "time_call", lambda fn, device: pytest.fail("timed"))
    q, k, v = _qkv()
    call = prepare_attention(q, k, v, preset="sage2_8b")
    assert call.cfg == attention_candidates("sage2_8b", 64, CPU, torch.float16, smooth_q=True)[0]
    assert not autotune.cache_path().exists()


def _key(preset="int_flash", options=None, lq=45, lkv=45, causal=False, mask=None,
         heads_inside_tokens=False, scale=None):
    opts = resolve_options(preset, options)
    shapes = [(2, 2, lq, 64), (2, 2, lkv, 64), (2, 2, lkv, 64)]
    if heads_inside_tokens:  # [B, L, H, D] buffers viewed as [B, H, L, D]
        strides = [(n * 128, 64, 128, 1) for n in (lq, lkv, lkv)]
    else:
        strides = [(n * 128, n * 64, 64, 1) for n in (lq, lkv, lkv)]
    return autotune.TuneKey.of(preset, opts, shapes, strides, torch.float16, mask, causal, scale,
                               register_cap=False)


def test_key_buckets_lengths_and_separates_what_matters():
    assert _key(lq=45, lkv=45) == _key(lq=50, lkv=64)  # same power-of-two buckets
    assert _key(options={"autotune": True}) == _key()  # the switch itself is not part of it
    assert _key(scale=0.3) == _key()  # only the scale's sign specialises the kernel
    # fmha_int8's per-site calibration does not change the fastest tile
    calibrated = [
        _key("fmha_int8", {"scales": "static", "calibration": path,
                           "static_scales": {"q": alpha, "k": 1.0, "v": 1.0}})
        for path, alpha in [("cal.json", 1.0), ("/abs/cal.json", 1.5)]
    ]
    assert calibrated[0] == calibrated[1]
    distinct = {
        _key(), _key(lq=100), _key(lkv=100), _key(causal=True), _key("fmha_int8"),
        _key(options={"p_scale": "row"}), _key(mask=torch.ones(1, dtype=torch.bool)),
        _key(mask=torch.zeros(1)), _key(heads_inside_tokens=True), _key(scale=-0.3),
    }
    assert len(distinct) == 10
    assert _key().layout == "0123/0123/0123"
    assert _key(heads_inside_tokens=True).layout == "0213/0213/0213"
    env = json.loads(_key().text(CPU))
    assert {"gpu", "torch", "triton", "kernel"} <= set(env)


@pytest.mark.parametrize("arch", ["sm90", "sm80", "interp"])
def test_candidates_meet_the_constraints(monkeypatch, arch):
    """Every arch's candidates, shrunk to the constraints that apply, pass the checks
    attention_config makes of an override (the one statement of those constraints)."""
    monkeypatch.setattr(heuristics, "arch_of", lambda device: arch)
    for dim in (32, 64, 128, 256):
        for v_block, smooth_q in [(0, False), (64, False), (0, True), (64, True), (128, False)]:
            found = attention_candidates("int_flash", dim, CPU, v_block=v_block,
                                         smooth_q=smooth_q)
            assert len(found) == len(set(found))
            for cfg in found:
                assert attention_config("int_flash", dim, CPU, v_block=v_block,
                                        smooth_q=smooth_q, override=cfg) == cfg
                assert not v_block or v_block % cfg.block_n == 0
                assert not smooth_q or (128 % cfg.block_m == 0 and cfg.block_n <= 256)


def _tune(measure, candidates=(AttentionConfig(32, 32, 4, 1), AttentionConfig(64, 32, 4, 1))):
    return autotune.tuned_config(_key(), CPU, list(candidates), lambda: None, measure)


def test_candidate_that_does_not_fit_is_skipped_and_none_fitting_is_an_error():
    def measure(cfg, inputs):
        if cfg.block_m == 64:
            raise OutOfResources(300000, 232448, "shared memory")
        return 1.0

    assert _tune(measure) == AttentionConfig(32, 32, 4, 1)
    autotune.clear_memory()
    autotune.cache_path().unlink()

    def nothing_fits(cfg, inputs):
        raise OutOfResources(300000, 232448, "shared memory")

    with pytest.raises(RuntimeError, match="no candidate tile fits"):
        _tune(nothing_fits)


def test_unreadable_cache_is_reported_and_replaced(caplog):
    path = autotune.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="qattn_compile.kernels.autotune"):
        assert _tune(lambda cfg, inputs: float(cfg.block_m)) == AttentionConfig(32, 32, 4, 1)
    assert "unreadable cache" in caplog.text
    assert len(json.loads(path.read_text())["entries"]) == 1


def test_unwritable_cache_dir_is_reported_and_the_result_still_used(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(blocker))
    with caplog.at_level(logging.WARNING, logger="qattn_compile.kernels.autotune"):
        assert _tune(lambda cfg, inputs: float(cfg.block_m)) == AttentionConfig(32, 32, 4, 1)
    assert "cannot write" in caplog.text and autotune.CACHE_DIR_ENV in caplog.text
    assert _tune(lambda cfg, inputs: pytest.fail("re-tuned")) == AttentionConfig(32, 32, 4, 1)


def test_a_cache_the_os_does_not_let_us_read_is_left_as_it_is(monkeypatch, caplog):
    """A read the OS refuses (another user's file, an I/O error) must not make the write
    replace every entry with this one: the file stays, the result still serves."""
    assert _tune(lambda cfg, inputs: float(cfg.block_m)) == AttentionConfig(32, 32, 4, 1)
    path = autotune.cache_path()
    before = path.read_text()
    autotune.clear_memory()
    read_text = Path.read_text

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    with caplog.at_level(logging.WARNING, logger="qattn_compile.kernels.autotune"):
        tuned = autotune.tuned_config(_key(lq=4000), CPU, [AttentionConfig(32, 32, 4, 1)],
                                      lambda: None, lambda cfg, inputs: 1.0)
    monkeypatch.setattr(Path, "read_text", read_text)
    assert tuned == AttentionConfig(32, 32, 4, 1) and autotune.stats["tuned"] == 2
    assert path.read_text() == before and "cannot write" in caplog.text


def test_the_cache_file_takes_the_umask_and_a_failed_write_leaves_no_temp_file(monkeypatch):
    old = os.umask(0o002)
    try:
        _tune(lambda cfg, inputs: float(cfg.block_m))
    finally:
        os.umask(old)
    path = autotune.cache_path()
    assert path.stat().st_mode & 0o777 == 0o664  # shared with the group (mkstemp makes 0600)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(autotune.json, "dump", full_disk)
    with pytest.raises(OSError, match="No space left"):
        autotune._write(path, "another", {"config": {}})
    assert sorted(p.name for p in path.parent.iterdir()) == ["autotune.json", "autotune.json.lock"]


def test_out_of_gpu_memory_while_timing_gives_the_table_tile_uncached(caplog):
    def no_memory():
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    candidates = [AttentionConfig(32, 32, 4, 1), AttentionConfig(64, 32, 4, 1)]
    with caplog.at_level(logging.WARNING, logger="qattn_compile.kernels.autotune"):
        got = autotune.tuned_config(_key(), CPU, candidates, no_memory, lambda cfg, inputs: 1.0)
    assert got == candidates[0] and "out of GPU memory" in caplog.text
    assert not autotune.cache_path().exists() and autotune.stats["tuned"] == 0


def test_a_hand_edited_cached_tile_equal_to_a_candidate_is_launched_with_its_types():
    name = _key().text(CPU)
    path = autotune.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = {"block_m": 64.0, "block_n": 32, "num_warps": 4, "num_stages": 1, "tma": 0}
    path.write_text(json.dumps({"version": autotune.CACHE_VERSION, "entries": {name: {"config": stored}}}))
    got = _tune(lambda cfg, inputs: pytest.fail("re-tuned"))
    assert got == AttentionConfig(64, 32, 4, 1) and type(got.block_m) is int and got.tma is False


@pytest.mark.parametrize("entries", [[], None, "x"])
def test_cache_whose_entries_are_not_a_mapping_is_reported_and_replaced(entries, caplog):
    path = autotune.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": autotune.CACHE_VERSION, "entries": entries}))
    with caplog.at_level(logging.WARNING, logger="qattn_compile.kernels.autotune"):
        assert _tune(lambda cfg, inputs: float(cfg.block_m)) == AttentionConfig(32, 32, 4, 1)
    assert "not a mapping" in caplog.text
    assert len(json.loads(path.read_text())["entries"]) == 1


@pytest.mark.parametrize("stored", [
    {"block_m": "64", "block_n": 32, "num_warps": 4, "num_stages": 1},  # a hand-edited type
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1},  # not a candidate now
])
def test_cached_tile_that_is_not_a_candidate_is_tuned_again(stored, caplog):
    name = _key().text(CPU)
    path = autotune.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": autotune.CACHE_VERSION,
                                "entries": {name: {"config": stored}}}))
    with caplog.at_level(logging.WARNING, logger="qattn_compile.kernels.autotune"):
        assert _tune(lambda cfg, inputs: float(cfg.block_m)) == AttentionConfig(32, 32, 4, 1)
    assert autotune.stats["tuned"] == 1 and autotune.stats["hits"] == 0
    stored_now = json.loads(path.read_text())["entries"][name]["config"]
    assert AttentionConfig(**stored_now) == AttentionConfig(32, 32, 4, 1)


def test_every_length_of_a_bucket_gets_the_same_candidates(monkeypatch):
    """Calls whose lengths share a power-of-two bucket share a cache entry, so their candidate
    sets must match (else a cached tile of one is not a candidate of the other, and each
    re-tunes): the capped long-sequence tile is a candidate below its 4096 keys too."""
    monkeypatch.setattr(heuristics, "arch_of", lambda device: "sm90")
    for preset, dim in [("sage2_8b", 128), ("fp8", 64), ("int_flash", 64)]:
        args = dict(smooth_q=preset == "sage2_8b", v_block=128 if preset == "fp8" else 0,
                    causal_only=True, register_cap=True)
        sets = {frozenset(attention_candidates(preset, dim, CPU, keys=n, **args))
                for n in (2049, 3000, 4096)}
        assert len(sets) == 1, preset
        assert any(cfg.maxnreg for cfg in sets.pop()), preset


def test_cache_dir_with_a_tilde_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(autotune.CACHE_DIR_ENV, "~/qattn-cache")
    assert autotune.cache_path() == tmp_path / "qattn-cache" / autotune.CACHE_FILE


@pytest.mark.skipif(autotune.fcntl is None, reason="no fcntl: cache writes are not locked")
def test_a_write_waits_for_another_writer_and_keeps_its_entry():
    """Two processes tuning at once: the second writer reads the file only after the first
    has replaced it, so both entries survive (without the lock the first one's replace,
    made from what it read before, dropped the second's entry)."""
    import subprocess
    import sys
    import time

    path = autotune.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    code = ("from pathlib import Path; from qattn_compile.kernels import autotune; "
            f"autotune._write(Path({str(path)!r}), 'B', {{'config': {{}}}})")
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        autotune.fcntl.flock(lock, autotune.fcntl.LOCK_EX)
        entries = autotune._read(path)  # this writer's read, before the other one writes
        other = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(1.0)
        assert other.poll() is None, "the other writer did not wait for the lock"
        entries["A"] = {"config": {}}
        path.write_text(json.dumps({"version": autotune.CACHE_VERSION, "entries": entries}))
        autotune.fcntl.flock(lock, autotune.fcntl.LOCK_UN)
    assert other.wait(timeout=120) == 0
    assert set(json.loads(path.read_text())["entries"]) == {"A", "B"}


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    "backend_options, expected",
    [({"autotune": True}, True), ({}, False), ({"mode": "max-autotune"}, True),
     ({"mode": "max-autotune", "autotune": False}, False)],
)
def test_backend_option_sets_every_site(backend_options, expected, caplog):
    caplog.set_level(logging.INFO, logger="qattn_compile")
    mode = backend_options.pop("mode", None)
    be = QattnBackend(
        {"qattn": 1, "default": "sage2_8b"}, mode=mode, compiler="eager", **backend_options
    )
    _compat.reset_dynamo()
    q = torch.randn(1, 2, 16, 32)
    torch.compile(_sdpa, backend=be)(q, q, q)
    (report,) = be.site_reports
    assert report.options["autotune"] is expected
    assert report.execution == "reference"  # on CPU: no tiles to time, and the table says none
    assert not kernel_variant(report).endswith("tiles=autotuned")
    assert ("autotune has no effect here (the reference path runs" in caplog.text) is expected
    report.execution = "triton"  # what the same site reports on CUDA
    assert kernel_variant(report).endswith("tiles=autotuned") is expected
    _compat.reset_dynamo()


def test_backend_autotune_option_must_be_a_bool():
    with pytest.raises(qattn_compile.OptionsError, match="`autotune` must be true or false"):
        qattn_compile.backend({"qattn": 1, "default": "flash"}, autotune="yes")


def test_random_inputs_keep_the_memory_order_of_the_call():
    x = torch.empty(2, 5, 3, 4).transpose(1, 2)  # [B, H, L, D] stored [B, L, H, D]
    made = autotune.random_like_layout(x.shape, x.stride(), torch.float16, CPU)
    assert made.shape == x.shape and made.stride() == x.stride() and made.dtype == torch.float16


def test_native_pv_sage2_takes_its_own_h100_tile(monkeypatch):
    """sage2_8b with ``pv: fp16`` runs its P·V on 16-bit operands; on the H100 the table gives
    it the tile measured for that (128×64), not the FP8-P·V preset's (64×128)."""
    monkeypatch.setattr(heuristics, "arch_of", lambda device: "sm90")
    q, k, v = (torch.randn(1, 2, 40, 128, dtype=torch.float16) for _ in range(3))
    plans = {pv: prepare_attention(q, k, v, preset="sage2_8b", options={"pv": pv}).cfg
             for pv in ("fp16", "fp8")}
    assert plans == {"fp16": AttentionConfig(128, 64, 4, 3, tma=True),
                     "fp8": AttentionConfig(64, 64, 4, 3, tma=True)}  # 40 keys: the short tile
    d64 = {pv: prepare_attention(*(t[..., :64] for t in (q, k, v)), preset="sage2_8b",
                                 options={"pv": pv}).cfg
           for pv in ("fp16", "fp8")}
    assert d64 == {"fp16": AttentionConfig(64, 128, 4, 3, tma=True),  # no entry of its own
                   "fp8": AttentionConfig(64, 64, 4, 3)}  # 40 keys: the short tile


def test_short_key_lengths_take_their_measured_h100_tiles(monkeypatch):
    """Up to each entry's key length the table gives the tile measured for short sequences
    (sage2_8b and fp8 at D=128: 64×64; sage2_8b at D=64 up to 1K keys: 64×64 pointer loads),
    beyond it the long-sequence tile; int_flash has no short entry, and the autotuner's
    first candidate is the same entry."""
    monkeypatch.setattr(heuristics, "arch_of", lambda device: "sm90")
    long_tile, square = AttentionConfig(64, 128, 4, 3, tma=True), AttentionConfig(64, 64, 4, 3, tma=True)
    cases = [("sage2_8b", 128, 4096, square), ("sage2_8b", 128, 4097, long_tile),
             ("fp8", 128, 2048, square), ("fp8", 128, 2049, long_tile),
             ("sage2_8b", 64, 1024, AttentionConfig(64, 64, 4, 3)), ("sage2_8b", 64, 1025, long_tile),
             ("int_flash", 128, 1024, long_tile), ("sage2_8b", 128, None, long_tile)]
    for preset, dim, keys, want in cases:
        smooth = preset == "sage2_8b"
        got = heuristics.attention_config(preset, dim, CPU, torch.bfloat16, smooth_q=smooth, keys=keys)
        first = heuristics.attention_candidates(preset, dim, CPU, torch.bfloat16, smooth_q=smooth,
                                                keys=keys)[0]
        assert got == first == want, (preset, dim, keys)


def test_unmasked_calls_take_their_measured_h100_tile(monkeypatch):
    """fp8 at D=128 without any mask takes two pipeline stages on the H100 (three programs per
    SM), with a causal flag or a tensor mask the table's three; short key lengths keep their
    own tile, other presets are unaffected. The launcher decides ``unmasked`` from the call,
    and the autotuner's first candidate is the same entry."""
    from qattn_compile.kernels import launch

    monkeypatch.setattr(heuristics, "arch_of", lambda device: "sm90")
    long_tile = AttentionConfig(64, 128, 4, 3, tma=True)
    two_stages = AttentionConfig(64, 128, 4, 2, tma=True)
    cases = [("fp8", 16384, True, two_stages), ("fp8", 16384, False, long_tile),
             ("fp8", 1024, True, AttentionConfig(64, 64, 4, 3, tma=True)),
             ("int_flash", 16384, True, long_tile), ("sage2_8b", 16384, True, long_tile)]
    for preset, keys, unmasked, want in cases:
        smooth = preset == "sage2_8b"
        got = heuristics.attention_config(preset, 128, CPU, torch.bfloat16, smooth_q=smooth,
                                          keys=keys, unmasked=unmasked)
        first = heuristics.attention_candidates(preset, 128, CPU, torch.bfloat16, smooth_q=smooth,
                                                keys=keys, unmasked=unmasked)[0]
        assert got == first == want, (preset, keys, unmasked)

    monkeypatch.setattr(launch, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(launch, "_unsupported", lambda *args: None)
    q, k, v = (torch.randn(1, 2, 3000, 128, dtype=torch.bfloat16) for _ in range(3))
    visible = torch.ones(3000, 3000, dtype=torch.bool)
    for kwargs, want in [({}, two_stages), ({"is_causal": True}, long_tile),
                         ({"attn_mask": visible}, long_tile)]:
        assert prepare_attention(q, k, v, preset="fp8", **kwargs).cfg == want, kwargs


def test_register_capped_tiles_only_where_the_launch_takes_the_cap(monkeypatch):
    """The H100 table's capped tiles (D=128: two stages, ``maxnreg=168``; D=64: ``maxnreg=128``,
    int_flash's 168) go to eager launches of long calls (from 4096 keys, before the short
    tiles) without a tensor mask, per preset and mask kind; a traced launch (no cap), a short call, a tensor mask, or a constraint that
    changes the tile (fp8 ``q_token``'s 64-token V) gets the uncapped entry; the autotuner's
    first candidate is the same entry, and an explicit cap where the launch cannot pass it is
    refused."""
    monkeypatch.setattr(heuristics, "arch_of", lambda device: "sm90")
    capped = AttentionConfig(64, 128, 4, 2, tma=True, maxnreg=168)
    long_tile = AttentionConfig(64, 128, 4, 3, tma=True)
    cases = [  # preset, keys, mask kind, register_cap, v_block, want
        ("sage2_8b", 16384, "none", True, 0, capped),
        ("sage2_8b", 16384, "none", False, 0, long_tile),
        ("sage2_8b", 16384, "causal", True, 0, capped),
        ("sage2_8b", 16384, "causal", False, 0, long_tile),
        # 4096 keys: sage2_8b's short square tile reaches them, but an eager launch is capped
        ("sage2_8b", 4096, "none", True, 0, capped),
        ("sage2_8b", 4096, "causal", False, 0, AttentionConfig(64, 64, 4, 3, tma=True)),
        ("sage2_8b", 4095, "causal", True, 0, AttentionConfig(64, 64, 4, 3, tma=True)),
        ("fmha_int8", 16384, "causal", True, 0, capped),
        ("fmha_int8", 16384, "tensor", True, 0, long_tile),
        ("fmha_int8", 2048, "none", True, 0, long_tile),
        ("fp8", 16384, "causal", True, 128, capped),
        ("fp8", 16384, "causal", True, 64, AttentionConfig(64, 64, 4, 3, tma=True)),
        ("fp8", 16384, "none", True, 128, AttentionConfig(64, 128, 4, 2, tma=True)),
        ("int_flash", 16384, "none", True, 0, capped),
        ("int_flash", 16384, "causal", True, 0, capped),
        ("int_flash", 16384, "causal", False, 0, long_tile),
        ("turbo", 16384, "none", True, 64, AttentionConfig(64, 64, 4, 3, tma=True)),
    ]
    four_per_sm = AttentionConfig(64, 128, 4, 3, tma=True, maxnreg=128)
    cases += [(preset, 16384, kind, True, v_block, want, 64) for preset, kind, v_block, want in [
        ("fp8", "causal", 128, four_per_sm), ("sage2_8b", "none", 0, four_per_sm),
        ("sage2_8b", "causal", 0, four_per_sm), ("fp8", "none", 128, long_tile),
        ("int_flash", "causal", 0, replace(long_tile, maxnreg=168)),
        ("int_flash", "none", 0, long_tile)]]
    for preset, keys, kind, cap, v_block, want, *dim in cases:
        dim = dim[0] if dim else 128
        table_args = dict(smooth_q=preset == "sage2_8b", keys=keys, unmasked=kind == "none",
                          causal_only=kind == "causal", register_cap=cap, v_block=v_block)
        got = heuristics.attention_config(preset, dim, CPU, torch.bfloat16, **table_args)
        first = heuristics.attention_candidates(preset, dim, CPU, torch.bfloat16, **table_args)
        assert got == first[0] == want, (preset, keys, kind, cap, v_block)
        assert cap or all(c.maxnreg is None for c in first), first
    with pytest.raises(ValueError, match=r"maxnreg=168 needs an eager launch on CUDA tensors"):
        heuristics.attention_config("fp8", 128, CPU, override=capped)
    q, k, v = (torch.randn(1, 2, 40, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=r"maxnreg=168 needs an eager launch"):
        prepare_attention(q, k, v, preset="fp8", config=replace(capped, block_m=32, tma=False))


def test_register_cap_reaches_the_kernel_launch(monkeypatch):
    """Where the launch takes a cap, the config's ``maxnreg`` is passed to the kernel launch
    (the interpreter accepts and ignores it) and the result is unchanged."""
    from qattn_compile.kernels import launch

    launched = []

    def recording(kernel, like):
        def at(grid):
            def run(*args, **kwargs):
                launched.append(kwargs.get("maxnreg"))
                return kernel[grid](*args, **kwargs)
            return run
        return type("Launch", (), {"__getitem__": lambda self, grid: at(grid)})()

    monkeypatch.setattr(launch, "launcher", recording)
    monkeypatch.setattr(launch, "launch_takes_register_cap", lambda like: True)
    q, k, v = (torch.randn(1, 2, 40, 64, dtype=torch.float16) for _ in range(3))
    plain = prepare_attention(q, k, v, preset="fp8", config=AttentionConfig(32, 32, 4, 1)).run()
    capped = prepare_attention(q, k, v, preset="fp8",
                               config=AttentionConfig(32, 32, 4, 1, maxnreg=64)).run()
    assert launched == [None, 64]
    assert torch.equal(plain, capped)


def test_tile_overrides_that_break_a_launch_contract_are_refused():
    """attention_config checks an explicit config against the launchers' contracts: ΔS
    (sage2's Q smoothing) allows key tiles of at most 2·SMOOTH_Q_BLOCK keys, per-block V
    scales need key tiles inside one V block."""
    q, k, v = (torch.randn(1, 2, 40, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=r"block_n=512 must be at most 2·SMOOTH_Q_BLOCK=256"):
        prepare_attention(q, k, v, preset="sage2_8b", config=AttentionConfig(32, 512, 4, 1))
    prepare_attention(q, k, v, preset="sage2_8b", options={"smooth_q": False},
                      config=AttentionConfig(32, 512, 4, 1))  # no ΔS: no such limit
    q, k, v = (torch.randn(1, 2, 130, 64, dtype=torch.float16) for _ in range(3))  # 3 V blocks
    with pytest.raises(ValueError, match=r"block_n=128 must divide V's 64 tokens per scale"):
        prepare_attention(q, k, v, preset="turbo", config=AttentionConfig(32, 128, 4, 1))
    q, k, v = (torch.randn(1, 2, 300, 64, dtype=torch.float16) for _ in range(3))  # 2 V blocks
    fp8_block = {"granularity": "block"}  # V per FP8_KV_BLOCK = 256 tokens: 256-key tiles fit
    prepare_attention(q, k, v, preset="fp8", options=fp8_block, config=AttentionConfig(32, 256, 4, 1))
    with pytest.raises(ValueError, match=r"block_n=512 must divide V's 256 tokens per scale"):
        prepare_attention(q, k, v, preset="fp8", options=fp8_block,
                          config=AttentionConfig(32, 512, 4, 1))
