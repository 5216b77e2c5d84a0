"""Plain-PyTorch reference ("oracle") of every attention preset.

- :func:`exact_attention`: independent exact softmax attention (fp64 by default).
- :func:`reference_attention`: simulated quantization of a preset, exactly the math stated in
  :mod:`qattn_compile.presets` (the CPU execution path and the oracle of kernel tests).
- :func:`quantized_scores` / :func:`quantized_probs`: the score and probability stages of a
  preset, for comparing kernels stage by stage.
- :mod:`.quant` (INT/FP8 quantizers, INT4 packing), :mod:`.smooth` (SageAttention2
  smoothing), :mod:`.sas` (TurboAttention's SAS exp and :data:`SAS_POLY`).
"""

from .attention import (
    ProbParts,
    ScoreParts,
    exact_attention,
    mask_bias,
    quantized_probs,
    quantized_scores,
    reference_attention,
)
from .sas import SAS_POLY, sas_exp

__all__ = [
    "ProbParts",
    "SAS_POLY",
    "ScoreParts",
    "exact_attention",
    "mask_bias",
    "quantized_probs",
    "quantized_scores",
    "reference_attention",
    "sas_exp",
]
