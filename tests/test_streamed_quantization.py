"""Online quantization layer by layer while the checkpoint loads (loader/streamed_quantization.py).

Two oracles: the same engine with every layer processed after the whole checkpoint is in
(the path a tied head and checkpoint-quantized layers still take) must hold the very same
tensors and give the same logprobs; and the process's anonymous memory when the last
streamed layer is done must be well under the full-precision weights it loaded, where
the load-then-quantize path holds all of them (so the measure can fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.loader import model_loader, streamed_quantization
from minivllm.utils import huge_pages

REPO = Path(__file__).resolve().parents[1]
TARGETS = {
    "targets": {
        "re:.*mlp\\.": {"scheme": "int4_w4a16", "group_size": 32},
        "re:.*self_attn\\.qkv_proj": "int8_w8a8",
        "re:.*self_attn\\.o_proj": {"scheme": "int4_w4a8", "group_size": 32},
        "lm_head": "int8",
    }
}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [300, 2, 64, 64, 9]]


def _at_the_end(monkeypatch) -> None:
    """StreamedQuantization switched off: every layer is processed after the load."""
    monkeypatch.setattr(streamed_quantization, "streamable", lambda module, shared: False)
    monkeypatch.setattr(streamed_quantization, "streamable_experts", lambda module: False)


def _engine(model_dir, dtype: str) -> LLM:
    return LLM(
        str(model_dir),
        dtype=dtype,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        quantization="online",
        quantization_config=TARGETS,
    )


def _tensors(llm: LLM) -> dict[str, torch.Tensor]:
    model = llm.llm_engine.executor.runner.model
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _count_tensors_read(monkeypatch) -> list[int]:
    """[tensors the checkpoint reader has yielded so far], kept current during the load."""
    yielded = [0]
    iterate = model_loader.iterate_weights

    def counting(path):
        for item in iterate(path):
            yielded[0] += 1
            yield item

    monkeypatch.setattr(model_loader, "iterate_weights", counting)
    return yielded


def _assert_same_engines(streamed: LLM, at_the_end: LLM, params: SamplingParams) -> None:
    got, want = _tensors(streamed), _tensors(at_the_end)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    a = streamed.generate(prompts, params, use_tqdm=False)
    b = at_the_end.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_streamed_layers_match_the_load_then_quantize_path(
    make_checkpoint, monkeypatch, dtype
) -> None:
    model_dir = make_checkpoint("LlamaForCausalLM", dtype=torch.bfloat16)  # untied head
    yielded, at_process = _count_tensors_read(monkeypatch), []
    process = streamed_quantization.StreamedQuantization.process

    def recording(self, module, param):
        process(self, module, param)
        assert param.numel() == 0  # the full-precision copy is gone at once
        at_process.append(yielded[0])

    monkeypatch.setattr(streamed_quantization.StreamedQuantization, "process", recording)
    streamed = _engine(model_dir, dtype)
    # 2 layers x (qkv, o, gate_up, down) and the head, each as soon as its last shard came
    assert len(at_process) == 9
    assert at_process == sorted(at_process) and at_process[0] < yielded[0] // 2
    _at_the_end(monkeypatch)
    at_the_end = _engine(model_dir, dtype)

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1)
    _assert_same_engines(streamed, at_the_end, params)


# Loads `model` with int4 everywhere but the head, and prints the anonymous memory (bytes)
# gained from just before the checkpoint is read to the moment its last streamed layer
# is processed, and the full-precision bytes of the streamed layers.
MEASURE = """
import json, sys, torch
from minivllm import LLM
from minivllm.loader import model_loader, streamed_quantization

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

seen = {"start": None, "last": None, "bytes": 0}
if sys.argv[2] == "end":
    streamed_quantization.streamable = lambda module, shared: False
    process_all = model_loader.process_weights_after_loading
    def at_end(model, *args, **kwargs):
        seen["last"] = anon()
        process_all(model, *args, **kwargs)
    model_loader.process_weights_after_loading = at_end
else:
    process = streamed_quantization.StreamedQuantization.process
    def recording(self, module, param):
        process(self, module, param)
        seen["last"] = anon()
    streamed_quantization.StreamedQuantization.process = recording
iterate = model_loader.iterate_weights
def measured(path):
    seen["start"] = anon()
    yield from iterate(path)
model_loader.iterate_weights = measured
llm = LLM(sys.argv[1], dtype="bfloat16", kv_cache_memory_bytes=8 << 20, max_model_len=64,
          quantization="int4", quantization_config={"group_size": 64})
