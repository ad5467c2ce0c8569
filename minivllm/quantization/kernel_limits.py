"""Which kernel a quantized linear's batch goes to: whether this CPU's bf16 kernels take a
scheme and shape, and the rows up to which each form runs (the weight-streaming kernel,
`dequantized_linear`, int8_w8a8's GEMM on its prepacked copy, a MoE layer's one call),
with the measurements that set them. The weights themselves are `formats.QuantWeights`.
"""

from __future__ import annotations

from torch import Tensor

from minivllm.kernels.isa import AVX512_VNNI_FLAGS
from minivllm.quantization.config import INT4_SCHEMES, SCHEMES
from minivllm.quantization.formats import QuantWeights, divides


def kernel_supports(scheme: str) -> bool:
    """Whether this CPU runs `scheme`'s bf16 kernel (quant_linear): AVX512-BF16, and
    AVX512-VNNI for the schemes that multiply int8 activations (int8_w8a8, int4_w4a8;
    where a bf16 engine's CPU lacks VNNI, int4_w4a8 borrows the AVX2 family's fp32 op,
    `QuantizedLinearMethod.choose_backend`)."""
    from minivllm.kernels.isa import cpu_flags, cpu_has_avx512_bf16

    if scheme not in SCHEMES:
        return False
    vnni = scheme not in ("int8_w8a8", "int4_w4a8") or "avx512_vnni" in cpu_flags()
    return cpu_has_avx512_bf16() and vnni


def fp32_vnni_takes(qw: QuantWeights) -> bool:
    """Whether an fp32 engine runs int8_w8a8 layer `qw` on the AVX2 family's VNNI GEMM
    (`vnni_w8a8_linear`, fp32 x and y, on pack_vnni_w8a8's panels): an AVX-512 CPU with
    VNNI but no AVX512-BF16 (Intel Ice Lake, Cascade Lake), whose engine runs in fp32, and
    K a multiple of 16 (the kernel's quantizer takes 16 values a step)."""
    from minivllm.kernels.isa import cpu_flags

    return (
        qw.scheme == "int8_w8a8"
        and AVX512_VNNI_FLAGS <= cpu_flags()
        and qw.in_features > 0
        and qw.in_features % 16 == 0
    )


def kernel_supports_shape(scheme: str, in_features: int, group_size: int = 0) -> bool:
    """The bf16 kernels' shape precondition: K a multiple of 32, and for int4 a group size
    that is a multiple of 32 dividing K; fp8 per channel, or block-scaled with groups of a
    multiple of 64 k (its unit) dividing K (other blocks run the AVX2 family's op, in bf16
    engines too). Elsewhere use `reference_linear`."""
    if in_features <= 0 or in_features % 32:
        return False
    if scheme == "fp8_w8a16":
        return group_size == 0 or (divides(64, group_size) and in_features % group_size == 0)
    return scheme not in INT4_SCHEMES or (divides(32, group_size) and in_features % group_size == 0)


# -- int8_w8a8 for large batches: our AMX or VNNI GEMM on a prepacked copy ------------------

# (oneDNN's int8 GEMM, torch.ops.onednn.qlinear_pointwise, was a third layout; both our
# GEMMs beat it on the machines measured, the engine stopped choosing it, and it went.)
# Rows up to which the VNNI row kernel runs before our AMX kernel (amx_w8a8.cpp): on a
# 2-core Xeon over Qwen3-0.6B's linear shapes streamed from memory, at 4 rows the VNNI
# kernel is 1.1-1.7x ahead, at 6 they are even, at 8 the AMX one leads by 1.3-1.9x
# (benchmarks/w8a8_linear.py)
W8A8_AMX_MAX_KERNEL_ROWS = 4
# the same against our VNNI GEMM (quant_w8a8.cpp) on a CPU without AMX: none. On a 2-core
# AMD EPYC (Zen 4), Qwen3-0.6B's linears streamed from memory, the GEMM on its packed
# panels ran 1.0-1.2x the row kernel at 1-2 rows, 1.2-1.6x at 4-6 and 2-2.8x at 8-16
# (`python benchmarks/w8a8_linear.py --rows 1 2 4 8 16`), so it takes every batch
W8A8_VNNI_MAX_KERNEL_ROWS = 0


