"""Train the bundled EAGLE-1 draft head for demo-base (`demo-eagle`) on CPU.

    python tools/prepare_corpus.py --out out/corpus
    python tools/train_eagle.py --seed 0

The target (demo-base, frozen, float32) runs over random 256-token windows of the
training stream; the head (`tools/eagle_head.py`) learns to predict the target's
next feature from the current feature and the next token, with EAGLE-1's loss
(Li et al., 2024, arXiv:2401.15077 §4): smooth-L1 between the predicted and the
real next feature, plus 0.1 x the cross-entropy of the head's token distribution
against the target's, with U(-0.1, 0.1) noise on the input features so the head
tolerates its own feature errors when it drafts several tokens in a row.

Runs on one CPU thread, so a run is reproducible from its seed on a given
machine. Writes `minivllm/demo_models/demo-eagle/` (config.json, model.safetensors,
README.md). Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_eval import heldout_windows  # noqa: E402
from eagle_head import EagleHead, head_config, save_head  # noqa: E402
from train_demo import DEMO_DIR, load_stream  # noqa: E402

BATCH, SEQ_LEN, WARMUP = 16, 256, 50
REG_WEIGHT, CLS_WEIGHT, FEATURE_NOISE = 1.0, 0.1, 0.1
EVAL_WINDOWS = 48


@torch.no_grad()
def target_features(target: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final (post-norm) hidden states and its logits for every position."""
    features = target.model(input_ids=batch).last_hidden_state.float()
    return features, target.lm_head(features).float()


def losses(
    head: EagleHead, target: nn.Module, batch: torch.Tensor, noise: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(regression loss, classification loss, top-1 agreement) over positions 0..T-2."""
    features, logits = target_features(target, batch)
    inputs = features[:, :-1]
    if noise:
        inputs = inputs + torch.empty_like(inputs).uniform_(-noise, noise)
    embeds = target.model.embed_tokens(batch[:, 1:]).float()
    positions = torch.arange(batch.shape[1] - 1).expand(batch.shape[0], -1)
    predicted = head(embeds, inputs, positions)
    reg = F.smooth_l1_loss(predicted, features[:, 1:])
    head_logits = target.lm_head(predicted)
    want = logits[:, 1:].softmax(-1)
    cls = -(want * head_logits.log_softmax(-1)).sum(-1).mean()
    agree = (head_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return reg, cls, agree


def learning_rate(step: int, steps: int, peak: float) -> float:
    if step < WARMUP:
        return peak * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return peak / 10 + 0.5 * (peak - peak / 10) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(head: EagleHead, target: nn.Module, windows: torch.Tensor) -> tuple[float, float]:
    """Held-out (classification loss, teacher-forced top-1 agreement with the target)."""
    head.eval()
    cls_total, agree_total = 0.0, 0.0
    chunks = windows.split(BATCH)
    for chunk in chunks:
        _, cls, agree = losses(head, target, chunk, noise=0.0)
        cls_total += cls.item()
        agree_total += agree.item()
    head.train()
    return cls_total / len(chunks), agree_total / len(chunks)


def save(head: EagleHead, config, out: Path, card: str) -> None:
    if out.exists():
        shutil.rmtree(out)
    save_head(head, config, out, card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--peak-lr", type=float, default=3e-3)
    parser.add_argument("--corpus", type=Path, default=Path("out/corpus"))
    parser.add_argument("--target", type=Path, default=DEMO_DIR / "demo-base")
    parser.add_argument("--out", type=Path, default=DEMO_DIR / "demo-eagle")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    train_stream = load_stream(args.corpus / "train.txt", tokenizer)
    heldout = heldout_windows(load_stream(args.corpus / "heldout.txt", tokenizer), SEQ_LEN)
    eval_windows = heldout_windows(heldout.flatten(), SEQ_LEN, EVAL_WINDOWS)
    config = head_config(target.config)
    head = EagleHead(config)
    num_params = sum(p.numel() for p in head.parameters())
    print(f"EAGLE head for {args.target.name}: {num_params:,} parameters")
    matrices = [p for p in head.parameters() if p.ndim >= 2]
    vectors = [p for p in head.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=args.peak_lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(args.seed)
    curve, start = [], time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.peak_lr)
        starts = torch.randint(0, len(train_stream) - SEQ_LEN, (BATCH,), generator=generator)
        batch = torch.stack([train_stream[s : s + SEQ_LEN] for s in starts.tolist()])
        reg, cls, agree = losses(head, target, batch, FEATURE_NOISE)
        (REG_WEIGHT * reg + CLS_WEIGHT * cls).backward()
        nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            curve.append((step + 1, *evaluate(head, target, eval_windows)))
        if step % 10 == 0 or step + 1 == args.steps:
            done, elapsed = (step + 1) / args.steps, time.perf_counter() - start
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            last = f" heldout agree {curve[-1][2]:.3f}" if curve else ""
            print(
                f"[{bar}] {step + 1}/{args.steps} reg {reg.item():.4f} cls {cls.item():.3f} "
                f"agree {agree.item():.3f}{last} {elapsed / 60:.1f}m "
                f"eta {(elapsed / done - elapsed) / 60:.1f}m",
                flush=True,
            )
    seconds = time.perf_counter() - start
    cls_loss, agreement = evaluate(head, target, heldout)
    card = model_card(args, num_params, seconds, cls_loss, agreement, curve)
    save(head, config, args.out, card)
    print(
        json.dumps(
            {"heldout_agreement": agreement, "heldout_cls": cls_loss, "minutes": seconds / 60}
        )
    )


def model_card(args, num_params, seconds, cls_loss, agreement, curve) -> str:
    rows = "\n".join(f"| {s} | {c:.3f} | {a:.3f} |" for s, c, a in curve)
    return f"""---
license: other
license_name: psf-2.0
tags: [eagle, speculative-decoding, minivllm-demo]
---

# demo-eagle

An EAGLE-1 draft head (Li et al., 2024, arXiv:2401.15077) for `demo-base`: one
Qwen3 decoder layer (no input norm) after a 512 -> 256 projection of
[token embedding; target feature]. {num_params:,} parameters, float32. It has no
embedding or LM head of its own: it uses demo-base's. Not a standalone model:
load it with minivllm's `speculative_config={{"method": "eagle", "model": "demo-eagle",
"num_speculative_tokens": 3}}`.

Trained by `tools/train_eagle.py --seed {args.seed} --steps {args.steps} --peak-lr {args.peak_lr}`
on the demo corpus (docs/demo-models.md): {args.steps} steps of {BATCH} x {SEQ_LEN}-token
windows, AdamW (0.9/0.95, weight decay 0.1 on matrices), linear warm-up {WARMUP} steps,
cosine to a tenth; loss = smooth-L1(feature) + {CLS_WEIGHT} x CE(tokens), feature noise
U(-{FEATURE_NOISE}, {FEATURE_NOISE}). {seconds / 60:.1f} min on one CPU thread.

Held-out (all {SEQ_LEN}-token windows of the held-out documents, teacher-forced features):
token cross-entropy against demo-base's distribution {cls_loss:.3f} nats, and the head's
argmax equals demo-base's at **{agreement:.1%}** of positions (the per-token acceptance
rate of greedy drafting one token ahead).

| step | held-out CE (48 windows) | agreement |
|---|---|---|
{rows}
"""


if __name__ == "__main__":
    main()
