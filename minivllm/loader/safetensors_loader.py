"""Streaming safetensors reader: one tensor in memory at a time, single file or sharded."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
    else:
        files = sorted(
            os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")
        )
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise ValueError(f"checkpoint shard(s) listed in {INDEX_FILE} are missing: {missing}")
    if not files:
        raise ValueError(
            f"no .safetensors weights in {model_dir} (only safetensors checkpoints load)"
        )
    return files


def iterate_weights(
    model_dir: str, show_progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    files = checkpoint_files(model_dir)
    for path in tqdm(
        files, desc="Loading safetensors shards", disable=not show_progress or len(files) < 2
    ):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
