"""utils/huge_pages.py: the pages under large host tensors, read back from /proc/self/smaps."""

import platform
import sys

import pytest
import torch
from torch import nn

from minivllm.quantization import formats
from minivllm.quantization.config import SchemeSpec
from minivllm.quantization.method import QuantizedLinearMethod
from minivllm.utils import huge_pages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        parts = platform.release().split(".")
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (ValueError, IndexError):
        return False


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() == "never",
    reason="transparent huge pages are off on this machine",
)
needs_collapse = pytest.mark.skipif(
    not _kernel_at_least(6, 1), reason="MADV_COLLAPSE needs Linux 6.1"
)


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that overlap `t`'s memory."""
    begin = t.untyped_storage().data_ptr()
    end = begin + t.untyped_storage().nbytes()
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                overlaps = lo < end and hi > begin
            elif head == "AnonHugePages:" and overlaps:
                total += int(line.split()[1])
    return total


@needs_thp
@needs_collapse
def test_collapse_moves_written_tensors_onto_huge_pages_and_keeps_them():
    tensors = [torch.randn(3 << 20) for _ in range(3)]  # 12 MiB each, written
    copies = [t.clone() for t in tensors]
    moved = huge_pages.collapse(tensors, "test tensors")
    # each tensor's 2 MiB-aligned interior: at least 10 of its 12 MiB
    assert moved >= 3 * (10 << 20)
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c)
        assert huge_kib(t) >= 10 << 10


@needs_thp
def test_advised_tensor_faults_in_huge_pages_on_first_write():
    t = huge_pages.advise(torch.empty(16 << 20, dtype=torch.uint8))
    t.fill_(7)
    assert huge_kib(t) >= 14 << 10
    assert int(t.sum()) == 7 * (16 << 20)


def test_opting_out_leaves_pages_alone(monkeypatch):
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    t = torch.randn(3 << 20)
    assert huge_pages.collapse([t], "test") == 0
    assert huge_pages.advise(t) is t


def test_small_tensors_and_repeats_are_skipped():
    small = torch.randn(1000)
    assert huge_pages._interior(small) is None
    big = torch.randn(3 << 20)
    view = big[10:]
    assert huge_pages._interior(view) == huge_pages._interior(big)  # one storage, one advice


def test_module_tensors_include_what_quantized_methods_hold():
    layer = nn.Module()
    layer.norm = nn.Parameter(torch.ones(8))
    method = QuantizedLinearMethod(SchemeSpec("int4_w4a16"))
    method.quant_weights = formats.quantize(torch.randn(64, 256), "int4_w4a16")
    layer.quant_method = method
    found = {id(t) for t in huge_pages.module_tensors(layer)}
    qw = method.quant_weights
    assert {id(layer.norm), id(qw.weight), id(qw.scale)} <= found