def packed_layout(packed: Tensor) -> str:
    """Which of `packing.PACKED_LAYOUTS` a prepacked int8_w8a8 copy is in."""
    return "amx" if packed.dim() == 5 else "vnni"


# weight-only schemes: rows up to which quant_linear streams the weight, decoding it in
# registers; past them the weight is dequantized to bf16 (dequantized_linear's blocks up
# to MAX_DEQUANTIZED_ROWS, below, else once per call for oneDNN's GEMM).
# Measured on a 2-core AMD EPYC (Zen 4), Qwen3-0.6B's linears from memory (2026-12-02):
# int8 and fp8 stream faster up to 64 rows (0.9x dequantize + GEMM's time at 64, 0.3-0.6x
# at 4-16); int4's group tiles only up to 4 against dequantized_linear (2026-12-04, `python
# benchmarks/dequantized_linear.py --rows 4 5 6 7 8`, ms a layer: 0.69 vs 1.05 at 4 rows,
# 1.49 vs 1.29 at 5, 1.46 vs 1.20 at 6, 1.74 vs 1.40 at 8). int4_w4a8 is not
# weight-only (its activations are rounded to int8 per group, which a dequantized weight
# times bf16 x would skip) and never runs quant_linear: its GEMM on the prepacked panels
# (int4_w4a8.cpp) takes every batch, routed experts' too, and where that cannot run (no
# AVX512-VNNI) the AVX2 family's op decides its own forms.
MAX_STREAMING_ROWS = {"int8_w8a16": 64, "fp8_w8a16": 64, "int4_w4a16": 4, "int4_w4a8": 0}
# A MoE step's tokens spread over its experts, each of which sees a few of them: its one
# call (moe_quant.cpp) and its experts in the routing loop keep quant_linear's exact
# products up to 8 tokens for int4, where a dense int4 layer hands 5-8 rows to
# dequantized_linear.
MOE_ONE_CALL_ROWS = {"int4_w4a16": 8}
# block-scaled fp8 (a scale per row and group of k): its group tiles against dequantize +
# GEMM on the same VM (2026-12-04, `python benchmarks/block_fp8.py`'s shapes, 128-k
# blocks): 1.2-1.8x faster at 8 rows, 0.9-1.2x at 16, 0.77-0.98x at 32, 0.74-0.81x at 64
MAX_STREAMING_ROWS_FP8_BLOCKS = 16


# int4 and block-scaled fp8 past those rows: `dequantized_linear` dequantizes a few weight
# rows at a time into a scratch and multiplies them there (the numbers of dequantize +
# GEMM, without writing the bf16 copy out). A layer of Qwen3-0.6B's shape from memory, 2
# threads, AMD EPYC Zen 4 (2026-12-04, `python benchmarks/dequantized_linear.py --rows 8
# 16 32 48 64 96`), ms against dequantize + oneDNN: int4 g128 1.27 vs 2.24 at 8 rows, 2.02
# vs 2.61 at 16, 3.30 vs 3.90 at 32, 4.62-4.69 vs 4.96-5.22 at 48, 6.01-6.28 vs 6.18-6.28
# at 64, 9.06 vs 8.75 at 96; block fp8 (128-k groups, `--scheme fp8-blocks`) 2.30 vs 2.67
# at 16, 3.67 vs 4.01 at 32, 5.23 vs 5.11 at 48. In the engine the dequantized copy costs
# more than alone (a fresh buffer, and oneDNN lays out a weight it sees for the first time
# at every call): int4 decode steps of 64 rows (Qwen3-0.6B shape) took 335 ms this way
# against 363 ms dequantized for oneDNN, so int4 takes it to 64 rows.
MAX_DEQUANTIZED_ROWS = {"int4_w4a16": 64, "fp8_blocks": 32}


