"""Autotuning of the attention kernel's tile sizes, with an on-disk cache.

A call whose preset options say ``autotune: true`` (a policy rule's options, or every site
with the backend option ``autotune: true`` or ``mode="max-autotune"``) gets its
:class:`~.heuristics.AttentionConfig` by timing the candidates of
:func:`.heuristics.attention_candidates` instead of taking the table entry. Without it the
table of :mod:`.heuristics` decides, as before.

When it times. Under ``torch.compile`` the op body is traced while Inductor compiles the
graph, on fake tensors: the tuner then steps outside tracing
(:func:`qattn_compile._compat.outside_tracing`), makes real random inputs of the traced
shapes (a dynamic size is tuned at the size it was traced with), times every candidate and
returns the fastest, which the compiled code then carries as constants. Eagerly it times at
the first call of a new :class:`TuneKey`. What is timed is the attention kernel alone (the
quantizers do not depend on the tiles), on inputs laid out as the call's are, as CUDA-graph
replays with a cold L2 (:func:`time_call`: a plain timing of a short kernel measures
Python's launch cost, which favoured pointer loads over TMA at short lengths).
A candidate that does not fit the
GPU (Triton's ``OutOfResources``) is skipped.

Where results live. In memory, and in ``<cache dir>/autotune.json`` (``$QATTN_CACHE_DIR``,
default ``~/.cache/qattn``) under the key's text plus the environment (GPU name, torch and
Triton versions, a hash of the sources of ``kernels/`` and ``blocks.py``): a second compile,
in this process or a new one, does not time again, and a different GPU, Triton or kernel
does. Batch and lengths are keyed by their power-of-two bucket. A cached tile that is not
among the call's candidates (a hand-edited file, changed constraints) is tuned again.
Writers lock ``autotune.json.lock`` around their read-merge-replace. :data:`stats` counts
tunings and cache hits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from torch import Tensor
from triton.runtime.errors import OutOfResources

try:
    import fcntl
except ImportError:  # not on Windows: cache writes are then not locked
    fcntl = None

from .. import _compat
from .heuristics import AttentionConfig

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "QATTN_CACHE_DIR"
"""Environment variable naming the cache directory (default ``~/.cache/qattn``)."""
CACHE_FILE = "autotune.json"
CACHE_VERSION = 1
"""Bumped when the file's layout changes (older files are then ignored)."""
_KERNEL_SOURCES = ("kernels/*.py", "blocks.py")
"""Files (globs under the package) whose text is the kernel, its launch and the tile
constraints (the grid order of :func:`.heuristics.grid_head_group`, the scale groups of
:mod:`qattn_compile.blocks`): a change re-tunes."""

stats: Counter = Counter()
"""``tuned``: keys timed in this process; ``hits``: keys served from memory or disk."""
_memory: dict[str, AttentionConfig] = {}


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two (keys share a tuning across nearby sizes)."""
    return 1 << max(int(n) - 1, 0).bit_length()


_NOT_KEYED = ("autotune", "calibration", "static_scales")
"""Preset options left out of :attr:`TuneKey.options`."""


def _memory_order(shape: Sequence[int], stride: Sequence[int]) -> str:
    """The dims of a ``[B, H, L, D]`` tensor from the outermost in memory to the innermost,
    size-1 dims left out (their stride says nothing): ``"0123"`` contiguous, ``"0213"`` a
    ``[B, L, H, D]`` buffer viewed with heads first."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    return "".join(str(d) for d in sorted(dims, key=lambda d: (-stride[d], d)))


