"""Online quantization in the engine, against transformers running the same quantized weights.

The oracle: transformers in float32 with every targeted `nn.Linear`'s weight replaced
by its quantize-then-dequantize image (and, for int8_w8a8, each input row put through
the same per-token int8 round trip). Our float32 engine runs the plain-PyTorch
reference backend, so both compute the same function: logprobs agree to 1e-4, as the
unquantized models do (tests/test_models.py). The bf16 kernels are checked against
that reference path in tests/test_quant_kernels.py and, end to end, below.
"""

from __future__ import annotations

import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kernels.isa import cpu_flags
from minivllm.quantization import formats, kernel_limits, packing
from tests.conftest import (
    QUANTIZED_FP32_TOL,
    assert_logprobs_match,
    assert_prompt_logprobs_close,
    needs_avx2,
)

PROMPTS = [[random.Random(i).randrange(3, 500) for _ in range(9 + 5 * i)] for i in range(3)]
# hidden 64 and intermediate 128 in the tiny configs: int4 groups of 32 fit every input size
SMALL_GROUPS = {"group_size": 32}


def _engine(model_dir, dtype="float32", **kwargs) -> LLM:
    return LLM(
        str(model_dir), dtype=dtype, kv_cache_memory_bytes=4 << 20, max_model_len=128, **kwargs
    )


def _run(llm: LLM, max_tokens: int = 6):
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def _layers(llm: LLM) -> dict[str, object]:
    model = llm.llm_engine.executor.runner.model
    return {n: m.quant_method for n, m in model.named_modules() if hasattr(m, "quant_method")}


def _fake_quantized_hf(model_dir, chosen: dict[str, tuple], w8a8: set[str]):
    """transformers' model whose linears named in `chosen` (name -> scheme, group size,
    symmetric) hold dequantized weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, module in hf.named_modules():
        if name not in chosen:
            continue
        scheme, group, symmetric = chosen[name]
        qw = formats.quantize(module.weight.data, scheme, group, symmetric)
        module.weight.data.copy_(formats.dequantize(qw))
        if name in w8a8:
            module.register_forward_pre_hook(lambda _m, args: (_per_token_round_trip(args[0]),))
    return hf


def _per_token_round_trip(x: torch.Tensor) -> torch.Tensor:
    """int8_w8a8's activation quantization, written independently of formats.py."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


def _hf_names(our_name: str) -> list[str]:
    """HF module names behind one of ours (the fused layers are separate there)."""
    parent, _, leaf = our_name.rpartition(".")
    split = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    return [f"{parent}.{s}" if parent else s for s in split.get(leaf, (leaf,))]


def _check_against_oracle(model_dir, llm: LLM) -> int:
    from minivllm.quantization.method import QuantizedLinearMethod

    chosen, w8a8 = {}, set()
    for name, method in _layers(llm).items():
        if isinstance(method, QuantizedLinearMethod):
            spec = method.spec
            for hf_name in _hf_names(name):
                chosen[hf_name] = (spec.scheme, spec.group_size, spec.symmetric)
                if spec.scheme == "int8_w8a8":
                    w8a8.add(hf_name)
    hf = _fake_quantized_hf(model_dir, chosen, w8a8)
    assert_logprobs_match(hf, PROMPTS, _run(llm), tol=QUANTIZED_FP32_TOL)
    return len(chosen)


@pytest.mark.parametrize(
    ("quantization", "options"),
    [
        ("int8", None),
        ("int8_w8a8", None),
        ("fp8", None),
        ("int4", SMALL_GROUPS),
        ("int4", {**SMALL_GROUPS, "symmetric": False}),
    ],
)
def test_each_scheme_matches_transformers_with_the_same_quantized_weights(
    make_checkpoint, quantization, options
) -> None:
    model_dir = make_checkpoint("Qwen3ForCausalLM")
    llm = _engine(model_dir, quantization=quantization, quantization_config=options)
    layers = _layers(llm)
    assert type(layers["lm_head"]).__name__ == "UnquantizedLinearMethod"  # shorthands skip it
    quantized = [n for n, m in layers.items() if type(m).__name__ == "QuantizedLinearMethod"]
    assert len(quantized) == 4 * 2  # qkv, o, gate_up, down in each of the 2 layers
    assert _check_against_oracle(model_dir, llm) == 7 * 2


