"""How the compiled path reaches Inductor.

Compiled CUDA sites call ``torch.ops.qattn.attention_triton`` (:mod:`qattn_compile.ops`), a
``triton_op``: torch traces its body, so Inductor sees every torch op in it and inlines
every Triton launch. :mod:`.quantize` writes the INT8 and FP8 quantizers of Q and K and
the smoothing means as torch ops while torch traces, so that Inductor fuses them with
the ops that produce Q and K (RoPE, the projections' epilogues) instead of running a
separate quantizer kernel over a materialized tensor.
"""
