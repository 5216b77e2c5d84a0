"""Ways in without ``torch.compile``, applying the same policy with the same site names as
the compile backend:

- :mod:`.eager`: ``with qattn_compile.policy_scope(model, policy):`` — any model's
  ``F.scaled_dot_product_attention`` calls, decided per module inside the block;
- :mod:`.transformers`: ``apply_policy(model, policy)`` — ``attn_implementation="qattn"``
  for Hugging Face transformers models (``generate`` included);
- :mod:`.sites`: what both share (decisions, fallbacks, reports).

Submodules load on use, so that importing this package does not import transformers.
"""