def test_targets_mix_schemes_and_reach_the_lm_head(make_checkpoint, caplog) -> None:
    model_dir = make_checkpoint("LlamaForCausalLM")  # untied LM head
    config = {
        "targets": {
            "re:model\\.layers\\.0\\.mlp": {"scheme": "int4_w4a16", "group_size": 32},
            "re:.*self_attn\\.o_proj": "int8_w8a8",
            "lm_head": "int8",
        },
        "ignore": ["model.layers.1.mlp.*"],  # untargeted: ignoring it is allowed, and moot
    }
    with caplog.at_level("INFO", logger="minivllm"):
        llm = _engine(model_dir, quantization="online", quantization_config=config)
    kinds = {n: getattr(m, "spec", None) for n, m in _layers(llm).items()}
    assert kinds["model.layers.0.mlp.down_proj"].scheme == "int4_w4a16"
    assert kinds["model.layers.1.mlp.down_proj"] is None
    assert kinds["model.layers.1.self_attn.o_proj"].scheme == "int8_w8a8"
    assert kinds["model.layers.0.self_attn.qkv_proj"] is None
    assert kinds["lm_head"].scheme == "int8_w8a16"
    assert (
        "quantized 2 layers as int8_w8a8 (from target 're:.*self_attn\\\\.o_proj')" in caplog.text
    )
    assert _check_against_oracle(model_dir, llm) == 3 + 2 + 1  # gate, up, down; o_proj x2; head


def test_quantized_embedding_table_and_tied_head(make_checkpoint) -> None:
    model_dir = make_checkpoint("Qwen3ForCausalLM")  # tied embeddings
    config = {"targets": {"lm_head": "int8", "model.embed_tokens": "int8"}}
    llm = _engine(model_dir, quantization="online", quantization_config=config)
    model = llm.llm_engine.executor.runner.model
    assert model.lm_head.weight.dtype == torch.int8
    assert model.model.embed_tokens.weight.dtype == torch.int8
    # the oracle: HF with the tied table quantized (both uses read the same image)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    table = hf.get_input_embeddings().weight
    table.data.copy_(formats.dequantize(formats.quantize(table.data, "int8_w8a16")))
    assert_logprobs_match(hf, PROMPTS, _run(llm))


needs_kernels = pytest.mark.skipif(
    not {"avx512_bf16", "avx512_vnni"} <= cpu_flags(), reason="CPU lacks AVX512-BF16/VNNI"
)


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "int8_w8a8", "fp8", "int4", "int4_w4a8"])
def test_bf16_kernels_agree_with_the_reference_backend(make_checkpoint, quantization) -> None:
    """The same quantized bf16 model with our kernels and with the plain-PyTorch reference:
    both round each layer's float32 sums once to bf16, so logprobs differ only by bf16
    rounding propagated through 2 layers (well under 0.05 at this size)."""
    model_dir = make_checkpoint("Qwen3ForCausalLM")
    options = SMALL_GROUPS if quantization.startswith("int4") else None
    scheme = {"int8": "int8_w8a16", "fp8": "fp8_w8a16", "int4": "int4_w4a16"}.get(
        quantization, quantization
    )
    runs = {}
    for backend in ("cpu_kernel", "torch"):
        llm = _engine(
            model_dir,
            dtype="bfloat16",
            quantization=quantization,
            quantization_config=options,
            kernel_config={"linear_backend_per_quant": {scheme: backend}},
        )
        method = _layers(llm)["model.layers.0.mlp.down_proj"]
        assert method.backend == backend
        runs[backend] = _run(llm)
    assert_prompt_logprobs_close(runs["cpu_kernel"], runs["torch"])


@needs_kernels
def test_int4_w4a8_embedding_table_keeps_its_rows_and_the_head_its_panels(make_checkpoint):
    """A tied model with its table and its LM head both int4_w4a8: the table is read by
    lookups, so it keeps its rows and gets no panels; the head multiplies, so it runs on
    panels and drops its rows. Both agree with the same engine on the reference backend."""
    model_dir = make_checkpoint("Qwen3ForCausalLM")  # tied embeddings
    spec = {"scheme": "int4_w4a8", "group_size": 32}
    config = {"targets": {"lm_head": spec, "model.embed_tokens": spec}}
    runs = {}
    for backend in ("cpu_kernel", "torch"):
        llm = _engine(
            model_dir,
            dtype="bfloat16",
            quantization="online",
            quantization_config=config,
            kernel_config={"linear_backend_per_quant": {"int4_w4a8": backend}},
        )
        model = llm.llm_engine.executor.runner.model
        table, head = model.model.embed_tokens, model.lm_head
        assert table.quant_method.quant_weights.has_rows and "packed" not in dict(
            table.named_buffers()
        )
        kernels = backend == "cpu_kernel"
        assert head.quant_method.quant_weights.has_rows != kernels
        assert ("packed" in dict(head.named_buffers())) == kernels
        runs[backend] = _run(llm)
    assert_prompt_logprobs_close(runs["cpu_kernel"], runs["torch"])