@dataclass(frozen=True)
class TuneKey:
    """What the fastest tile depends on: one tuning per distinct key."""

    preset: str
    options: str
    """The preset's options as JSON, without those that cannot change the fastest tile:
    ``autotune`` itself and fmha_int8's per-site calibration (``calibration``,
    ``static_scales``)."""
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    head_dim: int
    head_dim_v: int
    causal: bool
    mask: str
    """``none``, ``bool`` or ``additive``."""
    layout: str
    """q, k, v's memory orders (:func:`_memory_order`): the candidates are timed on it and
    TMA depends on it."""
    positive_scale: bool
    """The softmax scale is positive (a kernel specialisation)."""
    register_cap: bool
    """The launch can pass a register cap (an eager call; a traced one cannot), so the
    candidates may hold capped tiles (:attr:`~.heuristics.AttentionConfig.maxnreg`)."""

    @classmethod
    def of(cls, preset: str, options, shapes, strides, dtype: torch.dtype,
           attn_mask: Tensor | None, is_causal: bool, scale: float | None, *,
           register_cap: bool) -> "TuneKey":
        """The key of a call: ``shapes`` and ``strides`` of q, k, v (``[B, H, L, D]``, size
        hints as ints; lengths and batch bucketed), ``scale`` the softmax scale (None:
        ``1/sqrt(D)``), ``register_cap`` as the field."""
        mask = "none" if attn_mask is None else "bool" if attn_mask.dtype == torch.bool else "additive"
        (b, hq, lq, d), (_, hkv, lkv, _), (*_, dv) = shapes
        layout = "/".join(_memory_order(shape, stride) for shape, stride in zip(shapes, strides))
        return cls(preset, _keyed_options(options), str(dtype).removeprefix("torch."),
                   _bucket(b), hq, hkv, _bucket(lq), _bucket(lkv), d, dv, bool(is_causal), mask,
                   layout, scale is None or scale > 0, register_cap)

    def text(self, device: torch.device) -> str:
        """The cache entry's name: this key plus the environment of ``device``."""
        return _entry_name(self, torch.device(device))


# Cached, as _environment: every eager call with ``autotune`` builds its key and looks it up
# (the JSON costs an eager call measurable time uncached). Options and keys are frozen, hence hashable.
@functools.lru_cache(maxsize=256)
def _keyed_options(options) -> str:
    """``options`` as sorted JSON without :data:`_NOT_KEYED`."""
    settings = json.loads(options.to_json())
    for name in _NOT_KEYED:
        settings.pop(name, None)
    return json.dumps(settings, sort_keys=True)


@functools.lru_cache(maxsize=256)
def _entry_name(key: TuneKey, device: torch.device) -> str:
    """:meth:`TuneKey.text`."""
    return json.dumps({**dataclasses.asdict(key), **_environment(device)}, sort_keys=True)


@functools.lru_cache(maxsize=16)
def _environment(device: torch.device) -> dict:
    """What else a timing depends on: the GPU, the library versions, the kernel source
    (computed once per device: every eager call with ``autotune`` looks its key up)."""
    source = hashlib.sha256()
    package = Path(__file__).parent.parent
    for pattern in _KERNEL_SOURCES:
        for path in sorted(package.glob(pattern)):
            source.update(path.relative_to(package).as_posix().encode())
            source.update(path.read_bytes())
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"interpreter on {platform.machine()}"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "kernel": source.hexdigest()[:16]}