model = llm.llm_engine.executor.runner.model
full = sum(m.output_size * m.input_size * 2 for n, m in model.named_modules()
           if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
print(json.dumps({"gained": seen["last"] - seen["start"], "full": full}))
"""


def _gained(model_dir: Path, mode: str) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(model_dir), mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[-1]
    got = json.loads(out)
    return got["gained"], got["full"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_load_never_holds_all_full_precision_weights(make_checkpoint) -> None:
    # 12 layers of hidden 512, intermediate 4096: ~160 MiB of bf16 linears
    model_dir = make_checkpoint(
        "Qwen3ForCausalLM",
        dtype=torch.bfloat16,
        hidden_size=512,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    streamed, full = _gained(model_dir, "streamed")
    at_the_end, _ = _gained(model_dir, "end")
    # int4 keeps ~0.27 of the bf16 bytes; the heap's churn is a few MiB
    assert at_the_end > 0.9 * full, (at_the_end, full)
    assert streamed < 0.5 * full, (streamed, full)


@pytest.mark.parametrize(
    "scheme", ["int8_w8a16", "int8_w8a8", "fp8_w8a16", "int4_w4a16", "int4_w4a8"]
)
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantizing_in_row_chunks_is_quantizing_whole(monkeypatch, scheme, symmetric) -> None:
    from minivllm.quantization import formats

    weight = torch.randn(301, 256, dtype=torch.bfloat16)  # 301 rows: a ragged last chunk
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK", 1 << 40)
    whole = formats.quantize(weight, scheme, 64, symmetric)
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK", 256 * 7)  # 7 rows a chunk
    chunked = formats.quantize(weight, scheme, 64, symmetric)
    arena = huge_pages.HugePageArena()
    in_arena = formats.quantize(weight, scheme, 64, symmetric, empty=arena.empty)
    for got in (chunked, in_arena):
        assert whole.tensors().keys() == got.tensors().keys()
        for name, tensor in whole.tensors().items():
            assert torch.equal(got.tensors()[name], tensor), name
    if huge_pages.enabled():  # made by the arena: its copy leaves them where they are
        assert all(arena.copy(t) is t for t in in_arena.tensors().values())
        assert all(arena.copy(t) is not t for t in chunked.tensors().values())


@pytest.mark.skipif(not huge_pages.enabled(), reason="no MADV_HUGEPAGE here")
def test_weight_only_layers_are_quantized_where_they_stay(make_checkpoint, monkeypatch) -> None:
    """A weight-only layer's rows and scales are quantized into the huge-page arena, not
    quantized elsewhere and copied there: the tied LM head (processed at the end, when the
    rest of the model is in) would otherwise be held twice at the load's peak."""
    from minivllm.quantization import formats

    copied = []
    copy = huge_pages.HugePageArena.copy

    def spying(self, tensor):
        out = copy(self, tensor)
        if out is not tensor:
            copied.append((tuple(tensor.shape), tensor.dtype))
        return out

    monkeypatch.setattr(huge_pages.HugePageArena, "copy", spying)
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK", 1 << 10)  # every layer in row chunks
    model_dir = make_checkpoint("Qwen3ForCausalLM", dtype=torch.bfloat16)  # tied head
    targets = {"*": {"scheme": "int4_w4a16", "group_size": 32}, "lm_head": "int8"}
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        quantization="online",
        quantization_config={"targets": targets},
    )
    model = llm.llm_engine.executor.runner.model
    assert type(model.lm_head.quant_method).__name__ == "QuantizedLinearMethod"
    assert model.lm_head.weight.dtype == torch.int8
    assert copied == []


def test_the_heap_is_trimmed_as_layers_stream(make_checkpoint, monkeypatch) -> None:
    """What quantizing freed in the heap goes back to the kernel every TRIM_EVERY_BYTES of
    processed checkpoint (here every layer), and once more before the end's processing."""
    trims, processed = [], []
    monkeypatch.setattr(streamed_quantization, "release_freed_host_memory", lambda: trims.append(1))
    monkeypatch.setattr(model_loader, "release_freed_host_memory", lambda: trims.append("end"))
    process = streamed_quantization.StreamedQuantization.process

    def recording(self, module, param):
        processed.append(module)
        process(self, module, param)

    monkeypatch.setattr(streamed_quantization.StreamedQuantization, "process", recording)
    monkeypatch.setattr(streamed_quantization, "TRIM_EVERY_BYTES", 1)
    model_dir = make_checkpoint("LlamaForCausalLM", dtype=torch.bfloat16)
    _engine(model_dir, "bfloat16")
    assert processed and trims.count(1) == len(processed)
    assert trims.count("end") == 2  # before the end's processing, and after it
    trims.clear()
    monkeypatch.setattr(streamed_quantization, "TRIM_EVERY_BYTES", 1 << 40)
    _engine(model_dir, "bfloat16")
    assert trims == ["end", "end"]