def test_shard_targets_count_as_used_and_w8a8_embeddings_are_refused(
    make_checkpoint, caplog
) -> None:
    model_dir = make_checkpoint("Qwen3ForCausalLM")
    shards = {f"*.{p}": "int8" for p in ("q_proj", "k_proj", "v_proj")} | {"*.nothing": "int8"}
    with caplog.at_level("WARNING", logger="minivllm"):
        llm = _engine(model_dir, quantization="online", quantization_config={"targets": shards})
    assert _layers(llm)["model.layers.0.self_attn.qkv_proj"].spec.scheme == "int8_w8a16"
    assert "'*.nothing' matched no layer" in caplog.text
    assert "'*.q_proj' matched no layer" not in caplog.text
    with pytest.raises(ValueError, match="no activations to quantize"):
        _engine(
            model_dir,
            quantization="online",
            quantization_config={"targets": {"model.embed_tokens": "int8_w8a8"}},
        )


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_large_batches_dequantize_like_the_reference(make_checkpoint, quantization) -> None:
    """Past 64 rows the weight-only schemes dequantize to bf16 (the compiled op, into one
    scratch buffer shared by layers of every size) for the dense GEMM: each layer's output
    is the reference's up to the bf16 rounding of the weights, and a 100-token prompt runs."""
    from minivllm.quantization import formats

    model_dir = make_checkpoint("Qwen3ForCausalLM")
    options = SMALL_GROUPS if quantization.startswith("int4") else None
    llm = _engine(
        model_dir, dtype="bfloat16", quantization=quantization, quantization_config=options
    )
    model = llm.llm_engine.executor.runner.model
    gen = torch.Generator().manual_seed(0)
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.qkv_proj"):
        layer = model.get_submodule(name)
        method, qw = layer.quant_method, layer.quant_method.quant_weights
        assert method.dequantize_op is not None
        x = torch.randn(100, qw.in_features, generator=gen).bfloat16()
        got = method.apply(layer, x, None).double()
        ref = formats.reference_linear(x, qw).double()
        terms = x.double().abs() @ formats.dequantize(qw).double().abs().T
        assert ((got - ref).abs() <= 2**-7 * ref.abs() + 2**-8 * terms).all()
    prompt = [random.Random(7).randrange(3, 500) for _ in range(100)]
    [out] = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 2


def test_a_default_that_falls_to_the_reference_is_a_warning(make_checkpoint, caplog) -> None:
    """With the compiled kernels off (cpu_kernels=False, as on a CPU without them) every
    scheme's op is the reference, which dequantizes every weight at every call: the
    start-up warns, naming the scheme and why."""
    with caplog.at_level("INFO", logger="minivllm"):
        llm = _engine(
            make_checkpoint("Qwen3ForCausalLM"),
            quantization="int4_w4a8",
            quantization_config=SMALL_GROUPS,
            cpu_kernels=False,
        )
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        m.startswith("int4_w4a8: ")
        and "on torch (the plain-PyTorch reference), this CPU's default: " in m
        and "no compiled kernels" in m
        for m in warned
    ), warned
    assert _layers(llm)["model.layers.0.mlp.down_proj"].backend == "torch"


@needs_avx2
def test_int4_w4a8_on_bf16_rows_runs_the_avx2_op_like_the_reference() -> None:
    """Where int4_w4a8 has no bf16 kernel (routed experts, CPUs without AVX512-VNNI), with
    bf16 activations the method converts the rows to fp32 for the AVX2 family's op, which rounds x as the reference does and sums in fp32
    before the one rounding to bf16, so it equals the reference up to that rounding."""
    from minivllm.kernels import get_avx2_kernels
    from minivllm.quantization import formats
    from minivllm.quantization.config import SchemeSpec
    from minivllm.quantization.method import QuantizedLinearMethod

    gen = torch.Generator().manual_seed(0)
    qw = formats.quantize(torch.randn(40, 256, generator=gen), "int4_w4a8", 64)
    method = QuantizedLinearMethod(SchemeSpec("int4_w4a8", 64))
    method.fp32_op, method.quant_weights = get_avx2_kernels().linear_quantw, qw
    for rows in (1, 5, 12):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        bias = torch.randn(40, generator=gen).bfloat16()
        got = method.apply(None, x, bias)
        assert got.dtype == torch.bfloat16
        ref = formats.reference_linear(x, qw, bias).double()
        terms = x.double().abs() @ formats.dequantize(qw).double().abs().T
        # one bf16 rounding of sums that differ in their last fp32 bits: up to one ulp
        assert ((got.double() - ref).abs() <= 2**-7 * ref.abs() + 2**-16 * terms).all()


