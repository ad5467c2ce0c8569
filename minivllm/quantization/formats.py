"""Quantized linear weights as the CPU kernels read them, and the plain-PyTorch reference.

`reference_linear` is the contract: the kernels (`kernels/quant_gemm.cpp`) compute the
same float32 sums in another order and round once to bf16, and
tests/test_quant_kernels.py holds them to it. Five schemes:

    scheme        weight [N, K] stored as            scale            activations
    int8_w8a16    int8, symmetric per channel        float32 [N]      bf16
    int8_w8a8     int8, symmetric per channel        float32 [N]      int8 per token, in the kernel
    fp8_w8a16     float8 e4m3 bits (uint8)           float32 [N]      bf16
                                                     (or [N, K/G]: a block-scaled checkpoint)
    int4_w4a16    uint8 [N, K/2], two nibbles a byte float32 [N, K/G] bf16   (zero: [N, K/G] or 8)
    int4_w4a8     as int4_w4a16                      as int4_w4a16    int8 per token and group

The int4 nibbles are packed so that one 16-byte load, widened to 16-bit lanes, gives
16 consecutive k from the low nibbles and the next 16 from the high ones:

    one 32-element chunk of a row:   q[0] q[1] ... q[15] | q[16] q[17] ... q[31]
    its 16 bytes:                    byte j = q[j] | q[j + 16] << 4     (j = 0..15)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# the scheme names live in config.py (no torch there); INT4_SCHEMES share one weight layout
from minivllm.quantization.config import INT4_SCHEMES, SCHEMES

# the `kind` argument of the compiled `quant_linear`
KIND_INT8_W8A16 = 1
KIND_INT4_W4A16 = 2
KIND_FP8_W8A16 = 3
KIND_INT8_W8A8 = 4
KIND_INT4_W4A8 = 5
KERNEL_KIND = {
    "int8_w8a16": KIND_INT8_W8A16,
    "int4_w4a16": KIND_INT4_W4A16,
    "fp8_w8a16": KIND_FP8_W8A16,
    "int8_w8a8": KIND_INT8_W8A8,
    "int4_w4a8": KIND_INT4_W4A8,
}

INT8_MAX = 127
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT4_CHUNK = 32  # k per packed chunk: 16 bytes
INT4_SYMMETRIC_ZERO = 8  # symmetric int4 stores q + 8 in [0, 15]


@dataclass(slots=True)
class QuantWeights:
    """What a quantized linear holds, in the kernels' layout (see the module docstring).

    `zero` is int4's per-group zero point (None: symmetric, 8), `wsum` int8_w8a8's row
    sums of q, `group_size` int4's k per scale (0 for per-channel schemes). `packed` is a
    prepacked copy for our GEMMs: int8_w8a8's for large batches (`packing.prepack_w8a8`: the AMX
    or VNNI GEMM's layout), int4_w4a8's for every batch (`packing.prepack_w4a8`); it is derived,
    so `tensors()` leaves it out (the layer holds it as a buffer for the weight cache:
    `QuantizedLinearMethod.hold_packed`); a rebuilt QuantWeights prepacks anew from its
    rows, or takes the mapped copy where the rows were dropped (`packing.drop_rows`).
    """

    scheme: str
    weight: Tensor
    scale: Tensor
    zero: Tensor | None
    wsum: Tensor | None
    group_size: int
    out_features: int
    in_features: int
    packed: Tensor | None = None

    def __post_init__(self) -> None:
        _check_layout(self)

    @property
    def kind(self) -> int:
        return KERNEL_KIND[self.scheme]

    @property
    def has_rows(self) -> bool:
        """False for int4_w4a8 or int8_w8a8 whose row copy of the weight was dropped
        (`weight` is [N, 0]) because its panel GEMM reads only `packed` (`packing.drop_rows`)."""
        return self.weight.shape[-1] != 0 or self.in_features == 0

    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors by name (the None ones left out), to register as parameters."""
        named = {"weight": self.weight, "scale": self.scale, "zero": self.zero, "wsum": self.wsum}
        return {name: t for name, t in named.items() if t is not None}

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, Tensor],
        scheme: str,
        group_size: int,
        out_features: int,
        in_features: int,
    ) -> QuantWeights:
        """The inverse of `tensors()`, with the metadata it does not carry."""
        return cls(
            scheme,
            tensors["weight"],
            tensors["scale"],
            tensors.get("zero"),
            tensors.get("wsum"),
            group_size,
            out_features,
            in_features,
        )


