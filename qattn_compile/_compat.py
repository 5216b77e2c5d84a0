"""Every private torch import qattn makes, in one place (they move between releases)."""

from __future__ import annotations


def compile_with_inductor(gm, example_inputs, config_patches: dict | None = None,
                          cache_key_tag: str = ""):
    """Hand an FX graph to TorchInductor (``compile_fx``) with per-call config patches.

    ``cache_key_tag`` joins ``torch.compiler.config.cache_key_tag`` (the user's own tag, if
    any, is kept) while this graph compiles, so it enters the keys under which torch's
    AOTAutograd and FX graph caches store the compiled graph.
    """
    from torch._inductor.compile_fx import compile_fx
    from torch.compiler import config as compiler_config

    tag = "+".join(t for t in (compiler_config.cache_key_tag, cache_key_tag) if t)
    with compiler_config.patch(cache_key_tag=tag):
        return compile_fx(gm, example_inputs, config_patches=config_patches or {})


def inductor_modes() -> list[str]:
    """The ``torch.compile`` mode names Inductor knows (``default``, ``reduce-overhead``, …)."""
    from torch._inductor import list_mode_options

    return list(list_mode_options())


def inductor_mode_options(mode: str | None) -> dict:
    """Inductor config patches of a ``torch.compile`` mode name (e.g. ``reduce-overhead``)."""
    if not mode or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def list_backends() -> list[str]:
    """Names of the registered dynamo backends (entry points included)."""
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


def reset_dynamo() -> None:
    """Forget every compiled frame (so a model can be compiled again with another backend)."""
    import torch._dynamo

    torch._dynamo.reset()


def trace_structured(name: str, metadata_fn, payload_fn) -> None:
    """Emit one structured-trace event (``TORCH_TRACE`` / ``tlparse``); a no-op when tracing is off."""
    from torch._logging import trace_structured as _trace_structured

    _trace_structured(name, metadata_fn=metadata_fn, payload_fn=payload_fn)


def structured_trace_logger():
    """The logger ``trace_structured`` writes to; a handler added to it receives every event."""
    from torch._logging._internal import trace_log

    return trace_log


def register_log(setting_name: str, logger_name: str) -> None:
    """Let ``TORCH_LOGS`` / ``torch._logging.set_logs`` control logger ``logger_name``."""
    from torch._logging._internal import register_log as _register_log

    _register_log(setting_name, logger_name)


def statically_known_true(expr) -> bool:
    """True when a (possibly symbolic) boolean is known true without adding a shape guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as _known_true

    return _known_true(expr)


def mark_static_address(tensor) -> None:
    """Tell dynamo a buffer's address never changes (CUDA-graph-friendly caches)."""
    import torch._dynamo

    torch._dynamo.mark_static_address(tensor)


def sdpa_graph_targets() -> tuple:
    """The callables an SDPA call appears as in a dynamo graph (public and ``torch._C`` ones)."""
    import torch
    import torch.nn.functional as F

    return (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def run_and_get_code(fn, *args, **kwargs):
    """Run ``fn`` and return ``(result, [Inductor's generated source, ...])``."""
    from torch._inductor.utils import run_and_get_code as _run_and_get_code

    return _run_and_get_code(fn, *args, **kwargs)


def outside_tracing():
    """A context in which torch ops run on real tensors even while torch traces (fake,
    functional and proxy modes suspended): the autotuner times kernels there."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def size_hint(size) -> int | None:
    """An int for a (possibly symbolic) size: the value a dynamic size was traced with, or
    None for a size without one (data-dependent)."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return None if hint is None else int(hint)


def traced_frame_scope() -> tuple[dict, dict] | None:
    """``(f_locals, f_globals)`` of the Python frame dynamo is turning into the graph the
    backend is compiling now, or None when that is not known (called outside a dynamo
    compile, or a torch whose tracer keeps them elsewhere). The roots of the module paths
    in ``nn_module_stack`` (``L['self']``, ``G['model']``) are names in these scopes."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return tx.f_locals, tx.f_globals
    except Exception:  # noqa: BLE001 - any failure means: not reachable in this torch
        return None


def compiled_module():
    """The module whose ``torch.compile`` is running the frame dynamo traces now: the
    innermost caller on the Python stack that is a compiled module's call, i.e. the
    ``_orig_mod`` of an ``OptimizedModule`` (``torch.compile(model)``) or a module compiled in
    place (``model.compile()``, whose ``_compiled_call_impl`` is set). None when no module
    was compiled (``torch.compile(function)``) or none is found."""
    import sys

    import torch

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch._dynamo.OptimizedModule):
                return owner._orig_mod
            if (code.co_name == "_wrapped_call_impl" and isinstance(owner, torch.nn.Module)
                    and getattr(owner, "_compiled_call_impl", None) is not None):
                return owner
        frame = frame.f_back
    return None


def invoke_subgraph_target():
    """The higher-order op a ``torch.compiler.nested_compile_region`` call appears as in a
    dynamo graph (``invoke_subgraph(subgraph, identifier, *operands)``), or None."""
    import torch

    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def while_tracing(fn) -> None:
    """Call ``fn(context)`` when dynamo traces this call (at compile time: not in the graph,
    no graph break); a no-op when not tracing. ``fn``: a function without free variables."""
    from torch._dynamo.comptime import comptime

    comptime(fn)
