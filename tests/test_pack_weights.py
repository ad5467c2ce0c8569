"""kernels/pack_weights.cpp: the compiled packers of int8_w8a8's VNNI panels and AMX tiles and
int4_w4a8's VNNI panels, byte for byte the torch functions of quantization/packing.py (the
oracle), on shapes with partial panels, blocks and k-blocks; and an engine's load packs
with them."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.quantization import formats, packing

kernels = get_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no AVX512-BF16 kernels on this CPU")


def _int8(n: int, k: int) -> formats.QuantWeights:
    q = torch.randint(
        -128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n + k)
    )
    return formats.from_int8_values(q, torch.rand(n) + 0.1, "int8_w8a8")


def _ops(name: str):
    return lambda op: getattr(kernels, op) if op == name else None


@pytest.mark.parametrize(("n", "k"), [(1, 4), (31, 64), (32, 1024), (75, 2560), (40, 100)])
@pytest.mark.parametrize("layout", ["vnni", "amx"])
def test_int8_w8a8_packings_match_the_torch_ones(layout, n, k) -> None:
    """K = 100 leaves the AMX layout a partial k-block (zeros past K), n = 75 and 1 partial
    blocks of rows (zeros past N)."""
    qw = _int8(n, k)
    op = packing.PACK_OPS[layout]
    packing.prepack(qw, layout, kernels=_ops(op))
    torch_pack = packing.pack_amx_w8a8 if layout == "amx" else packing.pack_vnni_w8a8
    assert torch.equal(qw.packed, torch_pack(qw.weight))


@pytest.mark.parametrize(
    ("n", "k", "group"), [(1, 32, 32), (16, 128, 64), (37, 256, 128), (70, 96, 32)]
)
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_w4a8_packing_matches_the_torch_one(n, k, group, symmetric) -> None:
    """The nibbles of 16 rows per 8 k, then the scales and zero points (8 where symmetric,
    zeros past N) as float32 [groups, 16] per panel."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)).bfloat16()
    qw = formats.quantize(w, "int4_w4a8", group, symmetric)
    assert (qw.zero is None) == symmetric
    packing.prepack(qw, "w4a8", kernels=_ops("pack_vnni_w4a8"))
    assert torch.equal(qw.packed, packing.pack_vnni_w4a8(qw))
    assert torch.equal(packing.rows_of_vnni_w4a8(qw.packed, qw), qw.weight)


def test_the_packers_refuse_mismatched_outputs() -> None:
    qw = _int8(40, 128)
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        kernels.pack_amx_w8a8(qw.weight, torch.empty(2, 2, 2, 16, 63, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="K % 4 == 0"):
        kernels.pack_amx_w8a8(
            qw.weight[:, :126].contiguous(), torch.empty(2, 2, 2, 16, 64, dtype=torch.int8)
        )
    q4 = formats.quantize(torch.randn(20, 64).bfloat16(), "int4_w4a8", 32, True)
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.pack_vnni_w4a8(
            q4.weight,
            q4.scale[:, :1].contiguous(),
            None,
            32,
            torch.empty(2, 640, dtype=torch.uint8),
        )


@pytest.mark.parametrize("scheme", ["int8_w8a8", "int4_w4a8"])
def test_an_engine_packs_with_the_kernels(qwen3_dir, monkeypatch, scheme) -> None:
    """Every prepacked layer of a loaded engine was packed by the compiled op, and its copy
    equals the torch packing of its rows."""
    from minivllm import LLM

    calls: list[str] = []
    prepack = packing.prepack
    torch_packings = {
        "amx": lambda qw: packing.pack_amx_w8a8(qw.weight),
        "vnni": lambda qw: packing.pack_vnni_w8a8(qw.weight),
        "w4a8": packing.pack_vnni_w4a8,
    }

    def recording(qw, layout, *args, **kwargs):
        ops = kwargs.get("kernels") or (args[2] if len(args) > 2 else None)
        assert ops is not None and ops(packing.PACK_OPS[layout]) is not None
        calls.append(layout)
        prepack(qw, layout, *args, **kwargs)
        assert torch.equal(qw.packed, torch_packings[layout](qw))

    monkeypatch.setattr(packing, "prepack", recording)
    LLM(
        str(qwen3_dir),
        dtype="bfloat16",
        quantization=scheme,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        **({"quantization_config": {"group_size": 32}} if scheme == "int4_w4a8" else {}),
    )
    assert calls
