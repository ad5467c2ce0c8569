"""Train one bundled demo model on CPU with plain PyTorch.

    python tools/prepare_corpus.py --out out/corpus
    python tools/train_tokenizer.py --corpus out/corpus --out out/tokenizer
    python tools/train_demo.py --model demo-base --seed 0
    python tools/train_demo.py --model demo-draft --seed 0    # after demo-base
    python tools/train_demo.py --model demo-sparse --seed 0

Runs on one CPU thread, so a run is reproducible from its seed on a given
machine. Writes a Hugging Face checkpoint directory (config, safetensors,
tokenizer, generation config, README model card) to
``minivllm/demo_models/<model>/``. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from demo_eval import (
    SAMPLE_PROMPTS,
    greedy_agreement,
    greedy_samples,
    heldout_loss,
    heldout_windows,
)
from demo_presets import EOS_TOKEN_ID, IM_END_TOKEN_ID, PRESETS, DemoPreset
from indexer_distill import IndexerDistiller
from model_card import CardInfo, write_card
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO_ROOT / "minivllm" / "demo_models"
DOC_SEPARATOR = "\n<|endoftext|>\n"
PERIODIC_EVAL_WINDOWS = 48
SPARSE_PROMPT = (
    "The os module provides a portable way of using operating system dependent "
    "functionality. If you just want to read or write a file see open, if you want "
    "to manipulate paths, see the os.path module, and if you want to read all the "
    "lines in all the files on the command line see the fileinput module. The"
)


@dataclass(slots=True)
class TrainResult:
    seconds: float
    eval_curve: list[tuple[int, float]]


def load_stream(path: Path, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """All documents of a split as one token stream, each followed by <|endoftext|>."""
    docs = path.read_text(encoding="utf-8").split(DOC_SEPARATOR)
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False, verbose=False).input_ids)
        ids.append(EOS_TOKEN_ID)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(
    stream: torch.Tensor, preset: DemoPreset, generator: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(
        0, len(stream) - preset.seq_len, (preset.batch_size,), generator=generator
    )
    return torch.stack([stream[start : start + preset.seq_len] for start in starts.tolist()])


def learning_rate(step: int, preset: DemoPreset) -> float:
    """Linear warm-up to ``peak_lr``, then cosine decay to ``peak_lr / 10``."""
    if step < preset.warmup_steps:
        return preset.peak_lr * (step + 1) / preset.warmup_steps
    progress = (step - preset.warmup_steps) / max(1, preset.num_steps - preset.warmup_steps)
    floor = preset.peak_lr / 10
    return floor + 0.5 * (preset.peak_lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, preset: DemoPreset) -> torch.optim.AdamW:
    """Weight decay on matrices only; norms and biases are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": preset.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=preset.peak_lr, betas=(0.9, 0.95))


