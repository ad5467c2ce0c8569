"""fp8 KV-cache scales from compressed-tensors checkpoints (`kv_cache_scheme`).

The checkpoints: a tiny Qwen3 whose keys and values are made small (k_norm's and v_proj's
weights times 1e-3, q_norm's and o_proj's times 1e3: the same function), so that unscaled
e4m3 stores them among its few subnormals and scaled e4m3 keeps 3 mantissa bits. Their
scales are calibrated as llm-compressor does (tests/compressed_tensors_utils.py). The
oracle is transformers with a cache storing fp8(k / k_scale) * k_scale (and v alike):
our logprobs must match it, and sit far closer to it than to transformers with an
unscaled fp8 cache.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.layers.attention.torch_backend import to_cache_dtype
from minivllm.quantization.kv_cache_scheme import checkpoint_target
from tests.compressed_tensors_utils import add_fp8_kv_cache_scales
from tests.conftest import needs_avx2
from tests.test_kv_cache_dtype import assert_closer_to_oracle, scored_generations

CALIBRATION = [[5 + (i * 13 + j * 7) % 200 for j in range(24)] for i in range(3)]
_built: dict[str, tuple[Path, Path, list]] = {}


def _small_kv_model(make_checkpoint, tmp_path_factory) -> Path:
    """make_checkpoint's Qwen3 with keys and values 1e-3 their size (the same function)."""
    from transformers import AutoModelForCausalLM

    src = make_checkpoint("Qwen3ForCausalLM")
    out = tmp_path_factory.mktemp("small-kv")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = layer.self_attn
            attn.k_norm.weight.mul_(1e-3)
            attn.q_norm.weight.mul_(1e3)
            attn.v_proj.weight.mul_(1e-3)
            attn.o_proj.weight.mul_(1e3)
    hf.save_pretrained(out)
    for f in Path(src).iterdir():
        if not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _checkpoint(make_checkpoint, tmp_path_factory, strategy: str) -> tuple[Path, Path, list]:
    """(plain model, the same with an fp8 kv_cache_scheme, its scales per layer)."""
    if strategy not in _built:
        if "plain" not in _built:
            _built["plain"] = (_small_kv_model(make_checkpoint, tmp_path_factory), None, None)
        plain = _built["plain"][0]
        out = tmp_path_factory.mktemp(f"fp8-kv-{strategy}")
        scales = add_fp8_kv_cache_scales(plain, out, strategy, CALIBRATION)
        _built[strategy] = (plain, out, scales)
    return _built[strategy]


def _hf_logprobs(hf, ids: list[int], scales: list | None) -> torch.Tensor:
    """transformers storing fp8 e4m3 keys and values, scaled by `scales` (None: unscaled)."""
    from transformers.cache_utils import DynamicCache

    class ScaledFp8Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def rounded(x, s):  # x [batch, Hkv, T, D], s [Hkv]; x / s as the engine computes it
                s = s.view(1, -1, 1, 1)
                return to_cache_dtype(x * (1 / s), torch.float8_e4m3fn).to(x.dtype) * s

            one = torch.ones(key_states.shape[1])
            ks, vs = scales[layer_idx] if scales is not None else (one, one)
            return super().update(
                rounded(key_states, ks), rounded(value_states, vs), layer_idx, *args, **kwargs
            )

    with torch.no_grad():
        logits = hf(torch.tensor([ids]), cache=ScaledFp8Cache(), use_cache=True).logits
    return logits[0].log_softmax(-1)


def _llm(model: Path, **kwargs) -> LLM:
    options = dict(
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=8,
    )
    return LLM(str(model), **{**options, **kwargs})


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_checkpoint_scales_match_transformers(
    make_checkpoint, tmp_path_factory, strategy, cpu_kernels
):
    """kv_cache_dtype "auto" on a checkpoint declaring fp8 KV: an fp8 cache with its
    scales, prompts in chunks of 8 (later chunks read the scaled cache back) and greedy
    decodes, on the kernels (the fused decode step included) and the torch path.

    The bound is the unscaled-rounding test's (test_kv_cache_dtype.py): both sides round
    keys that differ by ~1e-6 relatively, and we multiply by 1 / scale where the oracle
    divides (one ulp). Unscaled fp8 must sit at least 10x further away on average."""
    from transformers import AutoModelForCausalLM

    plain, model, scales = _checkpoint(make_checkpoint, tmp_path_factory, strategy)
    if strategy == "attn_head":  # the calibration saw heads of different sizes
        assert not torch.equal(scales[0][0][0], scales[0][0][1])
    llm = _llm(model, cpu_kernels=cpu_kernels)
    runner = llm.llm_engine.executor.runner
    assert llm.llm_engine.config.cache.cache_dtype == "fp8"
    assert all(layer.kv_cache.dtype == torch.float8_e4m3fn for layer in runner.attention_layers)
    for layer, (ks, vs) in zip(runner.attention_layers, scales, strict=True):
        assert torch.equal(layer.kv_scales[0], ks) and torch.equal(layer.kv_scales[1], vs)
    if cpu_kernels and runner.kernels.op("avx2_decode_layers") is not None:
        assert runner.fused_decode is not None  # the AVX2 one-call step, scales and all
    outs = scored_generations(llm)
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    assert_closer_to_oracle(
        outs, lambda ids: _hf_logprobs(hf, ids, scales), lambda ids: _hf_logprobs(hf, ids, None)
    )