@needs_kernels
def test_int4_w4a8_in_a_bf16_engine_runs_its_vnni_gemm_on_panels(
    make_checkpoint, monkeypatch
) -> None:
    """A bf16 engine on a CPU with AVX512-VNNI gives int4_w4a8's dense layers the GEMM on
    their prepacked panels (every batch: the fused decode step and prefill), as it gives
    a MoE layer's routed experts, one set of panels per expert; without VNNI the scheme
    borrows the AVX2 family's op, and without that too it runs the reference."""
    from safetensors import safe_open

    from minivllm.quantization.config import SchemeSpec
    from minivllm.quantization.method import QuantizedLinearMethod

    model_dir = make_checkpoint("Qwen3ForCausalLM")
    llm = _engine(
        model_dir, dtype="bfloat16", quantization="int4_w4a8", quantization_config=SMALL_GROUPS
    )
    method = _layers(llm)["model.layers.0.mlp.down_proj"]
    assert method.backend == "cpu_kernel" and method.fp32_op is None
    qw = method.quant_weights
    # the panels of the checkpoint's weight, and no row copy of the nibbles beside them
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        full = f.get_tensor("model.layers.0.mlp.down_proj.weight").to(torch.bfloat16)
    want = formats.quantize(full, "int4_w4a8", 32)
    assert qw.packed is not None and torch.equal(qw.packed, packing.pack_vnni_w4a8(want))
    model = llm.llm_engine.executor.runner.model
    assert (
        not qw.has_rows and model.get_submodule("model.layers.0.mlp.down_proj").weight.numel() == 0
    )
    assert "int4_w4a8_packed_linear" in method.op_name
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3
    expert_qw = formats.quantize(torch.randn(40, 64), "int4_w4a8", 32)
    expert = QuantizedLinearMethod(SchemeSpec("int4_w4a8", 32))
    expert.use(expert_qw, method_kernels(llm))
    assert expert.fp32_op is None and expert.packed_op is not None
    assert not expert.quant_weights.has_rows
    assert torch.equal(expert_qw.packed, packing.pack_vnni_w4a8(expert_qw))
    # a CPU without AVX512-VNNI: the AVX2 family's op on rows converted to fp32; and
    # where that family is missing too (its build failed), the reference, never
    # quant_linear, which has no int4_w4a8 kind
    import minivllm.kernels

    no_vnni = kernel_limits.kernel_supports
    monkeypatch.setattr(kernel_limits, "kernel_supports", lambda s: s != "int4_w4a8" and no_vnni(s))
    expert = QuantizedLinearMethod(SchemeSpec("int4_w4a8", 32))
    expert.use(formats.quantize(torch.randn(40, 64), "int4_w4a8", 32), method_kernels(llm))
    assert expert.fp32_op is not None and expert.packed_op is None
    monkeypatch.setattr(minivllm.kernels, "get_avx2_kernels", lambda: None)
    expert = QuantizedLinearMethod(SchemeSpec("int4_w4a8", 32))
    expert.use(formats.quantize(torch.randn(40, 64), "int4_w4a8", 32), method_kernels(llm))
    assert expert.op is None and expert.fp32_op is None and expert.backend == "torch"


def method_kernels(llm: LLM):
    return llm.llm_engine.executor.runner.kernels


@needs_kernels
def test_rowless_int8_w8a8_takes_empty_batches_and_repacks_mapped_panels(
    make_checkpoint, monkeypatch
) -> None:
    """int8_w8a8 on VNNI panels keeps no rows (CPUs without AMX): a step with no rows for
    a layer (an LM head on a chunked-prefill step) still goes to the panels, and panels
    mapped from a daemon that chose VNNI, in an engine that packs AMX blocks, give back
    the rows (exactly) to pack from."""
    from minivllm.quantization.config import SchemeSpec
    from minivllm.quantization.method import QuantizedLinearMethod

    llm = _engine(make_checkpoint("Qwen3ForCausalLM"), dtype="bfloat16", quantization="int8_w8a8")
    method = _layers(llm)["model.layers.0.mlp.down_proj"]
    qw = method.quant_weights
    if kernel_limits.packed_layout(qw.packed) == "amx":
        pytest.skip("with AMX the row kernel serves small batches: int8_w8a8 keeps its rows")
    assert not qw.has_rows
    empty = method.apply(None, torch.empty(0, qw.in_features, dtype=torch.bfloat16), None)
    assert empty.shape == (0, qw.out_features)
    engine = QuantizedLinearMethod(SchemeSpec("int8_w8a8"))
    monkeypatch.setattr(QuantizedLinearMethod, "packed_layout", lambda *_: "amx")
    engine.use(qw, method_kernels(llm), mapped_packed=qw.packed)
    got = engine.quant_weights
    assert got.has_rows and torch.equal(got.weight, packing.rows_of_vnni_w8a8(qw.packed, qw))
    assert torch.equal(got.packed, packing.pack_amx_w8a8(got.weight))