# The weight-only schemes on CPUs with AMX-BF16: amx_weight_only_linear (amx_weight_only.cpp)
# decodes the rows into bf16 tiles for the tile unit, and takes over from quant_linear past
# these rows (int8 and fp8 per channel; int4 in groups of a multiple of 128) up to
# AMX_WEIGHT_ONLY_MAX_ROWS, past which dequantize + oneDNN's GEMM runs. On a 2-vCPU Xeon
# (AMX), Qwen3-0.6B's four linears from memory, ms a layer (2026-12-07, `python
# benchmarks/dequantized_linear.py --scheme int8 --rows 1 2 3 4 6 128 512`, and int4, fp8):
# int8 quant_linear 0.88 vs AMX 1.00 at 4 rows, 1.81 vs 1.02 at 6, 3.59 vs 1.07 at 16 (bf16
# on oneDNN 1.50); int4 g128 0.62 vs 0.74 at 2 rows, 0.83 vs 0.76 at 3, 3.86 vs 0.78 at 16
# (the best other form, dequantize + GEMM, 2.55); fp8 1.09 vs 1.40 at 4, 1.77 vs 1.23 at 6.
# At 256 rows AMX 5.41 vs dequantize + GEMM 6.53 (int8), 6.17 vs 6.27 (int4); at 384 9.1
# vs 8.4 and 10.0 vs 7.5.
AMX_MAX_STREAMING_ROWS = {"int8_w8a16": 4, "fp8_w8a16": 4, "int4_w4a16": 2}
AMX_WEIGHT_ONLY_MAX_ROWS = 256
AMX_INT4_GROUP_MULTIPLE = 128  # its decoder's unit: a group must be whole units


def amx_weight_only_takes(qw: QuantWeights) -> bool:
    """Whether amx_weight_only_linear takes `qw` (on a CPU with AMX-BF16)."""
    if qw.scheme not in AMX_MAX_STREAMING_ROWS or qw.in_features <= 0 or qw.in_features % 32:
        return False
    if qw.scheme == "int4_w4a16":
        return divides(AMX_INT4_GROUP_MULTIPLE, qw.group_size)
    return qw.group_size == 0  # per channel (block-scaled fp8 keeps its group tiles)


def max_dequantized_rows(qw: QuantWeights) -> int:
    """Rows up to which `dequantized_linear` runs `qw` past `max_kernel_rows` (0: never)."""
    if qw.scheme == "fp8_w8a16" and qw.group_size:
        return MAX_DEQUANTIZED_ROWS["fp8_blocks"]
    return MAX_DEQUANTIZED_ROWS.get(qw.scheme, 0)


def moe_one_call_rows(qw: QuantWeights) -> int:
    """Tokens up to which a MoE layer of `qw`'s experts runs in one call (moe_quant.cpp)."""
    return max(max_kernel_rows(qw), MOE_ONE_CALL_ROWS.get(qw.scheme, 0))


def max_kernel_rows(qw: QuantWeights, amx: bool = False) -> int:
    """Rows up to which `quant_linear` runs `qw`: past them a weight-only scheme runs on
    AMX tiles (`amx`: the engine has amx_weight_only_linear and the CPU AMX-BF16, and the
    kernel takes `qw`) or is dequantized (`max_dequantized_rows`), and int8_w8a8 runs a
    GEMM on its prepacked copy."""
    if amx and amx_weight_only_takes(qw):
        return AMX_MAX_STREAMING_ROWS[qw.scheme]
    if qw.scheme == "int8_w8a8":
        return w8a8_max_kernel_rows(qw.packed)
    if qw.scheme == "fp8_w8a16" and qw.group_size:
        return MAX_STREAMING_ROWS_FP8_BLOCKS
    return MAX_STREAMING_ROWS[qw.scheme]


def w8a8_max_kernel_rows(packed: Tensor | None) -> int:
    """Rows up to which the VNNI kernel runs int8_w8a8 before the prepacked copy's GEMM."""
    if packed is None:
        return 1 << 62
    amx = packed_layout(packed) == "amx"
    return W8A8_AMX_MAX_KERNEL_ROWS if amx else W8A8_VNNI_MAX_KERNEL_ROWS