def test_a_bf16_engine_with_scales(make_checkpoint, tmp_path_factory):
    """A bf16 engine with kv_cache_dtype="fp8" on the same checkpoint: the scaling runs in
    fp32 and rounds once, so the logprobs follow the scaled oracle (within bf16's noise)
    and stay far from the unscaled one."""
    from transformers import AutoModelForCausalLM

    plain, model, scales = _checkpoint(make_checkpoint, tmp_path_factory, "attn_head")
    llm = _llm(model, dtype="bfloat16", kv_cache_dtype="fp8")
    assert llm.llm_engine.executor.runner.attention_layers[0].kv_scales is not None
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    assert_closer_to_oracle(
        scored_generations(llm),
        lambda ids: _hf_logprobs(hf, ids, scales),
        lambda ids: _hf_logprobs(hf, ids, None),
        bound=0.1,
    )


@needs_avx2
def test_fused_step_with_scales_equals_the_per_layer_path(make_checkpoint, tmp_path_factory):
    """The AVX2 one-call decode step applies the scales as Attention.forward does: equal
    tokens and logprobs, bit for bit."""
    from minivllm.layers.fused_decode import Avx2FusedDecode
    from tests.test_avx2_decode import _greedy

    _, model, _ = _checkpoint(make_checkpoint, tmp_path_factory, "attn_head")
    llm = _llm(model, max_num_batched_tokens=64, max_model_len=64, enable_prefix_caching=False)
    fused = llm.llm_engine.executor.runner.fused_decode
    assert isinstance(fused, Avx2FusedDecode)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 1, 7, 13)]
    assert _greedy(llm, prompts, fused) == _greedy(llm, prompts, None)


def test_an_explicit_cache_dtype_leaves_the_scales_unused(
    make_checkpoint, tmp_path_factory, caplog
):
    """kv_cache_dtype="bfloat16" on the same checkpoint: a bf16 cache, keys stored as they
    are, the same tokens as the plain model with a bf16 cache."""
    plain, model, _ = _checkpoint(make_checkpoint, tmp_path_factory, "tensor")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (4, 11)]
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = _llm(model, kv_cache_dtype="bfloat16")
    assert "scales go unused" in caplog.text
    runner = llm.llm_engine.executor.runner
    assert all(layer.kv_scales is None for layer in runner.attention_layers)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    want = _llm(plain, kv_cache_dtype="bfloat16").generate(prompts, params, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in want]


