"""How the compiled path reaches Inductor.

Compiled CUDA sites call ``torch.ops.qattn.attention_triton`` (:mod:`qattn_compile.ops`), a
``triton_op``: torch traces its body, so Inductor sees every torch op in it and inlines
every Triton launch. :mod:`.quantize` writes the quantizers of Q and K (and the INT8 V, the
smoothing means and SageAttention2's ΔS) as torch ops while torch traces, so that Inductor
fuses them with the ops that produce Q and K (RoPE, the projections' epilogues) instead of
running a separate quantizer kernel over a materialized tensor.
"""
