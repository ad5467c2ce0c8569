"""fp8 KV-cache scales from compressed-tensors checkpoints (`kv_cache_scheme`).

llm-compressor calibrates, per attention layer, the largest key and value it sees (after
the rotary embedding) and stores `k_scale` = amax|k| / 448 and `v_scale` likewise (e4m3's
largest finite value), one per layer (strategy "tensor") or one per KV head ("attn_head"),
under `model.layers.N.self_attn.{k,v}_scale` (older files: `self_attn.{k,v}_proj.output_scale`).
An engine with an fp8 KV cache stores fp8(k / k_scale) and reads it back times k_scale, so
keys of any magnitude use e4m3's whole range: without scales a layer whose keys are small
lands them among e4m3's few subnormals (below 2^-6), or one whose keys are large saturates.

How the scales are applied (`Attention.forward` and the AVX2 fused decode step): the cache
stores k * (1 / k_scale) and v * (1 / v_scale); scores are q . (k_scale k_stored), computed
as (k_scale q) . k_stored; the output sum_t p_t v_scale v_stored as v_scale sum_t p_t
v_stored. So every attention kernel reads scaled caches unchanged, per tensor or per head.
Scales apply only to an fp8 cache (as vLLM: a bf16 cache keeps the keys as they are), and
with `kv_cache_dtype="auto"` a checkpoint that declares fp8 KV gets an fp8 cache
(vLLM's resolution since its issue #34752). `q_scale` and `prob_scale`, which only an
fp8 attention computation would use, are read and left unused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from minivllm.quantization.kv_cache_scheme import KVCacheScheme

logger = logging.getLogger("minivllm")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_ABSENT = -1.0  # a scale the checkpoint did not hold (replaced by 1.0, with a warning)


def add_kv_scale_parameters(model: nn.Module, scheme: KVCacheScheme, hf_config: Any) -> None:
    """Give each full-attention layer `k_scale` and `v_scale` parameters, fp32, one value per
    local KV head (a per-layer scale repeated), which the checkpoint may fill. Where no layer
    can (a latent MLA cache), the model is marked so that the loader reads the checkpoint's
    scales and leaves them unused."""
    from minivllm.layers.attention.layer import Attention

    total_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    layers = [layer for layer in model.modules() if type(layer) is Attention]
    for layer in layers:
        for which in ("k_scale", "v_scale"):
            param = nn.Parameter(
                torch.full((layer.num_kv_heads,), _ABSENT, dtype=torch.float32),
                requires_grad=False,
            )
            param.weight_loader = _ScaleLoader(layer.num_kv_heads, total_heads, scheme.strategy)
            param.raw_checkpoint_tensor = True
            param.optional_checkpoint_tensor = True  # see use_kv_scales for a missing one
            layer.register_parameter(which, param)
    if not layers:
        model.unused_kv_cache_scales = True


class _ScaleLoader:
    """A checkpoint scale into a layer's [local KV heads] parameter: one value (strategy
    "tensor") or one per KV head of the model ("attn_head", [H, 1, 1] as compressed-tensors
    shapes it), this rank's heads taken as QKVParallelLinear splits them (with fewer KV
    heads than ranks, each head on tp_size / H consecutive ranks)."""

    def __init__(self, local_heads: int, total_heads: int, strategy: str) -> None:
        self.local_heads, self.total_heads, self.strategy = local_heads, total_heads, strategy

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        from minivllm.distributed.parallel_state import get_tp_rank, get_tp_size

        values = loaded.detach().to(torch.float32).reshape(-1)
        if self.strategy == "tensor" and values.numel() != 1:
            raise ValueError(
                f"a per-tensor KV-cache scale holds one value, got shape {tuple(loaded.shape)}"
            )
        if self.strategy == "attn_head":
            if values.numel() != self.total_heads:
                raise ValueError(
                    f"a per-head KV-cache scale holds one value per KV head "
                    f"({self.total_heads}), got shape {tuple(loaded.shape)}"
                )
            replicas = max(1, get_tp_size() // self.total_heads)
            start = get_tp_rank() // replicas * self.local_heads
            values = values[start : start + self.local_heads]
        if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
            raise ValueError(f"KV-cache scales must be finite and positive, got {values.tolist()}")
        param.data.copy_(values.expand(self.local_heads))


def use_kv_scales(layers: list[nn.Module], kv_dtype: torch.dtype, calculate: bool = False) -> None:
    """Once the checkpoint is in and the cache's dtype known, with an fp8 cache each layer
    keeps its `kv_scales` [4, local KV heads] fp32 (k_scale, v_scale, 1 / k_scale,
    1 / v_scale, for the fused step) and `kv_head_scales` [2, local query heads] (k_scale,
    v_scale of each query head's KV head); with another cache none (the scales go unused).
    A layer whose checkpoint holds one of its two scales uses it for both, and one holding
    neither 1.0 (vLLM's rules, logged). The parameters stay as loaded: a weight-cache
    engine maps them read-only. `calculate` (vLLM's calculate_kv_scales, fp8 caches): every
    full-attention layer takes its scales from its first forward instead
    (`calibrate_kv_scales`), the checkpoint's going unused."""
    if calculate and kv_dtype in FP8_DTYPES:
        from minivllm.layers.attention.layer import Attention

        calibrated = [layer for layer in layers if type(layer) is Attention]
        if any(isinstance(getattr(layer, "k_scale", None), nn.Parameter) for layer in calibrated):
            logger.warning(
                "calculate_kv_scales: the checkpoint's own KV-cache scales go unused (as in vLLM)"
            )
        for layer in calibrated:
            layer.kv_scales = layer.kv_head_scales = None
            layer.calibrate_kv_scales = True
        logger.info(
            "calculate_kv_scales: %d layers take their KV-cache scales from their first "
            "forward's keys and values",
            len(calibrated),
        )
        return
    scaled = [
        layer for layer in layers if isinstance(getattr(layer, "k_scale", None), nn.Parameter)
    ]
    absent = shared = 0
    for layer in scaled:
        k, v = layer.k_scale.data, layer.v_scale.data
        k_absent, v_absent = bool((k == _ABSENT).any()), bool((v == _ABSENT).any())
        if k_absent and v_absent:
            k = v = torch.ones_like(k)
            absent += 1
        elif k_absent or v_absent:
            k = v = torch.maximum(k, v)
            shared += 1
        if kv_dtype in FP8_DTYPES:
            _set_scales(layer, k, v)
        else:
            layer.kv_scales = layer.kv_head_scales = None
    if absent or shared:
        logger.warning(
            "the checkpoint declares an fp8 KV cache but of %d attention layers %d hold no "
            "scale (1.0 used) and %d only one of k_scale, v_scale (used for both)",
            len(scaled),
            absent,
            shared,
        )
    if scaled and kv_dtype in FP8_DTYPES:
        heads = {tuple(layer.k_scale.shape) for layer in scaled}
        ks = torch.cat([layer.kv_scales[0] for layer in scaled])
        logger.info(
            "KV cache in %s with the checkpoint's scales (%d layers, %s per layer; k_scale "
            "%.3g..%.3g)",
            str(kv_dtype).removeprefix("torch."),
            len(scaled),
            "x".join(str(n) for n in heads.pop()),
            float(ks.min()),
            float(ks.max()),
        )
    elif scaled:
        logger.info(
            "the checkpoint's fp8 KV-cache scales go unused: the KV cache is %s",
            str(kv_dtype).removeprefix("torch."),
        )


# vLLM's calculate_kv_scales divides the first forward's largest |k| by 200 and |v| by 100
# (its K_SCALE_CONSTANT, V_SCALE_CONSTANT), leaving e4m3 (largest value 448) 2.2x and 4.5x
# headroom for keys and values larger than the first batch's before they saturate.
K_SCALE_DIVISOR, V_SCALE_DIVISOR = 200.0, 100.0


def calibrate_kv_scales(layer: nn.Module, k: torch.Tensor, v: torch.Tensor) -> None:
    """`layer`'s scales from the keys and values [T, Hkv, D] of its first forward with
    any: the largest magnitude of each over K_SCALE_DIVISOR / V_SCALE_DIVISOR (one scale
    per layer and tensor-parallel rank, as vLLM's calculate_kv_scales). A forward without
    tokens, or whose largest key or value is zero or not finite, leaves the layer to
    calibrate on the next one."""
    if k.numel() == 0:
        return
    pair = []
    for x, divisor in ((k, K_SCALE_DIVISOR), (v, V_SCALE_DIVISOR)):
        scale = x.detach().abs().amax().to(torch.float32) / divisor
        if (
            not bool(torch.isfinite(scale))
            or not bool(scale > 0)
            or not bool(1 / scale < float("inf"))
        ):
            return
        pair.append(scale)
    ks, vs = (p.reshape(1).expand(layer.num_kv_heads) for p in pair)
    _set_scales(layer, ks, vs)
    layer.calibrate_kv_scales = False


def _set_scales(layer: nn.Module, ks: torch.Tensor, vs: torch.Tensor) -> None:
    """`layer`'s scales from k_scale and v_scale per local KV head: `kv_scales` [4, Hkv]
    (with the reciprocals, for the fused step) and `kv_head_scales` [2, H] (per query head,
    so that a step multiplies without expanding them)."""
    layer.kv_scales = torch.stack([ks, vs, 1 / ks, 1 / vs]).contiguous()
    group = layer.num_heads // layer.num_kv_heads
    layer.kv_head_scales = torch.stack([ks, vs]).repeat_interleave(group, dim=1)


@contextmanager
def suspended_kv_calibration(layers: list[nn.Module]) -> Iterator[None]:
    """No layer calibrates inside (forwards on dummy tokens, e.g. adaptive verification's
    timing runs); those that were waiting to still are after."""
    waiting = [layer for layer in layers if getattr(layer, "calibrate_kv_scales", False)]
    for layer in waiting:
        layer.calibrate_kv_scales = False
    try:
        yield
    finally:
        for layer in waiting:
            layer.calibrate_kv_scales = True
            layer.kv_scales = layer.kv_head_scales = None


def scale_for_cache(
    layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, Hkv, D] as the attention backends take them with `layer`'s
    scaled cache: k_scale q (each query head by its KV head's scale), k / k_scale, v / v_scale
    (as multiplications by the reciprocals, which the fused step repeats bit for bit), in
    fp32 and rounded once to the engine's dtype (a bf16 scale would be off by up to 2^-9)."""
    scales, per_q_head = layer.kv_scales, layer.kv_head_scales
    return (
        _times(q, per_q_head[0]),
        _times(k, scales[2]),
        _times(v, scales[3]),
    )


def unscale_output(layer: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """The attention output [T, H, D] read from `layer`'s scaled cache, times v_scale."""
    return _times(out, layer.kv_head_scales[1])


def _times(x: torch.Tensor, per_head: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] times per_head [heads] (fp32), computed in fp32."""
    if x.dtype == torch.float32:
        return x * per_head[:, None]
    return (x.float() * per_head[:, None]).to(x.dtype)
