"""utils/huge_pages.py: quantized weights copied onto huge pages, read back from
/proc/self/smaps."""

import sys

import pytest
import torch
from torch import nn

from minivllm.kernels.registry import TORCH
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


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() == "never",
    reason="transparent huge pages are off on this machine",
)


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that overlap `t`'s memory."""
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
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
def test_arena_copies_land_on_huge_pages_packed_and_aligned():
    arena = huge_pages.HugePageArena(chunk_bytes=16 << 20)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (3 << 20, 1000, 5 << 20)]
    sources.append(torch.randn(1 << 20))  # 4 MiB of float32: the next chunk
    copies = [arena.copy(s) for s in sources]
    for s, c in zip(sources, copies):
        assert torch.equal(s, c) and c.data_ptr() != s.data_ptr()
        assert c.data_ptr() % huge_pages.ALIGN == 0
    # one after another in the first chunk, then a new one
    assert copies[1].data_ptr() == copies[0].data_ptr() + (3 << 20)
    assert copies[2].data_ptr() == copies[1].data_ptr() + 1024  # 1000 rounded up to 64
    assert arena.bytes_placed == sum(s.numel() * s.element_size() for s in sources)
    assert huge_kib(copies[0]) >= 2 << 10 and huge_kib(copies[2]) >= 4 << 10


@needs_thp
def test_a_tensor_over_a_chunk_gets_its_own_mapping():
    arena = huge_pages.HugePageArena(chunk_bytes=2 << 20)
    big = torch.randn(3 << 20)  # 12 MiB
    copy = arena.copy(big)
    assert torch.equal(big, copy) and huge_kib(copy) >= 10 << 10


def test_opting_out_or_other_devices_keep_the_tensor(monkeypatch):
    t = torch.randn(1000)
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    assert huge_pages.HugePageArena().copy(t) is t
    monkeypatch.delenv(huge_pages.HUGE_PAGES_ENV)
    assert huge_pages.HugePageArena().copy(torch.empty(0)).numel() == 0


@pytest.mark.skipif(not huge_pages.enabled(), reason="huge pages are off here")
def test_quantized_layers_install_their_weights_from_the_arena():
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(64, 256), requires_grad=False)
    method = QuantizedLinearMethod(SchemeSpec("int4_w4a16"))
    qw = formats.quantize(layer.weight.data, "int4_w4a16")
    before = huge_pages.weights_arena().bytes_placed
    method.install(layer, qw, TORCH)
    placed = method.quant_weights
    assert huge_pages.weights_arena().bytes_placed - before == sum(
        t.numel() * t.element_size() for t in qw.tensors().values()
    )
    assert placed.weight.data_ptr() != qw.weight.data_ptr()
    assert torch.equal(placed.weight, qw.weight) and torch.equal(placed.scale, qw.scale)
    assert layer.weight.data_ptr() == placed.weight.data_ptr()  # the layer holds the copy
    x = torch.randn(3, 256)
    assert torch.equal(formats.reference_linear(x, placed), formats.reference_linear(x, qw))


@needs_thp
def test_full_precision_weights_fill_huge_pages_but_not_past_their_end(monkeypatch):
    """own_mapping_empty (a linear weight as the checkpoint fills it): whole 2 MiB pages of
    it are huge pages; its partial last one is not (it would fault in memory past the end);
    small weights and MINIVLLM_HUGE_PAGES=0 keep small pages."""
    from minivllm.utils.memory import own_mapping_empty

    t = own_mapping_empty((5 << 20,), torch.uint8)  # 2.5 huge pages
    t.fill_(1)
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert 2 << 10 <= huge_kib(t) <= 4 << 10  # the two whole pages (where THP gives them), no third
    small = own_mapping_empty((1 << 20,), torch.uint8)
    small.fill_(1)
    assert huge_kib(small) == 0
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    off = own_mapping_empty((4 << 20,), torch.uint8)
    off.fill_(1)
    assert huge_kib(off) == 0
