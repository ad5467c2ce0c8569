"""The quantized linear method: a layer whose weight is int8, int4 or fp8 (`formats.py`).

Online quantization keeps the checkpoint's full-precision `weight` until
`process_weights_after_loading`, which quantizes it and replaces it with the scheme's
tensors in the kernel's layout (`formats.QuantWeights`), registered as the layer's
parameters so the weight cache (`weight_cache/`) can serve them as they are. A
pre-quantized checkpoint layer (`compressed_tensors.py`) arrives at the same
`QuantWeights` from the checkpoint's own tensors instead.

`apply` runs our C++ kernel (`quant_linear`, dequantizing in registers) where the
machine and shape allow and the backend choice says so, else the plain-PyTorch
reference, which is also the kernel's test oracle. Weight-only schemes at large
batches (prefill) dequantize the weight to bf16 once per call (the compiled
`dequantize_bf16`) and use the dense GEMM: there the step is compute-bound and
oneDNN's bf16 GEMM is faster than converting in registers. Between the two, int4 and
block-scaled fp8 batches (a few dozen rows) run `dequantized_linear`: the same numbers as
dequantize + GEMM, a few rows of the weight dequantized at a time into a scratch, so the
bf16 copy is never written out. int8_w8a8 at large batches runs a GEMM on its prepacked
copy: our AMX kernel where the CPU has AMX-INT8, else our AVX512-VNNI GEMM. int4_w4a8
runs every batch on its own prepacked copy, panels of 16 int4 rows for an AVX512-VNNI
GEMM (`packing.pack_vnni_w4a8`), a MoE layer's routed experts too (each expert its own
panels), and then keeps no row copy of the nibbles (`packing.drop_rows`; an embedding
table, read by lookups, keeps its rows and gets no panels), nor does int8_w8a8 where its
VNNI panels take every batch (CPUs without AMX); CPUs without VNNI borrow the
AVX2 family's op for it, on the rows. The prepacked copies are the layer's buffers, so
the weight cache (Fast Start) holds them and mapping engines do not repack.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.registry import Kernels
from minivllm.layers.linear_method import (
    LinearMethodBase,
    WeightLoader,
    create_full_precision_weight,
)
from minivllm.quantization import formats, kernel_limits, packing
from minivllm.quantization.config import SchemeSpec
from minivllm.utils import huge_pages

logger = logging.getLogger("minivllm")


class QuantizedLinearMethod(LinearMethodBase):
    """One quantization scheme for one layer; `backend` None picks the fastest correct op."""

    supports_mapped_weights = True

    def __init__(
        self, spec: SchemeSpec, backend: str | None = None, source: str = "online"
    ) -> None:
        self.spec = spec
        self.requested_backend = backend
        self.source = source  # "online", or the checkpoint format that quantized it
        self.quant_weights: formats.QuantWeights | None = None
        self.op = None  # the compiled quant_linear, where used
        self.fp32_op = None  # the AVX2 family's linear_quantw, for fp32 engines
        # int8_w8a8 in an fp32 engine on AVX512-VNNI: the AVX2 family's vnni_w8a8_linear,
        # which then runs every call on its packed panels (kernel_limits.fp32_vnni_takes)
        self.fp32_vnni_op = None
        self._unit_scale: torch.Tensor | None = None  # int8_w8a8 there: ones, per channel
        # our GEMM on the prepacked copy: int8_w8a8's past a few rows, int4_w4a8's always
        self.packed_op = None
        self.dequantize_op = None  # the compiled dequantize_bf16, with `op`
        self.kernel_rows = 0  # rows for quant_linear; past them kernel_limits.max_kernel_rows says
        self.dequantized_rows = 0  # then dequantized_linear's (kernel_limits.max_dequantized_rows)
        self.dequantized_op = None  # the compiled dequantized_linear, with `op`
        # amx_weight_only_linear, with `op` where the CPU has AMX-BF16 and the kernel takes
        # the weight: from kernel_rows to amx_rows (kernel_limits.AMX_WEIGHT_ONLY_MAX_ROWS)
        self.amx_op = None
        self.amx_rows = 0
        self.kernel_op = None  # the compiled quant_linear the engine offered, used or not
        self.backend = "torch"
        self.dtype = torch.get_default_dtype()  # the model's: what dequantized rows become
        self.lookup_table = False  # an embedding table's: read by `embed`, never multiplied

    @property
    def kernels_on(self) -> bool:
        return self.op is not None  # the bf16 quant_linear (the fused decode step runs it)

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, weight_loader: WeightLoader
    ) -> None:
        create_full_precision_weight(layer, input_size, output_size, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        if self.quant_weights is not None:
            # processed already (loader/streamed_quantization.py, as the checkpoint
            # streamed): `weight` now holds the quantized values, not the checkpoint's
            return
        full = layer.weight.data
        self.dtype = full.dtype
        # the weight-only schemes keep their rows whatever the backend: quantized straight
        # onto huge pages, a large one (a tied LM head, 389 MB of int8 at the Qwen3-4B
        # shape) is not held twice on its way there; int8_w8a8's and int4_w4a8's rows may
        # give way to panels (`use`)
        rows_stay = self.spec.scheme not in ("int8_w8a8", "int4_w4a8")
        empty = huge_pages.weights_arena().empty if rows_stay else None
        qw = formats.quantize(
            full,
            self.spec.scheme,
            self.spec.group_size,
            self.spec.symmetric,
            empty,
            kernels.op("quantize_weight"),
        )
        self.install(layer, qw, kernels)

    def install(self, layer: nn.Module, qw: formats.QuantWeights, kernels: Kernels) -> None:
        """Replace the layer's checkpoint tensors with `qw`'s and choose the op. The tensors
        the op keeps then move to huge pages (utils/huge_pages.py: ~1.08x on the int4
        decode stream); rows `use` drops never go there."""
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            delattr(layer, name)
        self.lookup_table = bool(getattr(layer, "is_lookup_table", False))
        self.use(qw, kernels)
        arena = huge_pages.weights_arena()
        qw = self.quant_weights
        qw = dataclasses.replace(qw, **{n: arena.copy(t) for n, t in qw.tensors().items()})
        self.quant_weights = qw
        for name, tensor in qw.tensors().items():
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.hold_packed(layer)

    def prepare_for_mapping(self, layer: nn.Module) -> None:
        """Give an unloaded layer the processed tensors' names, shapes and dtypes (left
        uninitialised) so the weight cache (`load_format="ipc_cache"`) can map its own there."""
        shapes = processed_shapes(self.spec, layer.output_size, layer.input_size, self.group_size)
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            delattr(layer, name)
        for name, (shape, dtype) in shapes.items():
            layer.register_parameter(
                name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            )

    def process_weights_after_mapping(self, layer: nn.Module, kernels: Kernels) -> None:
        """The weight cache mapped the tensors `install` registered: rebuild the view of them."""
        tensors = {n: p.data for n, p in layer.named_parameters(recurse=False) if n != "bias"}
        qw = formats.QuantWeights.from_tensors(
            tensors, self.spec.scheme, self.group_size, layer.output_size, layer.input_size
        )
        self.lookup_table = bool(getattr(layer, "is_lookup_table", False))
        self.use(qw, kernels, mapped_packed=layer._buffers.get("packed"))
        weight = self.quant_weights.weight
        if weight is not tensors["weight"]:  # rows dropped, or rebuilt from mapped panels
            layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        self.hold_packed(layer)

    # buffers a mapping engine takes from the weight cache where the daemon's load made them
    # and its own model (`prepare_for_mapping`) has none (weight_cache/loader.install_tensors)
    optional_mapped_buffers = ("packed",)

    def use(
        self,
        qw: formats.QuantWeights,
        kernels: Kernels,
        mapped_packed: torch.Tensor | None = None,
        huge_pages_copy: bool = True,
        fp32_vnni: bool = True,
    ) -> None:
        """Apply `qw` from now on: choose the op, and give int8_w8a8 on the kernels its
        prepacked copy for large batches (our AMX kernel's layout where the CPU has
        AMX-INT8, else our VNNI GEMM's) and int4_w4a8 its panels, which then serve every
        call: its row copy of the nibbles is dropped (`packing.drop_rows`), as int8_w8a8's
        where its VNNI panels take every batch. `mapped_packed`: that copy as the weight
        cache holds it, taken instead of packing where its shape is right; a layer that
        needs rows (the reference backend, an embedding table's lookups, another layout)
        and came without them has them rebuilt from it. `fp32_vnni` False keeps an fp32
        engine's int8_w8a8 off the VNNI panels, on its rows: a MoE layer's experts, whose
        one call (moe_quantw) reads the stacked rows; panels would put them back on the
        per-expert Python loop, which that call replaced (not measured for these panels)."""
        self.choose_backend(qw, kernels, fp32_vnni)
        layout = None if self.lookup_table else self.packed_layout(qw, kernels)
        if layout is None or not packing.fits(mapped_packed, qw, layout):
            # rows to run or pack from: rebuilt from mapped panels where none came (this
            # engine reads rows, or gets AMX blocks where the daemon chose VNNI panels)
            qw = packing.with_rows(qw, mapped_packed)
        if layout is not None:
            # the panels serve every call (int8_w8a8's too on VNNI without AMX): no row
            # copy beside them
            every_call = (
                layout == "w4a8"
                or self.fp32_vnni_op is not None
                or (layout == "vnni" and kernel_limits.W8A8_VNNI_MAX_KERNEL_ROWS == 0)
            )
            # int4_w4a8's panels, streamed at every decode step, are packed on huge pages
            # (~1.08x, docs/performance.md item 21). int8_w8a8's stay on small pages: on
            # a 2-vCPU Zen 4 (2026-12-05) huge pages took its 0.6B-shape load from ~1.6 to
            # ~2.4 s (faulting 420 MB of huge pages in) for batch-1 decode within noise
            arena = huge_pages.weights_arena() if layout == "w4a8" and huge_pages_copy else None
            packing.prepack(qw, layout, mapped_packed, arena and arena.empty, kernels.op)
            if every_call:
                qw = packing.drop_rows(qw)
            self.packed_op = self.fp32_vnni_op or kernels.op(
                "int4_w4a8_packed_linear" if layout == "w4a8" else "w8a8_packed_linear"
            )
        self.kernel_rows = kernel_limits.max_kernel_rows(qw, amx=self.amx_op is not None)
        self.dequantized_rows = kernel_limits.max_dequantized_rows(qw)
        self.quant_weights = qw

    def packed_layout(self, qw: formats.QuantWeights, kernels: Kernels) -> str | None:
        """The layout of the prepacked copy `use` gives `qw` (`packing.packed_shape`'s), or
        None where its op reads none; after `choose_backend`."""
        if self.fp32_vnni_op is not None:
            return "vnni"
        if self.op is None or qw.scheme not in ("int8_w8a8", "int4_w4a8"):
            return None
        if qw.scheme == "int4_w4a8":
            return "w4a8"
        amx = kernels.op("amx_w8a8_available")
        return "amx" if amx is not None and amx() else "vnni"

    def hold_packed(self, layer: nn.Module) -> None:
        """The prepacked copy as the layer's buffer `packed` (not persistent: no checkpoint
        has it), so that a weight cache daemon holds it and mapping engines take it as it
        is instead of packing their own at each start; no buffer where there is no copy."""
        packed = None if self.quant_weights is None else self.quant_weights.packed
        if packed is None:
            layer._buffers.pop("packed", None)
        else:
            layer.register_buffer("packed", packed, persistent=False)

    @property
    def op_name(self) -> str:
        """What runs `apply`, in words, for the log."""
        if self.fp32_vnni_op is not None:
            return (
                "cpu_kernel (the AVX2 family's vnni_w8a8_linear: int8 activations on "
                "AVX512-VNNI, float32 in and out)"
            )
        if self.fp32_op is not None:
            return "cpu_kernel (the AVX2 family's linear_quantw, float32 activations)"
        if self.op is not None and self.spec.scheme == "int4_w4a8":
            return "cpu_kernel (int4_w4a8_packed_linear, int8 activations on AVX512-VNNI)"
        if self.amx_op is not None:
            return "cpu_kernel (quant_linear, bfloat16 activations; batches on AMX-BF16 tiles)"
        if self.op is not None:
            return "cpu_kernel (quant_linear, bfloat16 activations)"
        return "torch (the plain-PyTorch reference)"

    @property
    def group_size(self) -> int:
        return self.spec.group_size if self.spec.scheme in formats.INT4_SCHEMES else 0

    def choose_backend(
        self, qw: formats.QuantWeights, kernels: Kernels, fp32_vnni: bool = True
    ) -> None:
        # an fp32 engine on the AVX2 family: the rows are decoded in registers and
        # multiplied in fp32 (int8_w8a8: on its quantized activations, `_apply_fp32`)
        fp32_op = kernels.op("linear_quantw")
        self.fp32_vnni_op = None
        cpu = kernels.key is not None and kernels.key.device == "cpu"
        borrow = (
            qw.scheme == "int4_w4a8"
            and not (
                kernel_limits.kernel_supports(qw.scheme)
                and kernel_limits.kernel_supports_shape(qw.scheme, qw.in_features, qw.group_size)
            )
        ) or (
            qw.scheme == "fp8_w8a16"
            and qw.group_size > 0
            and not kernel_limits.kernel_supports_shape(qw.scheme, qw.in_features, qw.group_size)
        )
        if fp32_op is None and borrow and cpu:
            # no bf16 kernel for it here (int4_w4a8 without AVX512-VNNI; fp8 blocks of
            # other than a multiple of 64 k):
            # every CPU with AVX-512 has AVX2 too, so bf16 engines run the AVX2 family's op
            # on rows converted to fp32 (the reference's numbers: the same rounding of x,
            # fp32 sums rounded once to bf16)
            from minivllm.kernels import get_avx2_kernels

            avx2 = get_avx2_kernels()
            fp32_op = None if avx2 is None else avx2.linear_quantw
        if fp32_op is not None and self.requested_backend != "torch":
            self.fp32_op, self.op = fp32_op, None
            fp32_engine = kernels.key is not None and kernels.key.dtype == torch.float32
            if fp32_vnni and fp32_engine and kernel_limits.fp32_vnni_takes(qw):
                self.fp32_vnni_op = kernels.op("vnni_w8a8_linear")
            self.backend = "cpu_kernel"
            return
        op = kernels.op("quant_linear")
        self.kernel_op = op
        usable = (
            op is not None
            and kernel_limits.kernel_supports(qw.scheme)
            and kernel_limits.kernel_supports_shape(qw.scheme, qw.in_features, qw.group_size)
        )
        wanted = self.requested_backend
        if wanted == "cpu_kernel" and not usable:
            raise ValueError(
                f"linear_backend_per_quant asks for cpu_kernel for {qw.scheme}, but "
                + _why_not(op, qw)
            )
        self.op = op if usable and wanted != "torch" else None
        self.dequantize_op = kernels.op("dequantize_bf16") if self.op is not None else None
        self.dequantized_op = kernels.op("dequantized_linear") if self.op is not None else None
        self.amx_op, self.amx_rows = None, 0
        amx, amx_op = kernels.op("amx_bf16_available"), kernels.op("amx_weight_only_linear")
        takes = amx_op is not None and kernel_limits.amx_weight_only_takes(qw)
        if self.op is not None and takes and amx is not None and amx():
            self.amx_op = amx_op
            self.amx_rows = kernel_limits.AMX_WEIGHT_ONLY_MAX_ROWS
        self.backend = "cpu_kernel" if self.op is not None else "torch"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qw = self.quant_weights
        assert qw is not None, "process_weights_after_loading has not run"
        rows = x.reshape(-1, x.shape[-1])
        if self.fp32_op is not None and x.dtype == torch.float32:
            return self._apply_fp32(rows, qw, bias).view(*x.shape[:-1], qw.out_features)
        if self.fp32_op is not None:  # a bf16 engine borrowing the AVX2 op (above)
            out = self._apply_fp32(rows.float(), qw, None if bias is None else bias.float())
            return out.to(x.dtype).view(*x.shape[:-1], qw.out_features)
        if self.op is None or x.dtype != torch.bfloat16:
            return formats.reference_linear(x, packing.with_rows(qw, qw.packed), bias)
        if qw.scheme == "int4_w4a8":  # every batch on the panels (int4_w4a8.cpp)
            out = self.packed_op(rows, qw.packed, qw.out_features, qw.group_size, bias)
        elif rows.shape[0] <= self.kernel_rows and qw.has_rows:  # (rowless: even 0 rows)
            out = self.op(rows, qw.kind, qw.weight, qw.scale, qw.zero, qw.wsum, qw.group_size, bias)
        elif qw.scheme == "int8_w8a8":
            out = self.packed_op(rows, qw.packed, qw.in_features, qw.scale, qw.wsum, bias)
        elif rows.shape[0] <= self.amx_rows:  # amx_op: weight-only schemes on AMX-BF16
            out = self.amx_op(rows, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, bias)
        elif rows.shape[0] <= self.dequantized_rows and self.dequantized_op is not None:
            out = self.dequantized_op(
                rows, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, bias
            )
        else:
            out = F.linear(rows, self._dequantized(qw), bias)
        return out.view(*x.shape[:-1], qw.out_features)

    def _apply_fp32(
        self, rows: torch.Tensor, qw: formats.QuantWeights, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The AVX2 family's op in an fp32 engine. int8_w8a8 runs its VNNI GEMM where the
        CPU has AVX512-VNNI; without it there is no int8 arithmetic (AVX2 has no VNNI): the
        activations are quantized per token as the scheme says, and the integers multiplied
        in fp32, which holds their products and (below 2^24) their sums exactly:
        y = ((xq q^T) * xs[m]) * scale[n] (+ bias), the reference's numbers either way."""
        if qw.scheme != "int8_w8a8":
            return self.fp32_op(rows, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, bias)
        if self.fp32_vnni_op is not None:  # every batch, on the panels (AVX512-VNNI)
            return self.fp32_vnni_op(rows, qw.packed, qw.in_features, qw.scale, qw.wsum, bias)
        xq, xs = formats.quantize_per_token(rows)
        if self._unit_scale is None or self._unit_scale.numel() != qw.out_features:
            self._unit_scale = torch.ones(qw.out_features)
        # the same int8 rows read as weight-only with scale 1: the integer sums come out
        # exact (below 2^24), then scaled in the reference's order, (acc * xs) * scale
        kind = formats.KIND_INT8_W8A16
        acc = self.fp32_op(xq.to(torch.float32), kind, qw.weight, self._unit_scale, None, 0, None)
        out = acc.mul_(xs[:, None]).mul_(qw.scale)
        return out if bias is None else out.add_(bias)

    def _dequantized(self, qw: formats.QuantWeights) -> torch.Tensor:
        """qw's weight in bf16, `formats.dequantize(qw).to(bf16)` bit for bit. A fresh
        buffer each call costs no page faults: CPU runners keep freed memory in the heap
        (`utils.memory.keep_freed_host_memory`)."""
        out = torch.empty(qw.out_features, qw.in_features, dtype=torch.bfloat16)
        self.dequantize_op(qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, out)
        return out

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: the lookup of a quantized embedding table."""
        qw = self.quant_weights
        assert qw is not None
        flat = ids.reshape(-1)
        picked = formats.QuantWeights(
            qw.scheme,
            qw.weight[flat],
            qw.scale[flat],
            None if qw.zero is None else qw.zero[flat],
            None,
            qw.group_size,
            flat.numel(),
            qw.in_features,
        )
        rows = formats.dequantize(picked).to(self.dtype)
        return rows.view(*ids.shape, qw.in_features)


def processed_shapes(
    spec: SchemeSpec, n: int, k: int, fp8_group: int = 0
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of each tensor `formats.quantize` makes for an [n, k] weight in
    `spec` (`fp8_group`: block-scaled fp8's k per scale, 0 per channel)."""
    groups = k // spec.group_size
    if spec.scheme in formats.INT4_SCHEMES:
        return {
            "weight": ((n, k // 2), torch.uint8),
            "scale": ((n, groups), torch.float32),
            **({} if spec.symmetric else {"zero": ((n, groups), torch.float32)}),
        }
    return {
        "int8_w8a16": {"weight": ((n, k), torch.int8), "scale": ((n,), torch.float32)},
        "int8_w8a8": {
            "weight": ((n, k), torch.int8),
            "scale": ((n,), torch.float32),
            "wsum": ((n,), torch.int32),
        },
        "fp8_w8a16": {
            "weight": ((n, k), torch.uint8),
            "scale": ((n, k // fp8_group) if fp8_group else (n,), torch.float32),
        },
    }[spec.scheme]


def log_backends(modules: list[nn.Module]) -> None:
    """One log line per scheme and op: which kernel runs the quantized layers, and whether
    linear_backend_per_quant asked for it or it is this CPU's default. A default that fell
    to the plain-PyTorch reference (it dequantizes the whole weight at every call) is a
    warning that says why."""
    from minivllm.quantization.moe_method import QuantizedMoEMethod  # it imports this module

    counts: dict[tuple[str, str, bool], list] = {}  # linear and routed-experts methods
    for module in modules:
        method = getattr(module, "quant_method", None)
        quantized = isinstance(method, (QuantizedLinearMethod, QuantizedMoEMethod))
        if quantized and method.quant_weights is not None:
            key = (method.spec.scheme, method.op_name, method.requested_backend is not None)
            counts.setdefault(key, []).append(method)
    for (scheme, op, asked), methods in sorted(counts.items()):
        how = "as linear_backend_per_quant asks" if asked else "this CPU's default"
        if op.startswith("torch") and not asked:
            qw = methods[0].quant_weights
            logger.warning(
                "%s: %d layers on %s, %s: %s",
                scheme,
                len(methods),
                op,
                how,
                _why_not(methods[0].kernel_op, qw),
            )
        else:
            logger.info("%s: %d layers on %s, %s", scheme, len(methods), op, how)


def _why_not(op: object, qw: formats.QuantWeights) -> str:
    if op is None:
        return (
            "the engine has no compiled kernels for its dtype here (kernels off; a CPU "
            "without AVX2 + FMA for float32, without AVX512-BF16 for bfloat16)"
        )
    if not kernel_limits.kernel_supports(qw.scheme):
        return "this CPU lacks the instructions it needs (int8_w8a8, int4_w4a8: AVX512-VNNI)"
    return (
        f"the layer's shape (input {qw.in_features}, group {qw.group_size}) is not one the "
        "kernel takes (input a multiple of 32; int4 groups of a multiple of 32; fp8 per "
        "channel or in blocks of a multiple of 64 k dividing the input, other blocks on "
        "the AVX2 op)"
    )