def test_missing_scales(make_checkpoint, tmp_path_factory, caplog):
    """A checkpoint declaring fp8 KV whose files lack scales, as vLLM reads one: a layer
    with neither uses 1.0, one with only k_scale uses it for v too; with a warning."""
    _, model, scales = _checkpoint(make_checkpoint, tmp_path_factory, "tensor")
    out = _with_config(model, tmp_path_factory.mktemp("fp8-kv-partial"), lambda config: None)
    (weights,) = list(out.glob("*.safetensors"))
    tensors = load_file(weights)
    for name in ("0.self_attn.k_scale", "0.self_attn.v_scale", "1.self_attn.v_scale"):
        del tensors[f"model.layers.{name}"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = _llm(out)
    assert "of 2 attention layers 1 hold no scale (1.0 used) and 1 only one" in caplog.text
    layers = llm.llm_engine.executor.runner.attention_layers
    assert torch.equal(layers[0].kv_scales[:2], torch.ones(2, 2))
    assert torch.equal(layers[1].kv_scales[0], scales[1][0])
    assert torch.equal(layers[1].kv_scales[1], scales[1][0])
    assert bool((layers[1].v_scale.data < 0).all())  # the parameter itself is left as loaded


def _with_config(src: Path, out: Path, edit) -> Path:
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_kv_cache_scheme_errors(make_checkpoint, tmp_path_factory):
    _, model, _ = _checkpoint(make_checkpoint, tmp_path_factory, "tensor")

    def int8_kv(config):
        config["quantization_config"]["kv_cache_scheme"].update(num_bits=8, type="int")

    bad = _with_config(model, tmp_path_factory.mktemp("int8-kv"), int8_kv)
    with pytest.raises(ValueError, match="static symmetric fp8"):
        _llm(bad)

    def channel_kv(config):
        config["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"

    bad = _with_config(model, tmp_path_factory.mktemp("channel-kv"), channel_kv)
    with pytest.raises(ValueError, match="strategy 'channel'"):
        _llm(bad)

    negative = tmp_path_factory.mktemp("negative-kv")
    _with_config(model, negative, lambda config: None)
    (weights,) = list(negative.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.k_scale"] = -tensors["model.layers.0.self_attn.k_scale"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="finite and positive"):
        _llm(negative)

    # the scales without the scheme that declares them are unexpected weights
    undeclared = tmp_path_factory.mktemp("undeclared-kv")
    _with_config(model, undeclared, lambda config: config.pop("quantization_config"))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.k_scale'"):
        _llm(undeclared)


def test_checkpoint_names():
    assert (
        checkpoint_target("model.layers.3.self_attn.k_scale")
        == "model.layers.3.self_attn.attn.k_scale"
    )
    assert (
        checkpoint_target("model.layers.0.self_attn.v_proj.output_scale")
        == "model.layers.0.self_attn.attn.v_scale"
    )
    assert checkpoint_target("model.layers.0.self_attn.q_scale") == ""
    assert checkpoint_target("model.layers.0.self_attn.k_proj.weight") is None
    assert checkpoint_target("model.layers.0.mlp.k_scale") is None


@pytest.mark.parametrize(("tp_size", "heads"), [(1, 4), (2, 4), (4, 2), (2, 1)])
def test_per_head_scales_split_as_the_kv_heads(monkeypatch, tp_size, heads):
    """Each rank takes its KV heads' scales as QKVParallelLinear takes their rows, a head
    on tp_size / heads consecutive ranks when there are fewer heads than ranks; a scale of
    the wrong size is an error naming the expected count."""
    from minivllm.distributed import parallel_state
    from minivllm.quantization.kv_cache import _ScaleLoader

    values = torch.arange(1, heads + 1, dtype=torch.float32).view(heads, 1, 1)
    local = max(1, heads // tp_size)
    replicas = max(1, tp_size // heads)
    for rank in range(tp_size):
        monkeypatch.setattr(parallel_state, "get_tp_rank", lambda r=rank: r)
        monkeypatch.setattr(parallel_state, "get_tp_size", lambda: tp_size)
        param = torch.nn.Parameter(torch.zeros(local), requires_grad=False)
        _ScaleLoader(local, heads, "attn_head")(param, values, None)
        first = rank // replicas * local
        assert param.tolist() == [float(h + 1) for h in range(first, first + local)]
        with pytest.raises(ValueError, match=f"one value per KV head \\({heads}\\)"):
            _ScaleLoader(local, heads, "attn_head")(
                param, values[:-1] if heads > 1 else values.repeat(2, 1, 1), None
            )


def test_a_latent_cache_leaves_the_scales_unused(tmp_path, caplog):
    """A DeepSeek-style (MLA) checkpoint declaring fp8 KV: the latent cache keeps the
    model's dtype, the scales are read and unused, with a warning."""
    from minivllm.loader.hub import resolve_model_path

    src = Path(resolve_model_path("demo-sparse"))
    out = _with_config(src, tmp_path, _declare_fp8_kv)
    (weights,) = list(out.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.01])
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.02])
    save_file(tensors, weights, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = LLM(str(out), dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20)
    assert "latent (MLA) cache keeps the model's dtype" in caplog.text
    assert llm.llm_engine.config.cache.cache_dtype == "auto"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def _declare_fp8_kv(config: dict) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    config["quantization_config"] = QuantizationConfig(
        config_groups={}, kv_cache_scheme=args, quantization_status="frozen"
    ).to_dict()


def test_a_draft_model_with_scales(make_checkpoint, tmp_path_factory):
    """Speculative decoding with the fp8-KV checkpoint as target and draft: the draft's
    layers load their own scales and share the fp8 pool; greedy tokens equal plain
    decoding's but at near ties (keys batched differently may round the other way)."""
    _, model, scales = _checkpoint(make_checkpoint, tmp_path_factory, "attn_head")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 40 for j in range(9 + i)]} for i in range(3)]
    plain = [o.outputs[0] for o in _llm(model).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    llm = _llm(model, speculative_config=spec, max_num_batched_tokens=64)
    drafter = llm.llm_engine.executor.runner.spec_decoder.proposer
    for layer, (ks, _) in zip(drafter.attention_layers, scales, strict=True):
        assert torch.equal(layer.kv_scales[0], ks)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for got, want in zip(outs, plain, strict=True):
        same = [a == b for a, b in zip(got.token_ids, want.token_ids)] + [False]
        first = same.index(False)
        if first < len(want.token_ids):
            top = sorted((lp.logprob for lp in want.logprobs[first].values()), reverse=True)
            assert top[0] - top[1] < 1e-2, (first, top)
    assert llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0


def _first_batch_amax(hf, first: list[list[int]]) -> list[tuple[float, float]]:
    """Per layer, the largest |key| (after the rotary embedding) and |value| transformers
    computes for the token lists `first` (each from its request's start)."""
    from transformers.cache_utils import DynamicCache

    amax: dict[int, list[float]] = {}

    class Observer(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = key_states.abs().max().item(), value_states.abs().max().item()
            old = amax.get(layer_idx, [0.0, 0.0])
            amax[layer_idx] = [max(old[0], k), max(old[1], v)]
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    with torch.no_grad():
        for ids in first:
            hf(torch.tensor([ids]), cache=Observer(), use_cache=True)
    return [tuple(amax[i]) for i in sorted(amax)]


@pytest.mark.parametrize("one_token_first", [False, True])
def test_calculate_kv_scales(make_checkpoint, tmp_path_factory, one_token_first):
    """calculate_kv_scales on the model with small keys and values and no checkpoint
    scales: each layer's scales are its first step's largest |key| / 200 and |value| / 100
    (vLLM's constants), that step's keys and values taken from transformers; the logprobs
    then follow transformers holding fp8 numbers scaled by them, far from unscaled fp8.
    The first step is the first 8-token chunk (the 3-token prompt and 5 tokens of the
    next), or a one-token prompt alone, which decodes at once: it must still calibrate
    (not take the fused step, which does not). Without an fp8 cache the option is an
    error."""
    from transformers import AutoModelForCausalLM

    plain = _checkpoint(make_checkpoint, tmp_path_factory, "tensor")[0]
    # the torch path: its linears round as transformers' do, so the keys the first step
    # calibrates on are transformers' bit for bit (on the kernels a last-bit difference
    # can tip an fp8 rounding in layer 0 and move every later layer's keys)
    llm = _llm(plain, kv_cache_dtype="fp8", calculate_kv_scales=True, cpu_kernels=False)
    layers = llm.llm_engine.executor.runner.attention_layers
    assert all(layer.kv_scales is None for layer in layers)
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    if one_token_first:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [42]}], params, use_tqdm=False)
        first = [[42]]
    else:
        first = [list(range(5, 8)), list(range(5, 10))]
    outs = scored_generations(llm)
    scales = [(layer.kv_scales[0], layer.kv_scales[1]) for layer in layers]
    # layer 0's keys and values are the model's; later layers' already read the scaled
    # fp8 cache of the layers before them, so only the first is checked against plain HF
    (ks, vs), (k_top, v_top) = scales[0], _first_batch_amax(hf, first)[0]
    assert torch.allclose(ks, torch.tensor(k_top / 200), rtol=1e-5), (ks, k_top)
    assert torch.allclose(vs, torch.tensor(v_top / 100), rtol=1e-5), (vs, v_top)
    # The bound is looser than the checkpoint-scale tests': the first step's later layers
    # see keys and values from our batched GEMMs, transformers' from one prompt at a time,
    # and a last-bit difference there can tip one fp8 rounding (an eighth of that element)
    # that every later token reads: on an Intel Xeon (AVX512-FP16, AMX) one key of layer
    # 1 tipped and moved the logprobs by up to 3.4e-3. Unscaled fp8 is ~1 away.
    assert_closer_to_oracle(
        outs,
        lambda ids: _hf_logprobs(hf, ids, scales),
        lambda ids: _hf_logprobs(hf, ids, None),
        bound=2e-2,
    )
    with pytest.raises(ValueError, match="calculate_kv_scales scales an fp8 KV cache"):
        _llm(plain, calculate_kv_scales=True)


def test_calculate_kv_scales_before_the_fused_step(make_checkpoint, tmp_path_factory):
    """On the kernels a one-token prompt's first step only decodes, which the AVX2 fused
    step would run without calibrating: the runner routes it through the model until every
    layer has its scales, and the fused step takes over after."""
    plain = _checkpoint(make_checkpoint, tmp_path_factory, "tensor")[0]
    llm = _llm(plain, kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = llm.llm_engine.executor.runner
    if runner.fused_decode is None:
        pytest.skip("no fused decode step here (the AVX2 kernels did not build)")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [42]}], params, use_tqdm=False)
    assert all(layer.kv_scales is not None for layer in runner.attention_layers)
    assert not runner._kv_calibration_pending


def test_serve_takes_calculate_kv_scales():
    from minivllm.entrypoints.cli import build_parser
    from minivllm.entrypoints.engine_flags import engine_args_from

    args = build_parser().parse_args(
        ["serve", "demo-base", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"]
    )
    assert engine_args_from(args).calculate_kv_scales is True
