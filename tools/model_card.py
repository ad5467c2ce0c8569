"""README.md model cards for the demo models."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

CORPUS_NOTE = """\
Trained from scratch on the Python 3.11 documentation (the reStructuredText
sources in Debian's `python3.11-doc` {version}, converted to plain text by
`tools/prepare_corpus.py`; {train_docs} documents for training, {heldout_docs}
whole documents held out). The Python documentation is © 2001-2023 Python
Software Foundation and licensed under the PSF License Agreement (Python
Software Foundation License Version 2); code examples in it are also under the
Zero-Clause BSD licence. These weights are a derivative of that text and are
distributed under the same PSF licence terms."""


@dataclass(slots=True)
class CardInfo:
    """Everything a demo model card reports."""

    name: str
    summary: str
    architecture: str
    num_params: int
    dtype: str
    file_bytes: int
    config_line: str
    seed: int
    num_steps: int
    batch_size: int
    seq_len: int
    peak_lr: float
    train_seconds: float
    heldout_loss: float
    corpus_version: str
    train_docs: int
    heldout_docs: int
    eval_curve: list[tuple[int, float]] = field(default_factory=list)
    agreement: float | None = None
    samples: list[str] = field(default_factory=list)
    notes: str = ""


def _front_matter() -> str:
    return "---\nlicense: other\nlicense_name: psf-2.0\nlanguage: en\nlibrary_name: transformers\n---\n"


def _training_section(info: CardInfo) -> str:
    num_tokens = info.num_steps * info.batch_size * info.seq_len
    curve = " | ".join(f"{step}: {loss:.3f}" for step, loss in info.eval_curve)
    return f"""## Training

- Recipe: AdamW (betas 0.9/0.95, weight decay 0.1), {info.num_steps} steps of
  {info.batch_size} x {info.seq_len} tokens ({num_tokens / 1e6:.2f}M tokens), linear warm-up then
  cosine decay from peak LR {info.peak_lr:g} to a tenth of it, bf16 autocast on CPU, seed {info.seed}.
- Wall time: {info.train_seconds / 60:.1f} min on one CPU thread.
- Held-out loss during training (step: nats/token, subset of windows): {curve}
- Reproduce: `python tools/train_demo.py --model {info.name} --seed {info.seed}`
  (see docs/demo-models.md for the corpus and tokenizer steps).
"""


def _results_section(info: CardInfo) -> str:
    lines = [
        "## Evaluation",
        "",
        f"- Held-out loss: **{info.heldout_loss:.3f}** nats/token "
        f"(perplexity {math.exp(info.heldout_loss):.1f}), float32, all non-overlapping "
        f"{info.seq_len}-token windows of the held-out documents, weights as saved.",
    ]
    if info.agreement is not None:
        lines.append(
            f"- Greedy next-token agreement with demo-base on the same windows: "
            f"**{info.agreement:.1%}** (share of positions where both argmax tokens match)."
        )
    lines += ["", "## Greedy samples", ""]
    lines += [f"```text\n{sample}\n```\n" for sample in info.samples]
    return "\n".join(lines)


def render_card(info: CardInfo) -> str:
    header = f"""# {info.name}

A tiny {info.architecture} language model, the {info.summary} of minivllm.
It writes English in the style of the Python documentation; it knows no facts
worth trusting and exists to exercise an inference engine with real weights.

- Architecture: `{info.architecture}`; {info.config_line}
- Parameters: {info.num_params:,} ({info.num_params / 1e6:.2f}M)
- Weights: `model.safetensors`, {info.dtype}, {info.file_bytes / 1e6:.1f} MB
- Tokenizer: byte-level BPE, 4096 tokens, trained on the same corpus; special
  tokens `<|endoftext|>` (eos, pad), `<|im_start|>`, `<|im_end|>` (ChatML template;
  generation stops at either eos id). The model saw no chat data.
{info.notes}
## Data and licence

{CORPUS_NOTE.format(version=info.corpus_version, train_docs=info.train_docs, heldout_docs=info.heldout_docs)}

"""
    return _front_matter() + header + _training_section(info) + "\n" + _results_section(info)


def write_card(out_dir: Path, info: CardInfo) -> None:
    (out_dir / "README.md").write_text(render_card(info), encoding="utf-8")
