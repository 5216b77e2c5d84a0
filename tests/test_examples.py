"""The examples run as their docstrings say (tiny sizes, CPU, compiler eager)."""

import importlib.util
import re
from pathlib import Path

import pytest

from qattn_compile import _compat

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    _compat.reset_dynamo()
    yield
    _compat.reset_dynamo()


def _row(out: str, fqn: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.startswith(fqn + " ")]
    return line.split()


@pytest.mark.parametrize("regional", [False, True])
def test_diffusers_transformer_example(regional, capsys):
    pytest.importorskip("diffusers")
    example = _load("diffusers_transformer")
    argv = ["--device", "cpu", "--steps", "2", "--layers", "2", "--latent", "1,4,4"]
    assert example.main(argv + ["--regional"] * regional) == 0
    out = capsys.readouterr().out
    # the policy next to the example: self-attention quantized, cross-attention left alone
    assert _row(out, "blocks.0.attn1")[1:4] == ["WanAttention", "sage2_8b", "rewritten"]
    assert _row(out, "blocks.0.attn2")[1:4] == ["WanAttention", "none", "left_alone"]
    if regional:  # one compiled block serves both
        assert "blocks.0.attn1's compiled code also serves blocks.1.attn1" in out
        assert "1 of 2 attention sites rewritten" in out
    else:
        assert _row(out, "blocks.1.attn1")[3] == "rewritten"
        assert "2 of 4 attention sites rewritten" in out
    assert re.search(r"time per step: eager [\d.]+ ms, qattn [\d.]+ ms", out)
    cos, rel_l1 = re.search(r"worst of 2 step\(s\): cos ([\d.]+)  rel-L1 ([\d.]+)", out).groups()
    assert 0.999 < float(cos) < 1.0 and 0 < float(rel_l1) < 0.01  # quantized: close, not exact


def test_diffusers_transformer_example_checks_its_arguments(capsys):
    example = _load("diffusers_transformer")
    with pytest.raises(SystemExit):
        example.main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(["--latent", "1,3,4"])
    assert "--latent is F,H,W" in capsys.readouterr().err