def cache_path() -> Path:
    """``$QATTN_CACHE_DIR/autotune.json`` (``~`` expanded; default directory
    ``~/.cache/qattn``, or ``<temp dir>/qattn`` where no home directory is known)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root).expanduser() / CACHE_FILE
    try:
        home = Path.home()
    except RuntimeError:  # no HOME and no passwd entry
        return Path(tempfile.gettempdir()) / "qattn" / CACHE_FILE
    return home / ".cache" / "qattn" / CACHE_FILE


def _read(path: Path, for_write: bool = False) -> dict[str, dict]:
    """The entries of the cache file: empty when it is missing; a file that is not a cache of
    this version is reported (and replaced on the next write). A file the OS does not let
    this process read (permissions, I/O) is reported too; ``for_write`` raises the
    ``OSError`` instead, so that a write never replaces entries it could not read."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        if for_write and isinstance(exc, OSError):
            raise
        logger.warning("qattn autotune: ignoring unreadable cache %s (%s)", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        logger.warning("qattn autotune: ignoring cache %s (not version %d)", path, CACHE_VERSION)
        return {}
    entries = data.get("entries", {})
    if not isinstance(entries, dict):
        logger.warning("qattn autotune: ignoring cache %s (its entries are not a mapping)", path)
        return {}
    return entries


def _write(path: Path, name: str, entry: dict) -> None:
    """Add one entry to the cache file (read, merge, replace atomically), holding an exclusive
    lock on ``<file>.lock`` where the platform has ``fcntl``, so that two processes tuning at
    once keep both their entries."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(path, for_write=True)
        entries[name] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1,
                          sort_keys=True)
            os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it, not mkstemp's 0600
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _umask() -> int:
    """The process's file-mode creation mask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _cached(name: str, path: Path) -> AttentionConfig | None:
    """The config stored under ``name`` in memory or in ``path``, or None."""
    if name in _memory:
        return _memory[name]
    entry = _read(path).get(name)
    if entry is None:
        return None
    try:
        cfg = AttentionConfig(**entry["config"])
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("qattn autotune: ignoring malformed cache entry in %s (%s)", path, exc)
        return None
    _memory[name] = cfg
    return cfg


def capture(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """One call of ``fn`` as a zero-argument callable to time: on CUDA the replay of a CUDA
    graph of the call, captured after a first call (which compiles and warms up), so that the
    host's launch cost, which Inductor's compiled code does not pay per call, stays out of
    the timing; under the interpreter ``fn`` itself, after a first call."""
    fn()
    if device.type != "cuda":
        return fn
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_captured(replay: Callable[[], object], device: torch.device) -> float:
    """Milliseconds one ``replay`` (from :func:`capture`) takes: on CUDA the median of
    ``triton.testing.do_bench``, which clears the L2 cache before each replay so that a short
    kernel is not timed on inputs a model would not have cached; under the interpreter one
    call's wall time."""
    if device.type != "cuda":
        start = time.perf_counter()
        replay()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(replay, warmup=5, rep=25, return_mode="median")


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds one call of ``fn`` takes on the GPU: :func:`time_captured` of
    :func:`capture` (CUDA-graph replays, cold L2; under the interpreter one call's wall time
    after a first call)."""
    return time_captured(capture(fn, device), device)


def random_like_layout(shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype,
                       device: torch.device) -> Tensor:
    """N(0, 1) values of ``shape`` whose dims lie in memory in the order of ``strides``
    (e.g. ``[B, H, L, D]`` stored ``[B, L, H, D]``, as a transposed projection output is), so
    that the timed kernel reads the layout the call will read."""
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    base = torch.randn([shape[d] for d in order], dtype=dtype, device=device)
    return base.permute([order.index(d) for d in range(len(shape))])


def tuned_config(
    key: TuneKey,
    device: torch.device,
    candidates: Sequence[AttentionConfig],
    make_inputs: Callable[[], object],
    measure: Callable[[AttentionConfig, object], float],
) -> AttentionConfig:
    """The fastest of ``candidates`` for ``key`` on ``device``, from the cache or timed.

    On a miss: ``inputs = make_inputs()`` then ``measure(cfg, inputs)`` (milliseconds) per
    candidate, all outside tracing; the winner is stored in memory and on disk (a cache file
    that cannot be written, or read before the write, is reported and left as it is, and the
    result still serves this process). Running out of GPU memory while timing gives the
    table's tile (``candidates[0]``), not cached. Raises ``RuntimeError`` when no candidate
    fits the GPU.
    """
    name, path = key.text(device), cache_path()
    cfg = _cached(name, path)
    if cfg is not None and cfg in candidates:
        stats["hits"] += 1
        return candidates[candidates.index(cfg)]  # a hand-edited 64.0 equals 64: launch an int
    if cfg is not None:  # e.g. a hand-edited file, or tile constraints that changed
        logger.warning("qattn autotune: cached tile %s is not a candidate for %s; tuning again",
                       cfg, key)
    timings: dict[AttentionConfig, float] = {}
    try:
        with _compat.outside_tracing():
            inputs = make_inputs()
            for candidate in candidates:
                try:
                    timings[candidate] = measure(candidate, inputs)
                except OutOfResources as exc:
                    logger.info("qattn autotune: %s skipped: %s", candidate, exc)
            del inputs
    except torch.OutOfMemoryError as exc:  # the timed inputs next to the model's own tensors
        logger.warning("qattn autotune: out of GPU memory while timing tiles for %s (%s); "
                       "using the table's tile %s (not cached)", key, exc, candidates[0])
        return candidates[0]
    if not timings:
        raise RuntimeError(f"qattn autotune: no candidate tile fits this GPU for {key}")
    best = min(timings, key=timings.get)
    stats["tuned"] += 1
    logger.info("qattn autotune: %s %s D=%d Lq~%d Lkv~%d causal=%s -> %s (%.3f ms; table %s %.3f ms)",
                key.preset, key.dtype, key.head_dim, key.len_q, key.len_kv, key.causal, best,
                timings[best], candidates[0], timings.get(candidates[0], float("nan")))
    _memory[name] = best
    entry = {
        "config": dataclasses.asdict(best),
        "timings_ms": {json.dumps(dataclasses.asdict(c)): ms for c, ms in timings.items()},
        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        _write(path, name, entry)
    except OSError as exc:  # e.g. a read-only home: the result still serves this process
        logger.warning("qattn autotune: cannot write %s (%s); set %s to a writable directory",
                       path, exc, CACHE_DIR_ENV)
    return best


def clear_memory() -> None:
    """Forget the in-memory results (the disk cache stays): the next lookup reads the file."""
    _memory.clear()