def _check_layout(qw: QuantWeights) -> None:
    """Raise ValueError unless qw's tensors have the dtypes and shapes its scheme needs."""
    n, k = qw.out_features, qw.in_features
    if qw.scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {qw.scheme!r}; known: {SCHEMES}")
    want_dtype = torch.int8 if qw.scheme.startswith("int8") else torch.uint8
    want_shape = (n, k // 2) if qw.scheme in INT4_SCHEMES else (n, k)
    if qw.scheme in ("int4_w4a8", "int8_w8a8") and qw.weight.shape == (n, 0):
        want_shape = (n, 0)  # rowless: its panels hold the weight (`has_rows`)
    _expect(qw.weight, "weight", want_dtype, want_shape)
    if qw.scheme in INT4_SCHEMES:
        if not divides(INT4_CHUNK, qw.group_size) or k % qw.group_size:
            raise ValueError(
                f"int4 groups of {qw.group_size} must be a multiple of {INT4_CHUNK} dividing K={k}"
            )
        groups = (n, k // qw.group_size)
        _expect(qw.scale, "scale", torch.float32, groups)
        if qw.zero is not None:
            _expect(qw.zero, "zero", torch.float32, groups)
    elif qw.scheme == "fp8_w8a16" and qw.group_size:  # block-scaled checkpoints (FP8_BLOCK)
        if k % qw.group_size or qw.zero is not None:
            raise ValueError(f"fp8 groups of {qw.group_size} must divide K={k}; no zero point")
        _expect(qw.scale, "scale", torch.float32, (n, k // qw.group_size))
    else:
        if qw.group_size != 0 or qw.zero is not None:
            raise ValueError(f"{qw.scheme} is per channel: group_size 0 and no zero point")
        _expect(qw.scale, "scale", torch.float32, (n,))
    if qw.scheme == "int8_w8a8":
        if qw.wsum is None:
            raise ValueError("int8_w8a8 needs wsum, the int32 row sums of q")
        _expect(qw.wsum, "wsum", torch.int32, (n,))
    elif qw.wsum is not None:
        raise ValueError(f"{qw.scheme} has no wsum")


def _expect(t: Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"{name}: want {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def divides(d: int, n: int) -> bool:
    """Whether n is a positive multiple of d."""
    return n > 0 and n % d == 0


# -- from pre-quantized values (checkpoints) -------------------------------------------


def from_int8_values(q: Tensor, scale: Tensor, scheme: str = "int8_w8a16") -> QuantWeights:
    """int8 q [N, K] and per-channel scale [N], w = q * scale: no re-quantization."""
    if q.dtype != torch.int8 or scheme not in ("int8_w8a16", "int8_w8a8"):
        raise ValueError(f"want int8 values for an int8 scheme, got {q.dtype} for {scheme!r}")
    # -128 is fine (compressed-tensors' symmetric scale is max|w|/127.5, so its checkpoints
    # have it): VNNI multiplies u8 by s8 into int32 lanes, and the reference is exact
    q = q.contiguous()
    wsum = q.sum(dim=1, dtype=torch.int32) if scheme == "int8_w8a8" else None
    n, k = q.shape
    return QuantWeights(scheme, q, _float32(scale), None, wsum, 0, n, k)


def from_fp8_values(q: Tensor, scale: Tensor, group_size: int = 0) -> QuantWeights:
    """float8_e4m3fn q [N, K] (or its uint8 bits) and per-channel scale [N], or with
    `group_size` G a scale per row and group of G k [N, K/G]; no NaNs."""
    if q.dtype == torch.float8_e4m3fn:
        q = q.view(torch.uint8)
    if q.dtype != torch.uint8:
        raise ValueError(f"want float8_e4m3fn values or their uint8 bits, got {q.dtype}")
    if bool(((q & 0x7F) == 0x7F).any()):  # the kernel decodes the NaN pattern as a number
        raise ValueError("fp8 weights contain NaN")
    n, k = q.shape
    return QuantWeights("fp8_w8a16", q.contiguous(), _float32(scale), None, None, group_size, n, k)


def from_int4_values(
    q: Tensor, scale: Tensor, zero: Tensor | None, group_size: int, scheme: str = "int4_w4a16"
) -> QuantWeights:
    """Unpacked int4 values q in [0, 15] (uint8 [N, K]), scales [N, K/G] and zero points
    [N, K/G] (None: symmetric, 8), w = (q - zero) * scale; packs q for the kernel."""
    if scheme not in INT4_SCHEMES:
        raise ValueError(f"want an int4 scheme ({', '.join(INT4_SCHEMES)}), got {scheme!r}")
    if q.dtype != torch.uint8 or bool((q > 15).any()):
        raise ValueError("want int4 values as uint8 in [0, 15]")
    n, k = q.shape
    zero = None if zero is None else _float32(zero)
    return QuantWeights(scheme, pack_int4(q), _float32(scale), zero, None, group_size, n, k)


def _float32(t: Tensor) -> Tensor:
    return t.detach().to(torch.float32).contiguous()


def pack_int4(q: Tensor) -> Tensor:
    """uint8 values [N, K] in [0, 15] -> uint8 [N, K/2] in the kernel's chunk layout."""
    n, k = q.shape
    if k % INT4_CHUNK:
        raise ValueError(f"int4 rows pack in chunks of {INT4_CHUNK}; K={k} is not a multiple")
    halves = q.reshape(n, k // INT4_CHUNK, 2, INT4_CHUNK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of `pack_int4`: uint8 [N, K/2] -> values [N, K] in [0, 15]."""
    n, half_k = packed.shape
    chunks = packed.reshape(n, -1, INT4_CHUNK // 2)
    return torch.stack((chunks & 0xF, chunks >> 4), dim=2).reshape(n, 2 * half_k)


# -- online quantization ------------------------------------------------------------------


def quantize(
    weight: Tensor,
    scheme: str,
    group_size: int = 128,
    symmetric: bool = True,
    empty: Callable[..., Tensor] | None = None,
    kernel: Callable[..., None] | None = None,
) -> QuantWeights:
    """Quantize a float weight [N, K] (in float32) into `scheme`'s kernel layout.

    int8 (both): scale = amax|w_row| / 127 (1 for a zero row), q = clamp(round(w/scale), +-127).
    fp8_w8a16: scale = amax|w_row| / 448, q = e4m3(clamp(w/scale, +-448)), round to nearest.
    int4_w4a16 and int4_w4a8, per group of `group_size` k (K % group_size == 0):
      symmetric:  scale = amax|w_g| / 7, q = clamp(round(w/scale), -8, 7) + 8, zero None (8);
      asymmetric: the group's range [lo, hi] widened to include 0 (so zero is exact and
                  z in range), scale = (hi - lo) / 15, z = clamp(round(-lo/scale), 0, 15),
                  q = clamp(round(w/scale) + z, 0, 15).
    Dequantization is w = q * scale, or (q - z) * scale for int4.

    Every scheme's numbers are per row, so a large weight is quantized `QUANTIZE_CHUNK`
    elements of rows at a time: the float32 temporaries stay a few MiB whatever the layer
    (a load that quantizes layer by layer, loader/streamed_quantization.py, would otherwise
    leave them in the heap as it grew), and the result is the same. `empty(shape, dtype,
    device)` allocates the results of such a weight (the huge-page arena's, so that a large
    LM head is quantized where it stays instead of copied there after).

    `kernel`: the compiled `quantize_weight` (kernels/quantize_weight.cpp), which quantizes a
    bf16 weight's int8, int4 and fp8 schemes bit for bit as below in one pass over each row
    (~0.5 G weights a second here become several; tests/test_quantize_weight.py checks them
    equal); other weights take the torch ops. A weight with NaN or infinite values is refused.
    """
    if kernel is not None and _kernel_quantizes(weight, scheme, group_size):
        return _finite(_quantize_compiled(kernel, weight, scheme, group_size, symmetric, empty))
    n, k = weight.shape
    rows = max(1, QUANTIZE_CHUNK // max(k, 1))
    if n <= rows:
        return _finite(_quantize_rows(weight, scheme, group_size, symmetric))
    first = _quantize_rows(weight[:rows], scheme, group_size, symmetric)
    empty = empty or torch.empty
    out = {
        name: empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for name, t in first.tensors().items()
    }
    for start in range(0, n, rows):
        part = (
            first
            if start == 0
            else _quantize_rows(weight[start : start + rows], scheme, group_size, symmetric)
        )
        for name, t in part.tensors().items():
            out[name][start : start + len(t)].copy_(t)
    return _finite(dataclasses.replace(first, **out, out_features=n))


def _finite(qw: QuantWeights) -> QuantWeights:
    """`qw`, unless a NaN or an infinity in the weight made a scale other than finite (the
    values it scaled are then meaningless)."""
    if not bool(torch.isfinite(qw.scale).all()):
        raise ValueError(
            f"{qw.scheme}: the weight [{qw.out_features}, {qw.in_features}] holds NaN or "
            "infinite values, which cannot be quantized; is the checkpoint damaged?"
        )
    return qw


QUANTIZE_CHUNK = 1 << 18  # elements of the weight quantized at a time (1 MiB as float32)


def _kernel_quantizes(weight: Tensor, scheme: str, group_size: int) -> bool:
    """Whether `quantize_weight` takes this weight: bf16 on the CPU, K a multiple of 16 (int8, fp8)
    with int4 groups of a multiple of 32 dividing it (the only groups formats' layout takes)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    k = weight.shape[1]
    if scheme in ("int8_w8a16", "int8_w8a8", "fp8_w8a16"):
        return k % 16 == 0
    return (
        scheme in INT4_SCHEMES
        and group_size > 0
        and group_size % INT4_CHUNK == 0
        and k % group_size == 0
    )


def _quantize_compiled(
    kernel: Callable[..., None],
    weight: Tensor,
    scheme: str,
    group_size: int,
    symmetric: bool,
    empty: Callable[..., Tensor] | None,
) -> QuantWeights:
    n, k = weight.shape
    empty = empty or torch.empty
    w = weight.detach().contiguous()
    if scheme not in INT4_SCHEMES:  # per channel: int8 (kernel kind 1), fp8 (3)
        fp8 = scheme == "fp8_w8a16"
        q = empty((n, k), dtype=torch.uint8 if fp8 else torch.int8, device=w.device)
        scale = empty((n,), dtype=torch.float32, device=w.device)
        wsum = torch.empty(n, dtype=torch.int32) if scheme == "int8_w8a8" else None
        kernel(w, 3 if fp8 else 1, 0, q, scale, None, wsum)
        return QuantWeights(scheme, q, scale, None, wsum, 0, n, k)
    groups = (n, k // group_size)
    packed = empty((n, k // 2), dtype=torch.uint8, device=w.device)
    scale = empty(groups, dtype=torch.float32, device=w.device)
    zero = None if symmetric else empty(groups, dtype=torch.float32, device=w.device)
    kernel(w, 2, group_size, packed, scale, zero, None)
    return QuantWeights(scheme, packed, scale, zero, None, group_size, n, k)


def _quantize_rows(weight: Tensor, scheme: str, group_size: int, symmetric: bool) -> QuantWeights:
    w = weight.detach().to(torch.float32)
    if scheme in ("int8_w8a16", "int8_w8a8"):
        scale = _amax_scale(w.abs().amax(dim=1), INT8_MAX)
        q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return from_int8_values(q, scale, scheme)
    if scheme == "fp8_w8a16":
        scale = _amax_scale(w.abs().amax(dim=1), FP8_MAX)
        q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return from_fp8_values(q, scale)
    if scheme in INT4_SCHEMES:
        return _quantize_int4(w, group_size, symmetric, scheme)
    raise ValueError(f"unknown quantization scheme {scheme!r}; known: {SCHEMES}")


def _amax_scale(amax: Tensor, qmax: float) -> Tensor:
    # 1 for a zero row; a NaN amax stays NaN (`_finite` refuses it)
    return torch.where(amax == 0, torch.ones_like(amax), amax / qmax)


def _quantize_int4(w: Tensor, group_size: int, symmetric: bool, scheme: str) -> QuantWeights:
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"K={k} is not a multiple of the int4 group size {group_size}")
    groups = w.reshape(n, k // group_size, group_size)
    if symmetric:
        scale = _amax_scale(groups.abs().amax(dim=-1), 7)
        q = torch.round(groups / scale[..., None]).clamp_(-8, 7) + INT4_SYMMETRIC_ZERO
        zero = None
    else:
        lo = groups.amin(dim=-1).clamp(max=0)
        hi = groups.amax(dim=-1).clamp(min=0)
        scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 15)
        zero = torch.round(-lo / scale).clamp_(0, 15)
        q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp_(0, 15)
    return from_int4_values(q.reshape(n, k).to(torch.uint8), scale, zero, group_size, scheme)


# -- the reference ---------------------------------------------------------------------------


def dequantize(qw: QuantWeights) -> Tensor:
    """The float32 weight [N, K] that `qw` stands for: q * scale, or (q - z) * scale (int4)."""
    if qw.scheme in ("int8_w8a16", "int8_w8a8"):
        return qw.weight.to(torch.float32) * qw.scale[:, None]
    if qw.scheme == "fp8_w8a16":
        scale = qw.scale.repeat_interleave(qw.group_size, 1) if qw.group_size else qw.scale[:, None]
        return qw.weight.view(torch.float8_e4m3fn).to(torch.float32) * scale
    q = unpack_int4(qw.weight).to(torch.float32)
    zero = INT4_SYMMETRIC_ZERO if qw.zero is None else qw.zero.repeat_interleave(qw.group_size, 1)
    return (q - zero) * qw.scale.repeat_interleave(qw.group_size, 1)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """int8_w8a8's activations, row by row in float32: xs = amax|x_row| / 127 (1 for a zero
    row), xq = clamp(round(x / xs), +-127), rounding half to even. Returns (xq, xs)."""
    xf = x.to(torch.float32)
    xs = _amax_scale(xf.abs().amax(dim=-1), INT8_MAX)
    xq = torch.round(xf / xs[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq, xs


def quantize_per_group(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """int4_w4a8's activations, in float32 per row and group of `group_size` k: amax = the
    group's max |x|, inv = 127 / amax and xs = amax / 127 (both 1 for a group of zeros),
    xq = round(x * inv) (half to even; |xq| <= 127). Returns (xq int8 [..., K], xs [...,
    K / group_size]).

    Per group, not per token as vLLM's W4A8: the kernel scales each group's integer sum
    anyway, so the finer scale costs nothing, and a row's outlier channels (Qwen's and
    Llama's few huge activations) then coarsen only their own group's rounding, not the
    whole row's (llama.cpp's q8_0 activations are per 32)."""
    xf = x.to(torch.float32)
    groups = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group_size, group_size)
    amax = groups.abs().amax(dim=-1)
    # a true fp32 division, as the kernel's (a Python number over a tensor is computed as
    # its reciprocal times the number: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, INT8_MAX) / amax, torch.ones_like(amax))
    xs = _amax_scale(amax, INT8_MAX)
    xq = torch.round(groups * inv[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq.reshape(xf.shape), xs


def reference_linear(x: Tensor, qw: QuantWeights, bias: Tensor | None = None) -> Tensor:
    """x [..., K] times qw's weight, the kernels' contract for bf16 x; [..., N] in x's dtype.

    Weight-only schemes: y = x @ dequantize(qw).T (+ bias), in float32, rounded to x's
    dtype once. int8_w8a8: (xq, xs) = quantize_per_token(x), acc[m, n] = sum_k xq[m, k]
    q[n, k] exactly, y = acc * xs[m] * scale[n] (+ bias) in float32, rounded once.
    int4_w4a8: (xq, xs) = quantize_per_group(x, G), y = (xq * xs) @ dequantize(qw).T
    summed in float64 (the kernel sums each group's integers exactly and scales them).
    """
    rows = x.reshape(-1, qw.in_features)
    if qw.scheme == "int8_w8a8":
        xq, xs = quantize_per_token(rows)
        acc = (xq.to(torch.float64) @ qw.weight.to(torch.float64).T).to(torch.float32)
        y = acc * xs[:, None] * qw.scale
    elif qw.scheme == "int4_w4a8":
        xq, xs = quantize_per_group(rows, qw.group_size)
        xd = xq.to(torch.float64) * xs.to(torch.float64).repeat_interleave(qw.group_size, -1)
        y = (xd @ dequantize(qw).to(torch.float64).T).to(torch.float32)
    else:
        y = rows.to(torch.float32) @ dequantize(qw).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], qw.out_features)
