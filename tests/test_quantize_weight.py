"""The compiled weight quantizer (kernels/quantize_weight.cpp) against formats.quantize's
torch ops: every tensor bit for bit, over random weights and the cases where rounding and
ranges are decided (ties at .5, zero rows and groups, one-signed groups, -128's neighbours)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.quantization import formats
from minivllm.utils import huge_pages

kernels = get_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no AVX512-BF16 kernels on this CPU")

INT4 = [("int4_w4a16", True), ("int4_w4a16", False), ("int4_w4a8", True), ("int4_w4a8", False)]


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    w[0] = 0  # a zero row: scale 1
    if n > 2:
        w[1] = w[1].abs()  # one-signed rows: an asymmetric range ends at 0
        w[2] = -w[2].abs()
    if n > 3:
        w[3, : k // 2] = 0  # zero groups beside live ones
    return w.bfloat16()


def _ties(n: int, k: int, qmax: int) -> torch.Tensor:
    """Rows whose quotients w / scale land on halves: the largest |w| is qmax * 2^-e, so
    the scale is exactly 2^-e and every (m + 0.5) * 2^-e divides to a tie."""
    gen = torch.Generator().manual_seed(n * k)
    halves = torch.randint(-2 * qmax, 2 * qmax + 1, (n, k), generator=gen).float() / 2
    halves[:, ::16] = qmax  # every group holds the largest value
    exponent = torch.randint(-8, 4, (n, 1), generator=gen).float()
    return (halves * torch.exp2(exponent)).bfloat16()


def _fp8_edges(n: int, k: int) -> torch.Tensor:
    """Rows whose quotients reach e4m3's edges: its subnormals (multiples of 2^-9 below
    2^-6) and their ties, the smallest normal, ties between normals, and 448."""
    gen = torch.Generator().manual_seed(n + 7 * k)
    mags = torch.exp2(torch.randint(-11, 9, (n, k), generator=gen).float())
    mags = mags * (1 + torch.randint(0, 16, (n, k), generator=gen).float() / 16)
    signs = torch.randint(0, 2, (n, k), generator=gen).float() * 2 - 1
    w = (mags * signs).clamp(-448, 448)
    w[:, 0] = 448  # scale 1: the quotients are the values themselves
    return w.bfloat16()


def _assert_same(got: formats.QuantWeights, want: formats.QuantWeights) -> None:
    assert got.scheme == want.scheme and got.group_size == want.group_size
    assert got.tensors().keys() == want.tensors().keys()
    for name, tensor in want.tensors().items():
        assert got.tensors()[name].dtype == tensor.dtype, name
        assert torch.equal(got.tensors()[name], tensor), name


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int8_w8a8", "fp8_w8a16"])
@pytest.mark.parametrize(("n", "k"), [(1, 16), (7, 48), (64, 1024), (300, 2560)])
def test_per_channel_schemes_match_the_torch_ops(scheme, n, k) -> None:
    for w in (_weights(n, k, n + k), _ties(n, k, 127), _fp8_edges(n, k)):
        want = formats.quantize(w, scheme)
        got = formats.quantize(w, scheme, kernel=kernels.quantize_weight)
        _assert_same(got, want)


@pytest.mark.parametrize(("scheme", "symmetric"), INT4)
@pytest.mark.parametrize(
    ("n", "k", "group"), [(1, 32, 32), (9, 96, 32), (64, 1024, 128), (130, 2560, 64)]
)
def test_int4_matches_the_torch_ops(scheme, symmetric, n, k, group) -> None:
    qmax = 7 if symmetric else 15
    for w in (_weights(n, k, n * k), _ties(n, k, qmax)):
        want = formats.quantize(w, scheme, group, symmetric)
        got = formats.quantize(w, scheme, group, symmetric, kernel=kernels.quantize_weight)
        _assert_same(got, want)


def test_the_kernel_path_is_taken_and_fills_the_given_tensors() -> None:
    """Results land in `empty`'s tensors (the huge-page arena's at load); weights the kernel
    does not take (float32, K not a multiple of 16, fp8) go to the torch ops."""
    calls = []

    def counting(*args):
        calls.append(args[1])
        kernels.quantize_weight(*args)

    arena = huge_pages.HugePageArena()
    w = _weights(40, 256, 3)
    got = formats.quantize(w, "int4_w4a16", 64, False, empty=arena.empty, kernel=counting)
    assert calls == [2]
    if huge_pages.enabled():
        assert all(arena.copy(t) is t for t in got.tensors().values())
    for weight, scheme, group in [
        (w.float(), "int8_w8a16", 0),
        (_weights(4, 40, 1), "int8_w8a16", 0),
        (w.float(), "int4_w4a16", 64),
        (w.float(), "fp8_w8a16", 0),
    ]:
        formats.quantize(weight, scheme, group or 128, True, kernel=counting)
    assert calls == [2]


@pytest.mark.parametrize(
    ("scheme", "symmetric"), [("int8_w8a16", True), ("int8_w8a8", True), ("fp8_w8a16", True), *INT4]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("compiled", [True, False])
def test_nan_or_infinite_weights_are_refused(scheme, symmetric, bad, compiled) -> None:
    w = _weights(8, 128, 5)
    w[5, 77] = bad
    kernel = kernels.quantize_weight if compiled else None
    with pytest.raises(ValueError, match="NaN"):
        formats.quantize(w, scheme, 32, symmetric, kernel=kernel)


def test_an_engine_quantizes_with_the_kernel(qwen3_dir, monkeypatch) -> None:
    from minivllm import LLM

    seen = []
    quantize = formats.quantize

    def recording(*args, **kwargs):
        seen.append(kwargs.get("kernel") or (args[5] if len(args) > 5 else None))
        return quantize(*args, **kwargs)

    monkeypatch.setattr(formats, "quantize", recording)
    LLM(
        str(qwen3_dir),
        dtype="bfloat16",
        quantization="int4",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        quantization_config={"group_size": 32},
    )
    assert seen and all(k is not None for k in seen)