def train_step(
    model: nn.Module, batch: torch.Tensor, distiller: IndexerDistiller | None
) -> tuple[float, float]:
    """Forward + backward; returns (language-model loss, indexer KL loss)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lm_loss = model(input_ids=batch, labels=batch).loss
    index_loss = distiller.loss() if distiller is not None else torch.zeros(())
    (lm_loss + index_loss).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return lm_loss.item(), index_loss.item()


def train(
    model: PreTrainedModel,
    preset: DemoPreset,
    train_stream: torch.Tensor,
    eval_windows: torch.Tensor,
    seed: int,
) -> TrainResult:
    generator = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model, preset)
    distiller = IndexerDistiller(model) if preset.dense_warmup_fraction > 0 else None
    dense_steps = int(preset.num_steps * preset.dense_warmup_fraction)
    curve: list[tuple[int, float]] = []
    start = time.perf_counter()
    model.train()
    for step in range(preset.num_steps):
        if distiller is not None:
            distiller.set_topk(preset.seq_len if step < dense_steps else model.config.index_topk)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, preset)
        lm_loss, index_loss = train_step(
            model, sample_batch(train_stream, preset, generator), distiller
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % preset.eval_every == 0 or step + 1 == preset.num_steps:
            curve.append((step + 1, heldout_loss(model, eval_windows)))
        if step % 10 == 0 or step + 1 == preset.num_steps:
            print_progress(step, preset, lm_loss, index_loss, time.perf_counter() - start, curve)
    return TrainResult(time.perf_counter() - start, curve)


def print_progress(
    step: int,
    preset: DemoPreset,
    lm_loss: float,
    index_loss: float,
    elapsed: float,
    curve: list[tuple[int, float]],
) -> None:
    done = (step + 1) / preset.num_steps
    bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
    eta = elapsed / done - elapsed
    extra = f" index_kl {index_loss:.3f}" if index_loss else ""
    heldout = f" heldout {curve[-1][1]:.3f}" if curve else ""
    print(
        f"[{bar}] {step + 1}/{preset.num_steps} loss {lm_loss:.3f}{extra}{heldout} "
        f"lr {learning_rate(step, preset):.2e} {elapsed / 60:.1f}m eta {eta / 60:.1f}m",
        flush=True,
    )


def save_checkpoint(
    model: PreTrainedModel, preset: DemoPreset, tokenizer_dir: Path, out: Path
) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(preset.save_dtype).save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; ship it world-readable
    GenerationConfig(
        eos_token_id=[EOS_TOKEN_ID, IM_END_TOKEN_ID], pad_token_id=EOS_TOKEN_ID, do_sample=False
    ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)


def load_float32(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def config_line(config: object) -> str:
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "tie_word_embeddings",
        "max_position_embeddings",
    )
    return ", ".join(f"{key}={getattr(config, key)}" for key in keys if hasattr(config, key))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", type=Path, default=Path("out/corpus"))
    parser.add_argument("--tokenizer", type=Path, default=Path("out/tokenizer"))
    parser.add_argument(
        "--out", type=Path, default=None, help="default: minivllm/demo_models/<model>"
    )
    parser.add_argument("--steps", type=int, default=None, help="override the preset (smoke runs)")
    parser.add_argument(
        "--reference", type=Path, default=DEMO_DIR / "demo-base", help="target model for the draft"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    preset = PRESETS[args.model]
    if args.steps is not None:
        preset = replace(
            preset, num_steps=args.steps, warmup_steps=min(preset.warmup_steps, args.steps)
        )
    out = args.out or DEMO_DIR / preset.name
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_stream = load_stream(args.corpus / "train.txt", tokenizer)
    heldout_stream = load_stream(args.corpus / "heldout.txt", tokenizer)
    print(
        f"{preset.name}: {len(train_stream):,} train tokens, {len(heldout_stream):,} held-out tokens"
    )
    model = AutoModelForCausalLM.from_config(
        preset.make_config(), attn_implementation=preset.attn_implementation
    )
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {num_params:,} parameters")
    eval_windows = heldout_windows(heldout_stream, preset.seq_len, PERIODIC_EVAL_WINDOWS)
    result = train(model, preset, train_stream, eval_windows, args.seed)
    save_checkpoint(model, preset, args.tokenizer, out)
    report(out, preset, args, num_params, result, heldout_stream, tokenizer)


def report(
    out: Path,
    preset: DemoPreset,
    args: argparse.Namespace,
    num_params: int,
    result: TrainResult,
    heldout_stream: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Reload the saved weights, measure them, and write the model card."""
    model = load_float32(out)
    windows = heldout_windows(heldout_stream, preset.seq_len)
    loss = heldout_loss(model, windows)
    agreement = (
        greedy_agreement(model, load_float32(args.reference), windows)
        if preset.name == "demo-draft"
        else None
    )
    prompts = SAMPLE_PROMPTS + ([SPARSE_PROMPT] if preset.name == "demo-sparse" else [])
    samples = greedy_samples(model, tokenizer, prompts)
    manifest = json.loads((args.corpus / "manifest.json").read_text())
    info = CardInfo(
        name=preset.name,
        summary=preset.summary,
        architecture=type(model).__name__,
        num_params=num_params,
        dtype=str(preset.save_dtype).removeprefix("torch."),
        file_bytes=(out / "model.safetensors").stat().st_size,
        config_line=config_line(model.config),
        seed=args.seed,
        num_steps=preset.num_steps,
        batch_size=preset.batch_size,
        seq_len=preset.seq_len,
        peak_lr=preset.peak_lr,
        train_seconds=result.seconds,
        heldout_loss=loss,
        corpus_version=manifest["version"],
        train_docs=manifest["train_documents"],
        heldout_docs=manifest["heldout_documents"],
        eval_curve=result.eval_curve,
        agreement=agreement,
        samples=samples,
        notes=sparse_notes(preset) if preset.dense_warmup_fraction > 0 else "",
    )
    write_card(out, info)
    print(
        json.dumps(
            {
                "model": preset.name,
                "heldout_loss": loss,
                "agreement": agreement,
                "train_minutes": result.seconds / 60,
                "params": num_params,
            },
            indent=2,
        )
    )
    for sample in samples:
        print("---\n" + sample)


def sparse_notes(preset: DemoPreset) -> str:
    dense_steps = int(preset.num_steps * preset.dense_warmup_fraction)
    return (
        f"- DSA: the lightning indexer keeps the top `index_topk` keys per query. The first "
        f"{dense_steps} steps were a dense warm-up (indexer selecting every key), the rest sparse; "
        f"the indexer was trained by KL distillation to the main attention (tools/indexer_distill.py), "
        f"as in the DeepSeek-V3.2-Exp report. Training used eager attention; windows of "
        f"{preset.seq_len} tokens, so the top-k selection is active beyond position 64.\n"
    )


if __name__ == "__main__":
    main()