@pytest.mark.parametrize(
    ("scheme", "layout"), [("int8_w8a8", "amx"), ("int8_w8a8", "vnni"), ("int4_w4a8", "w4a8")]
)
def test_packing_in_row_chunks_is_packing_whole(monkeypatch, scheme, layout) -> None:
    from minivllm.quantization import formats, packing

    # 301 rows: a partial panel at the end; K 200 pads AMX's 64-k blocks
    k = 200 if layout != "w4a8" else 256
    qw = formats.quantize(torch.randn(301, k), scheme, 64, True)
    whole = (
        packing.pack_amx_w8a8(qw.weight)
        if layout == "amx"
        else (packing.pack_vnni_w8a8(qw.weight) if layout == "vnni" else packing.pack_vnni_w4a8(qw))
    )
    monkeypatch.setattr(packing, "PACK_CHUNK", 1)  # one panel of rows at a time
    packing.prepack(qw, layout)
    assert qw.packed.shape == packing.packed_shape(qw, layout)
    assert torch.equal(qw.packed, whole)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer_dir) -> Path:
    from tests.test_deepseek_v32 import build_dsa_checkpoint

    return build_dsa_checkpoint(tmp_path_factory.mktemp("moe-streamed"), tokenizer_dir)


@pytest.mark.parametrize(
    ("quantization", "options"),
    [
        ("int8", None),
        ("online", {"targets": {"re:.*mlp\\.experts$": {"scheme": "int4_w4a8", "group_size": 32}}}),
    ],
)
def test_streamed_experts_match_the_load_then_quantize_path(
    moe_dir, monkeypatch, quantization, options
) -> None:
    yielded, at_process = _count_tensors_read(monkeypatch), []
    process = streamed_quantization.StreamedQuantization.process_experts

    def recording(self, module):
        process(self, module)
        assert module.quant_method.stacked and "w13" not in dict(module.named_parameters())
        at_process.append(yielded[0])

    def engine() -> LLM:
        return LLM(
            str(moe_dir),
            dtype="bfloat16",
            max_model_len=128,
            kv_cache_memory_bytes=4 << 20,
            quantization=quantization,
            quantization_config=options,
        )

    monkeypatch.setattr(streamed_quantization.StreamedQuantization, "process_experts", recording)
    streamed = engine()
    assert len(at_process) == 2  # both MoE layers, each once its experts were in
    assert at_process[0] < yielded[0]
    _at_the_end(monkeypatch)
    at_the_end = engine()

    _assert_same_engines(
        streamed, at_the_end, SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    )


def test_a_weight_the_checkpoint_repeats_after_it_was_quantized_is_named(
    make_checkpoint, monkeypatch
) -> None:
    model_dir = make_checkpoint("LlamaForCausalLM", dtype=torch.bfloat16)
    iterate = model_loader.iterate_weights

    def repeating(path):
        for name, tensor in iterate(path):
            yield name, tensor
            if name == "model.layers.0.mlp.down_proj.weight":
                yield name, tensor  # a second shard file holding it again

    monkeypatch.setattr(model_loader, "iterate_weights", repeating)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: .*duplicate"):
        _engine(model_dir, "float32")


def test_a_layer_that_fails_while_streamed_keeps_its_own_error(make_checkpoint) -> None:
    model_dir = make_checkpoint("LlamaForCausalLM", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend_per_quant"):
        LLM(
            str(model_dir),
            dtype="bfloat16",
            kv_cache_memory_bytes=4 << 20,
            max_model_len=128,
            quantization="int8",
            cpu_kernels=False,  # no kernel to give the scheme the backend it asks for
            kernel_config={"linear_backend_per_quant": {"int8_w8a16": "cpu_kernel"}},
        )


def test_repeated_expert_weight_after_its_layer_was_quantized_is_named(
    moe_dir, monkeypatch
) -> None:
    iterate = model_loader.iterate_weights
    repeated = "model.layers.1.mlp.experts.7.up_proj.weight"

    def repeating(path):
        tensors = list(iterate(path))
        yield from tensors
        yield next((n, t) for n, t in tensors if n == repeated)

    monkeypatch.setattr(model_loader, "iterate_weights", repeating)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts, expert 7 up_proj"):
        LLM(str(moe_dir), dtype="float32", max_model_len=128, quantization="int8")


def test_the_huge_page_log_counts_the_streamed_layers(make_checkpoint, caplog) -> None:
    if not huge_pages.enabled():
        pytest.skip("no MADV_HUGEPAGE here")
    model_dir = make_checkpoint("LlamaForCausalLM", dtype=torch.bfloat16)  # all streamed
    with caplog.at_level("INFO", logger="minivllm"):
        _engine(model_dir, "bfloat16")
    assert "quantized weights on huge pages" in caplog.text
