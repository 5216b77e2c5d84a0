"""Quantized self-attention in a diffusers video transformer, in one command.

A Wan-shaped ``WanTransformer3DModel`` with random weights (nothing is downloaded) is compiled
with ``backend="qattn"`` and the policy next to this file (``diffusers_policy.yaml``: the
self-attention ``blocks.N.attn1`` on ``sage2_8b``, the cross-attention to the text left
alone). It prints the per-site table, the time of a forward pass uncompiled and through
qattn, and the output's error against the uncompiled model::

    python examples/diffusers_transformer.py                  # CPU: tiny sizes, compiler eager
    python examples/diffusers_transformer.py --device cuda    # Triton kernels through Inductor
    python examples/diffusers_transformer.py --regional       # compile_repeated_blocks

On CPU the rewritten sites run qattn's plain-PyTorch reference: it shows what the policy
does and what it costs in accuracy, not speed (it is slower than the original attention).
On CUDA the model runs in bfloat16 with the sizes of Wan 2.1 1.3B's blocks (12 heads of
dim 128) over a 5 × 60 × 104 latent (7,800 video tokens).

In a pipeline, compile the transformer only; the text encoder and the VAE are not compiled,
so they keep their attention::

    pipe.transformer.compile(backend="qattn", options={"policy": "examples/diffusers_policy.yaml"})
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

POLICY = Path(__file__).with_name("diffusers_policy.yaml")

SIZES = {
    "cpu": dict(heads=2, head_dim=16, layers=2, ffn=64, text_dim=32, text_tokens=8, latent=(3, 8, 8)),
    "cuda": dict(heads=12, head_dim=128, layers=4, ffn=8960, text_dim=4096, text_tokens=512,
                 latent=(5, 60, 104)),
}
"""Model and input sizes per device (``--layers`` and ``--latent`` override them)."""
CHANNELS = 16
"""Latent channels (Wan's VAE)."""


def build(sizes: dict, device: torch.device, dtype: torch.dtype):
    """A seeded random-weight Wan transformer and one step's inputs: the latent video
    ``[1, C, F, H, W]``, the text embedding ``[1, T, text_dim]``."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=sizes["heads"], attention_head_dim=sizes["head_dim"],
        in_channels=CHANNELS, out_channels=CHANNELS, text_dim=sizes["text_dim"], freq_dim=256,
        ffn_dim=sizes["ffn"], num_layers=sizes["layers"],
    ).to(device).eval()
    if dtype != torch.float32:  # (diffusers warns that a checkpoint would keep a few in float32)
        model.to(dtype)
    latent = torch.randn(1, CHANNELS, *sizes["latent"], device=device, dtype=dtype)
    text = torch.randn(1, sizes["text_tokens"], sizes["text_dim"], device=device, dtype=dtype)
    return model, latent, text


def run_steps(model, latent, text, steps: int, device: torch.device):
    """The output of every step (timesteps from 999 down) and the median seconds of a step;
    one untimed call first (it compiles a compiled model)."""
    timesteps = torch.linspace(999, 0, steps, device=device).round().long()
    outs, seconds = [], []
    with torch.no_grad():
        model(latent, timesteps[:1], text)
        for t in timesteps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(latent, t.reshape(1), text).sample
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            outs.append(out.float())
    return outs, statistics.median(seconds)


def compile_qattn(model, policy: str, device: torch.device, regional: bool):
    """``model`` through qattn: the whole model, or each block (regional compilation, in place;
    the ``model`` option names the blocks' sites in the whole model). On CPU the rewritten
    graph runs without Inductor (``compiler: eager``)."""
    options = {"policy": policy}
    if device.type != "cuda":
        options["compiler"] = "eager"
    if regional:
        model.compile_repeated_blocks(backend="qattn", options={**options, "model": model})
        return model
    return torch.compile(model, backend="qattn", options=options)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3, help="timed forward passes (denoising steps)")
    p.add_argument("--layers", type=int, help="transformer blocks (default: 2 on CPU, 4 on CUDA)")
    p.add_argument("--latent", metavar="F,H,W", help="latent frames, height, width (even H, W)")
    p.add_argument("--policy", default=str(POLICY), help="policy YAML (default: %(default)s)")
    p.add_argument("--regional", action="store_true",
                   help="compile each block (compile_repeated_blocks) instead of the whole model")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.latent is not None:
        dims = args.latent.split(",")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims) or int(dims[1]) % 2 or int(dims[2]) % 2:
            p.error(f"--latent is F,H,W: three positive integers, H and W even; got {args.latent!r}")
        args.latent = tuple(int(d) for d in dims)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    import qattn_compile
    from qattn_compile.metrics import compare
    from qattn_compile.report import REWRITTEN, format_table

    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = dict(SIZES[device.type])
    if args.layers:
        sizes["layers"] = args.layers
    if args.latent:
        sizes["latent"] = args.latent
    model, latent, text = build(sizes, device, dtype)
    f, h, w = sizes["latent"]
    print(f"WanTransformer3DModel (random weights): {sizes['layers']} blocks, {sizes['heads']} heads "
          f"of dim {sizes['head_dim']}, {f * (h // 2) * (w // 2)} video tokens, {sizes['text_tokens']} "
          f"text tokens; {device.type}, {str(dtype).replace('torch.', '')}")

    reference, eager_s = run_steps(model, latent, text, args.steps, device)
    compiled = compile_qattn(model, args.policy, device, args.regional)
    outs, qattn_s = run_steps(compiled, latent, text, args.steps, device)

    backend = qattn_compile.last_backend()
    print(f"\npolicy: {args.policy}{' (regional compilation)' if args.regional else ''}\n")
    print(format_table(backend.site_reports))
    for r in backend.site_reports:
        if r.serves:  # regional compilation: one block's code runs every block of its class
            print(f"{r.fqn}'s compiled code also serves {', '.join(r.serves)}")
    rewritten = sum(r.status == REWRITTEN for r in backend.site_reports)
    print(f"\n{rewritten} of {len(backend.site_reports)} attention sites rewritten")
    for line in backend.unmatched_rules():
        print(f"warning: {line}")
    path = "Triton kernels, Inductor" if device.type == "cuda" else "CPU reference path, compiler eager"
    print(f"time per step: eager {eager_s * 1e3:.1f} ms, qattn {qattn_s * 1e3:.1f} ms ({path})")
    errors = [compare(o, r) for o, r in zip(outs, reference)]
    worst = min(errors, key=lambda m: m["cos"])
    print(f"sample vs uncompiled model, worst of {args.steps} step(s): cos {worst['cos']:.6f}  "
          f"rel-L1 {worst['rel_l1']:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
