"""Routed experts the checkpoint stores quantized (DeepSeek's fp8 releases, compressed-
tensors checkpoints): loaded expert by expert into the stacks `QuantizedMoEMethod` runs
(`moe_method.py`), the checkpoint's values and scales as they are, never re-quantized."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.registry import Kernels
from minivllm.quantization import formats
from minivllm.quantization.moe_method import PARTS, QuantizedMoEMethod


class CheckpointMoEMethod(QuantizedMoEMethod):
    """Routed experts the checkpoint stores quantized, one tensor per expert and projection
    (`experts.7.up_proj.weight`, `...weight_scale_inv`): DeepSeek's fp8 releases
    (transformers' fp8 format, 128 x 128 block scales) and compressed-tensors checkpoints
    (int8 per channel, int4 groups packed or not, fp8 per channel, tensor or block).

    The model's loader hands each expert tensor to `load_expert_tensor`, which brings it
    to rows (a per-tensor or block scale repeated down the rows, packed words unpacked),
    cuts this rank's part (gate and up: rows of the intermediate dimension; down: its
    columns, and their groups), and writes it into a stack [E, rows, k] (int4 values
    unpacked to a byte each until the end of loading). After loading, each expert becomes
    the scheme's tensors as `formats.from_*_values` build them for a pre-quantized linear
    (the checkpoint's values and scales, never re-quantized), written into the final
    stacks one expert at a time."""

    def __init__(self, stored, backend: str | None = None) -> None:
        super().__init__(stored.spec, backend, stored.format)
        self.stored = stored
        self.block = stored.block
        self.device = torch.device("cpu")
        self._stacks: dict[str, dict[str, torch.Tensor]] = {}
        self._seen: set[tuple[str, int, str, str]] = set()

    @property
    def group(self) -> int:
        """k per scale column: int4's group, block fp8's block k, else 0 (per channel)."""
        if self.block is not None:
            return self.block[1]
        return super().group

    @property
    def asymmetric(self) -> bool:
        return self.spec.scheme in formats.INT4_SCHEMES and not self.spec.symmetric

    @property
    def bits(self) -> int:
        return 4 if self.spec.scheme in formats.INT4_SCHEMES else 8

    def checkpoint_suffix(self, key: str) -> str:
        """The checkpoint's name for a stack: its values, scale or zero point."""
        if key == "values":
            return "weight_packed" if self.stored.format == "pack-quantized" else "weight"
        return self.stored.scale_name if key == "scale" else "weight_zero_point"

    def create_weights(self, layer: nn.Module, name: str) -> None:
        """Drop w13 and w2: the checkpoint format's stacks replace them as tensors arrive
        (`_stack`; never allocated where the weight cache maps the processed tensors)."""
        self.check_shape(layer, name)
        self.device = layer.w13.device
        for part in PARTS:
            delattr(layer, part)

    def _stack(self, layer: nn.Module, part: str) -> dict[str, torch.Tensor]:
        """The part's values [E, rows, k], scales [E, rows, k / group or 1] (NaN until
        loaded) and int4 zero points, allocated at its first tensor."""
        if part not in self._stacks:
            n, k = self.shapes(layer)[part]
            e, group = layer.num_experts, self.group
            integer = self.spec.scheme != "fp8_w8a16"
            cols = k // group if group else 1
            options = dict(device=self.device)
            self._stacks[part] = {
                "values": torch.zeros(
                    e, n // e, k, dtype=torch.int8 if integer else torch.uint8, **options
                ),
                "scale": torch.full((e, n // e, cols), float("nan"), **options),
            }
            if self.asymmetric:
                self._stacks[part]["zero"] = torch.zeros(
                    e, n // e, cols, dtype=torch.int8, **options
                )
        return self._stacks[part]

    def load_expert_tensor(
        self, layer: nn.Module, name: str, expert: int, proj: str, suffix: str, tensor
    ) -> None:
        """Checkpoint tensor `name`: expert `expert`'s `proj` (gate_proj, up_proj,
        down_proj) `suffix` (weight, weight_packed, weight_scale, ...)."""
        from minivllm.quantization.ct_method import _scale_values, unpack_int32

        part = "w2" if proj == "down_proj" else "w13"
        inter, hidden = layer.intermediate * layer.tp_size, layer.hidden_size
        full_rows, full_k = (hidden, inter) if part == "w2" else (inter, hidden)
        group = self.group
        if suffix in ("input_scale", "activation_scale"):
            return  # static activation scales: read, not used (weight-only)
        if suffix == "weight_shape":
            if tensor.tolist() != [full_rows, full_k]:
                raise ValueError(
                    f"{name} is {tensor.tolist()}; the model's expert {proj} is "
                    f"[{full_rows}, {full_k}]"
                )
            return
        if suffix == self.checkpoint_suffix("values"):
            key = "values"
            if tensor.dtype == torch.int32 and self.stored.format == "pack-quantized":
                words = -(-full_k * self.bits // 32)
                _expect_shape(name, tensor, (full_rows, words))
                tensor = unpack_int32(tensor, self.bits, full_k)
            elif tensor.dtype == torch.float8_e4m3fn and self.spec.scheme == "fp8_w8a16":
                tensor = tensor.view(torch.uint8)
            elif tensor.dtype != self._stack(layer, part)["values"].dtype:
                want = "float8_e4m3fn" if self.spec.scheme == "fp8_w8a16" else "int8"
                raise ValueError(
                    f"{name} is {tensor.dtype}; the checkpoint's {self.stored} stores {want}"
                )
            value = tensor
        elif suffix == self.stored.scale_name or (
            # a per-tensor fp8 scale goes by either name (vLLM's and transformers')
            self.stored.per_tensor and suffix in ("weight_scale", "weight_scale_inv")
        ):
            key, value = "scale", _scale_values(tensor)
            if self.stored.per_tensor:
                if value.numel() != 1:
                    raise ValueError(
                        f"{name}: a per-tensor scale holds one value, got {tuple(value.shape)}"
                    )
                value = value.reshape(1, 1).expand(full_rows, 1)
            elif self.block is not None:
                rows, cols = self.block
                expected = (-(-full_rows // rows), -(-full_k // cols))
                if tuple(value.shape) != expected:
                    raise ValueError(
                        f"{name}: block scales of a [{full_rows}, {full_k}] weight in {rows} x "
                        f"{cols} blocks have shape {list(expected)}, got {list(value.shape)}"
                    )
                value = value.repeat_interleave(rows, dim=0)[:full_rows]
        elif suffix == "weight_zero_point" and self.asymmetric:
            key = "zero"
            if tensor.dtype not in (torch.int8, torch.int32):
                raise ValueError(f"{name} is {tensor.dtype}; zero points are int8 or packed int32")
            if tensor.dtype == torch.int32:  # packed down the rows
                _expect_shape(name, tensor, (-(-full_rows * self.bits // 32), full_k // group))
                tensor = unpack_int32(tensor.t().contiguous(), self.bits, full_rows)
                tensor = tensor.t().contiguous()
            value = tensor
        else:
            raise ValueError(f"unexpected routed-expert tensor {name} for {self.stored}")
        columns = full_k if key == "values" else (full_k // group if group else 1)
        _expect_shape(name, value, (full_rows, columns))
        stack = self._stack(layer, part)
        size, start = layer.intermediate, layer.tp_rank * layer.intermediate
        if part == "w2":  # this rank's columns of k (and their groups; a per-row scale whole)
            if key == "values":
                value = value.narrow(1, start, size)
            elif group:
                value = value.narrow(1, start // group, size // group)
            stack[key][expert].copy_(value)
        else:
            offset = 0 if proj == "gate_proj" else size
            stack[key][expert, offset : offset + size].copy_(value.narrow(0, start, size))
        self._seen.add((part, expert, proj, key))

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        keys = ["values", "scale", *(["zero"] if self.asymmetric else [])]
        missing = [
            f"{self.prefix}.{e}.{proj}.{self.checkpoint_suffix(key)}"
            for e in range(layer.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
            for key in keys
            if ("w2" if proj == "down_proj" else "w13", e, proj, key) not in self._seen
        ]
        if missing:
            raise ValueError(
                f"the checkpoint lacks routed-expert tensors: {missing[0]}"
                + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        for part, (n, k) in self.shapes(layer).items():
            stack = self._stacks.pop(part)
            stacks = self._build_stacks(
                layer.num_experts,
                n,
                k,
                self.device,
                lambda e, s=stack, p=part: self._expert(s, e, p),
            )
            self._register(layer, part, stacks)
        self._use(layer, kernels, built=True)

    def _expert(self, stack: dict[str, torch.Tensor], e: int, part: str) -> formats.QuantWeights:
        """Expert e's stacked checkpoint values as the scheme's tensors."""
        try:
            return self._convert(stack, e)
        except ValueError as exc:
            raise ValueError(f"{self.prefix}.{e} ({part}): {exc}") from None

    def _convert(self, stack: dict[str, torch.Tensor], e: int) -> formats.QuantWeights:
        values, scale = stack["values"][e], stack["scale"][e]
        scheme = self.spec.scheme
        if scheme == "fp8_w8a16":
            return formats.from_fp8_values(values, scale if self.group else scale[:, 0], self.group)
        if scheme in formats.INT4_SCHEMES:  # signed [-8, 7] here, unsigned [0, 15] there
            zero = stack.get("zero")
            return formats.from_int4_values(
                (values.to(torch.int16) + 8).to(torch.uint8),
                scale,
                None if zero is None else zero[e].to(torch.float32) + 8,
                self.spec.group_size,
                scheme,
            )
        return formats.from_int8_values(values, scale[:, 0], scheme)


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(tensor.shape)}; expected {list(shape)}")
