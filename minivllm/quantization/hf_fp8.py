"""Checkpoints in transformers' (and vLLM's `Fp8Config`) fp8 format: `quant_method: "fp8"`.

What Qwen's and DeepSeek's official FP8 releases ship (DeepSeek's routed experts load
through `checkpoint_moe.CheckpointMoEMethod`). config.json carries
`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic" | "static",
"weight_block_size": [128, 128] | null, "modules_to_not_convert": [...] | null}`; each
quantized linear stores `weight` (float8_e4m3fn [N, K]) and either `weight_scale_inv`
(float32 [ceil(N / 128), ceil(K / 128)]: one multiplier per block, despite the name,
w = q * s) or, without blocks, `weight_scale` (one value per tensor), plus `input_scale`
where activations are static. The LM head and the modules named in
`modules_to_not_convert` (or vLLM's `ignored_layers`; matched as transformers matches
them) stay in full precision.

These run as fp8_w8a16: the weights as stored (block scales held per row and group of
k), the fp8 activation rounding skipped (as vLLM without fp8 hardware; activations keep
the engine's dtype).
"""

from __future__ import annotations

import re
from typing import Any

from minivllm.quantization.compressed_tensors import (
    CheckpointQuantization,
    ConfigGroup,
    StoredScheme,
    block_structure,
)
from minivllm.quantization.config import SchemeSpec


def read_fp8_checkpoint(quant: dict[str, Any]) -> CheckpointQuantization:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoints in {fmt!r} are not supported; minivllm loads e4m3")
    activations = quant.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ValueError(
            f"the fp8 checkpoint's activation_scheme {activations!r} is not 'dynamic' or 'static'"
        )
    block = quant.get("weight_block_size")
    if block is not None:
        block = block_structure("the fp8 checkpoint's weight_block_size", block)
    stored = StoredScheme(
        SchemeSpec("fp8_w8a16"),
        "fp8",
        per_tensor=block is None,
        unused_activations=f"fp8 activations ({activations})",
        block=block,
        scale_name="weight_scale_inv" if block is not None else "weight_scale",
    )
    # vLLM reads `ignored_layers` (AutoFP8 writes it) before `modules_to_not_convert`
    keep = list(quant.get("ignored_layers") or quant.get("modules_to_not_convert") or ())
    ignore = ["lm_head"]
    for key in keep:
        # transformers' matching: the key as a regex from the start of the name, ending at a
        # module boundary ("layers.1" is not "layers.11", "mlp.gate" not "mlp.gate_proj"),
        # or as a suffix of the name
        ignore += [f"re:(?:{key})(?:(?<=\\.)|(?=\\.|$))", f"re:.*{re.escape(key)}$"]
    return CheckpointQuantization((ConfigGroup(("Linear",), stored),), tuple(ignore), "fp8")
