"""Train the tiny copy-task Llama that tests/test_kvcache.py generates with (run once, CPU).

Random-weight tiny models have near-tied logits, so their greedy tokens flip under any
perturbation and say nothing about a KV cache. This model instead *needs* its cache: it is
trained to continue a periodic sequence (an induction task: find the previous occurrence of
the current token in the cache and copy its successor), and it does so confidently.

    .venv/bin/python tests/data/make_copy_llama.py   # writes tests/data/copy_llama.safetensors

Architecture: :func:`copy_llama_config` (2 layers, hidden 64, 4 query / 2 kv heads, head dim
16, vocab 48); 2000 AdamW steps on 32 sequences of 160 tokens (periods 16-48), about 15
minutes on two CPU cores, final loss ~0.05. Weights are stored in float16 (~160 KB).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

OUT = Path(__file__).with_name("copy_llama.safetensors")
VOCAB = 48


def copy_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation="sdpa",
    )


def periodic_batch(n: int, period: int, length: int) -> torch.Tensor:
    """``n`` sequences of ``length`` tokens repeating a random ``period``-token pattern."""
    seq = torch.randint(0, VOCAB, (n, period))
    return seq.repeat(1, math.ceil(length / period))[:, :length]


def main(steps: int = 2000) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(copy_llama_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        period = int(torch.randint(16, 49, ()))
        ids = periodic_batch(32, period, 160)
        logits = model(ids).logits[:, period:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, period + 1 :].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}", file=sys.stderr, flush=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(OUT))


if __name__ == "__main__":
    main()
