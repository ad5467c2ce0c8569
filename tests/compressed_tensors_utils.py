"""Tiny compressed-tensors checkpoints (llm-compressor / vLLM format) built with the
compressed-tensors library itself, plus the on-disk facts a library-free loader needs.

ON-DISK FORMAT (compressed-tensors 0.20.1; all verified by `_self_check`)
config.json["quantization_config"] (keys sorted; per-scheme "weights" shown):
  {"config_groups": {"group_0": {"targets": ["Linear"], "format": <fmt>,
       "weights": {...}, "input_activations": null | {...}, "output_activations": null}},
   "format": <fmt>, "quant_method": "compressed-tensors", "quantization_status": "compressed",
   "ignore": ["model.layers.0.self_attn.q_proj", ..., "lm_head"],
   "kv_cache_scheme": null, "global_compression_ratio": null, "sparsity_config": {},
   "transform_config": {}, "moe_sparsity_config": null, "version": "0.20.1"}
  weights = {"num_bits", "type": "int"|"float", "symmetric", "strategy": "channel"|"group",
             "group_size": null|G, "dynamic": false, "block_structure"?, "observer"?, "zp_dtype"?}
  - `ignore` is EXPANDED to concrete module names: every nn.Linear that got no scheme
    (regexes passed in are resolved; lm_head listed by name). Match names exactly.
  - int8_w8a16 -> fmt "pack-quantized" (NOT int-quantized: the library packs ALL int
    weight-only schemes, including 8 bit); weights {num_bits 8, int, symmetric true,
    strategy "channel", group_size null}; input_activations null.
  - int8_w8a8 -> fmt "int-quantized"; weights as above; input_activations {num_bits 8,
    type "int", symmetric true, strategy "token", dynamic true, group_size null}.
  - int4_w4a16 -> fmt "pack-quantized"; weights {num_bits 4, int, strategy "group",
    group_size G, symmetric true|false}.
  - int4_w4a8 (W4A8) -> fmt "int-quantized" (not packed: activations are quantized);
    weights as int4_w4a16's, input_activations as int8_w8a8's.
  - fp8_w8a16 -> fmt "naive-quantized" (library inference for float weight-only; pass
    format="float-quantized" to get that name instead - identical tensors); weights
    {num_bits 8, type "float", symmetric true, strategy "channel"}. Treat
    naive-/int-/float-quantized as one layout.
Tensors per quantized Linear `P` (safetensors; N=out_features, K=in_features, G=group):
  int-/float-/naive-quantized: P.weight int8 [N,K] (fp8: float8_e4m3fn [N,K]),
    P.weight_scale bf16 [N,1]. No zero point, no input_scale (dynamic activations).
    W4A8: P.weight int8 [N,K] holding q in [-8, 7], P.weight_scale [N,K/G]; asym adds
    P.weight_zero_point int8 [N,K/G], unpacked.
  pack-quantized: P.weight_packed int32 [N, ceil(K*b/32)], P.weight_scale bf16 [N,1]
    (channel) or [N,K/G] (group), P.weight_shape int64 [2] = [N,K];
    asym only: P.weight_zero_point int32 [ceil(N*b/32), K/G] (packed along dim 0!).
  Scale dtype = model dtype (bf16 here). Unquantized modules: plain P.weight bf16
  (also embed_tokens, norms, and lm_head unless quantize_lm_head).
Packing (pack_to_int32, b bits): q (signed, in [-2^(b-1), 2^(b-1)-1]) is stored as
  u = q + 2^(b-1) (unsigned; +8 for int4, +128 for int8); along the packed dim, element i
  occupies bits [i*b, i*b+b) of the little-endian bit stream of the int32 words, so for
  b=4 element 8j+k is nibble k (bits 4k..4k+3) of word j; for b=8 element 4j+k is byte k.
  Words are int32 (sign bit = top bits of the last element: mask after shifting).
  The asym zero point is packed the same way (offset +2^(b-1)) but along the OUTPUT dim:
  zp[n, g] = ((zpw[n // (32/b), g] >> (b * (n % (32/b)))) & (2^b-1)) - 2^(b-1).
Dequantization: w = (q - zp) * scale, zp = 0 when symmetric, scale broadcast per row
  (channel) or repeated G times along K (group); fp8: w = q * scale. The library computes
  in the scale dtype (bf16); computing in fp32 and casting to bf16 is bit-identical
  (q - zp and fp8 values are exact in bf16, so there is one rounding either way).
  How the fixtures derive them (min/max per row/group, with min<=0<=max): symmetric
  s = max|w| / ((2^b - 1)/2) (127.5 for int8, 7.5 for int4; q = clamp(round(w/s)) may
  hit -2^(b-1)); asym s = (max-min)/(2^b-1), zp = round(clamp(-2^(b-1) - min/s)),
  q = clamp(round(w/s + zp)); fp8 s = max|w|/448, q = clamp(w/s, +-448).to(fp8).
int8_w8a8 activations are not stored (no input_scale). The library's fake-quant is
  per token (last dim) s_x = max|x|/127.5 in the activation dtype, q = clamp(round(x/s_x),
  -128, 127); vLLM's kernels use s_x = max|x|/127 in fp32. Same for weights: the
  library's symmetric scale divides by 127.5 (int8) / 7.5 (int4), not 127 / 7.
transformers 5.24 loads all of these offline (AutoModelForCausalLM.from_pretrained(path)):
  default route keeps w8a8 activation fake-quant (logit oracle with the 127.5 rule);
  CompressedTensorsConfig(dequantize=True) gives a dense bf16 model. The default route
  FAILS for asymmetric pack-quantized (size mismatch on weight_zero_point: it expects
  [N, K/G] unpacked); dequantize=True works for it.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from tests.conftest import TINY

SCHEMES = ("int8_w8a16", "int8_w8a8", "int4_w4a16", "int4_w4a8", "fp8_w8a16")
# llm-compressor's fp8 presets with fp8 activations, which minivllm runs as fp8_w8a16
FP8_PRESETS = {"fp8_dynamic": "fp8_w8a16", "fp8_static": "fp8_w8a16", "fp8_block": "fp8_w8a16"}
# FP8_BLOCK's blocks are 128 x 128; the tiny model's layers take (48 rows, 32 k): the
# rows leave partial blocks at the bottom, as real shapes can
FP8_BLOCK = [48, 32]
# conftest's tiny shape, with head_dim 32 (Qwen3's) and an untied LM head
TINY_QWEN3 = {**TINY, "head_dim": 32, "vocab_size": 256, "tie_word_embeddings": False}


def _quant_scheme(scheme: str, group_size: int, asymmetric: bool, format: str | None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    int_act = QuantizationArgs(
        num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True
    )
    if scheme in ("int8_w8a16", "int8_w8a8"):
        w = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    elif scheme in ("int4_w4a16", "int4_w4a8"):
        w = QuantizationArgs(
            num_bits=4,
            type="int",
            strategy="group",
            group_size=group_size,
            symmetric=not asymmetric,
        )
    elif scheme in ("fp8_w8a16", "fp8_dynamic"):
        w = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    elif scheme == "fp8_static":
        w = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    elif scheme == "fp8_block":  # FP8_BLOCK's layout, with blocks that fit the tiny model
        w = QuantizationArgs(
            num_bits=8, type="float", strategy="block", block_structure=FP8_BLOCK, symmetric=True
        )
    else:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    acts = int_act if scheme in ("int8_w8a8", "int4_w4a8") else None
    if scheme == "fp8_dynamic":  # llm-compressor's FP8_DYNAMIC preset
        acts = QuantizationArgs(
            num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True
        )
    elif scheme == "fp8_static":  # its FP8 preset: static per-tensor activation scales
        acts = QuantizationArgs(
            num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False
        )
    elif scheme == "fp8_block":  # FP8_BLOCK: activations fp8 per group of k, dynamic
        acts = QuantizationArgs(
            num_bits=8,
            type="float",
            strategy="group",
            group_size=FP8_BLOCK[1],
            symmetric=True,
            dynamic=True,
        )
    return QuantizationScheme(targets=["Linear"], weights=w, format=format, input_activations=acts)


@torch.no_grad()
def _calibrate_weight(module: torch.nn.Module) -> None:
    """Memoryless min-max weight observer (what llm-compressor's default does), then the
    library's calculate_qparams to turn min/max into scale / zero point."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight
    if args.strategy == "channel":
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    elif args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "block":
        rows, cols = args.block_structure
        n, k = w.shape
        blocks = torch.nn.functional.pad(w, (0, -k % cols, 0, -n % rows))  # zeros widen nothing
        blocks = blocks.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:  # group
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale, zp = calculate_qparams(lo, hi, args)
    module.weight_scale.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.copy_(zp)
    if hasattr(module, "input_scale"):  # a static activation scale (unused by minivllm)
        module.input_scale.fill_(0.05)
    module.quantization_status = QuantizationStatus.FROZEN


def _float_model(hf_config_kwargs=None, seed=0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**TINY_QWEN3, **(hf_config_kwargs or {})})
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def make_compressed_checkpoint(
    path: str,
    scheme: str,
    ignore: list[str],
    *,
    hf_config_kwargs=None,
    seed=0,
    group_size: int | None = None,
    asymmetric: bool = False,
    quantize_lm_head: bool = False,
    format: str | None = None,
) -> dict[str, str]:
    """Save a tiny random bf16 Qwen3 quantized with compressed-tensors to `path`.

    `ignore`: module names / "re:" regexes left unquantized ("lm_head" is added unless
    quantize_lm_head). `group_size` (int4 only): default 128 if it divides every
    quantized in_features, else 32. `format`: override the inferred compression format.
    Returns {linear_module_name: scheme id or "unquantized"}.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = _float_model(hf_config_kwargs, seed)
    ignore = list(ignore)
    if not quantize_lm_head and "lm_head" not in ignore:
        ignore.append("lm_head")
    if scheme in ("int4_w4a16", "int4_w4a8") and group_size is None:
        ks = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
        group_size = 128 if all(k % 128 == 0 for k in ks) else 32
    group = _quant_scheme(scheme, group_size or 128, asymmetric, format)
    qcfg = QuantizationConfig(config_groups={"group_0": group}, ignore=ignore)
    apply_quantization_config(model, qcfg, show_progress=False)
    layout = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            quantized = getattr(mod, "quantization_scheme", None) is not None
            layout[name] = FP8_PRESETS.get(scheme, scheme) if quantized else "unquantized"
            if quantized:
                _calibrate_weight(mod)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return layout


# ----------------------------------------------------------------- reference reader
def _unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 [R, W] -> signed int [R, n]: element i = bits [i*b, i*b+b) of the row stream."""
    per = 32 // bits  # 4 and 8 bits never straddle words
    shifts = torch.arange(per, dtype=torch.int32) * bits
    u = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return u.flatten(-2)[..., :n] - (1 << (bits - 1))


def dequantize_reference(tensors: dict, prefix: str, qcfg: dict) -> torch.Tensor:
    """Plain-torch dequantization of module `prefix` following the docstring above."""
    if prefix + ".weight_scale" not in tensors:
        return tensors[prefix + ".weight"]
    (group,) = qcfg["config_groups"].values()  # one group in these fixtures
    wa = group["weights"]
    scale = tensors[prefix + ".weight_scale"]
    if prefix + ".weight_packed" in tensors:
        n, k = tensors[prefix + ".weight_shape"].tolist()
        q = _unpack(tensors[prefix + ".weight_packed"], wa["num_bits"], k)
    else:
        q = tensors[prefix + ".weight"]
    zp = torch.zeros_like(scale)
    if prefix + ".weight_zero_point" in tensors:
        zpw = tensors[prefix + ".weight_zero_point"]  # packed along dim 0, or int8 as is
        zp = (
            zpw if zpw.dtype == torch.int8 else _unpack(zpw.t(), wa["num_bits"], scale.shape[0]).t()
        )
    if wa["strategy"] == "group":
        scale = scale.repeat_interleave(wa["group_size"], dim=-1)
        zp = zp.repeat_interleave(wa["group_size"], dim=-1)
    if wa["strategy"] == "block":
        rows, cols = wa["block_structure"]
        n, k = q.shape
        scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]
        zp = torch.zeros_like(scale)
    return ((q.float() - zp.float()) * scale.float()).to(scale.dtype)


def _self_check(tmpdir: str) -> None:
    """Build each scheme, dequantize the safetensors with dequantize_reference, and compare
    to (a) the library's compressor.decompress, (b) transformers' compressed-tensors load."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    cases = [
        ("int8_w8a16", {}),
        ("int8_w8a8", {}),
        ("int4_w4a16", {}),
        ("int4_w4a16", dict(asymmetric=True)),
        ("int4_w4a16", dict(group_size=64)),
        ("fp8_w8a16", {}),
    ]
    for scheme, kw in cases:
        d = os.path.join(tmpdir, scheme + "".join(f"_{k}{v}" for k, v in kw.items()))
        layout = make_compressed_checkpoint(d, scheme, ["re:.*layers\\.1\\.self_attn.*"], **kw)
        qj = json.load(open(os.path.join(d, "config.json")))["quantization_config"]
        t = load_file(os.path.join(d, "model.safetensors"))
        fields = QuantizationConfig.model_fields
        qc = QuantizationConfig.model_validate({k: v for k, v in qj.items() if k in fields})
        sch = qc.config_groups["group_0"]
        comp = BaseCompressor.get_value_from_registry(qc.format)
        hf = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
        hf_sd, worst = hf.state_dict(), 0.0
        try:  # default route: stays compressed, decompresses on the first forward
            AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)(torch.tensor([[1, 2]]))
            default_route = "ok"
        except RuntimeError as e:
            default_route = "FAILS: " + str(e).strip().splitlines()[0][:60]
        orig = _float_model().state_dict()  # same seed: the weights before quantization
        for name, kind in layout.items():
            ref = dequantize_reference(t, name, qj)
            unq = name + ".weight_scale" not in t
            assert (kind == "unquantized") == (name in qj["ignore"]) == unq, name
            if kind != "unquantized":
                local = {k[len(name) + 1 :]: v for k, v in t.items() if k.startswith(name + ".")}
                lib = comp.decompress(local, sch)["weight"]
                assert torch.equal(ref, lib.to(ref.dtype)), (scheme, name)
            assert torch.equal(ref, hf_sd[name + ".weight"]), (scheme, name, "transformers")
            err = (ref.float() - orig[name + ".weight"].float()).abs().max().item()
            worst = max(worst, err / orig[name + ".weight"].float().abs().max().item())
        names = sorted({k.rsplit(".", 1)[1] for k in t if "mlp.down_proj" in k and "layers.0" in k})
        print(
            f"ok {scheme} {kw} fmt={qj['format']} max|w-w_q|/max|w|={worst:.3f} "
            f"down_proj tensors={names} transformers default route: {default_route}"
        )


# ----------------------------------------------------------------- fp8 KV-cache scales
@torch.no_grad()
def add_fp8_kv_cache_scales(
    src, out, strategy: str, calibration: list[list[int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Save the checkpoint at `src` to `out` with an fp8 `kv_cache_scheme` and its scales.

    The scales are what llm-compressor's static min-max observer computes: the largest
    |key| (after the rotary embedding, as its QuantizedKVCache sees keys) and |value| over
    the `calibration` token ids, per layer (strategy "tensor") or per KV head
    ("attn_head"), divided by 448 (e4m3's largest finite value). The parameters are
    registered with the library's own `initialize_qparams` (its names and shapes:
    `self_attn.k_scale` [1] or [Hkv, 1, 1]); the config is the library's QuantizationConfig.
    (`apply_quantization_config` attaches no KV-cache hooks to transformers 5's attention
    here: compressed-tensors 0.20.1 looks for a `past_key_values` argument in its forward,
    which transformers 5.24 renamed; so the observer's step is done here.)
    Returns each layer's (k_scale, v_scale), fp32 [Hkv]."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[int, list[torch.Tensor]] = {}

    class Observer(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            # [batch, Hkv, T, D] -> the largest magnitude per KV head
            k = key_states.abs().amax(dim=(0, 2, 3))
            v = value_states.abs().amax(dim=(0, 2, 3))
            old = amax.get(layer_idx)
            amax[layer_idx] = [k, v] if old is None else [old[0].maximum(k), old[1].maximum(v)]
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    for ids in calibration:
        hf(torch.tensor([ids]), cache=Observer(), use_cache=True)
    args = QuantizationArgs(
        num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True
    )
    config = hf.config
    num_kv = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scales = []
    for i, layer in enumerate(hf.model.layers):
        attn = layer.self_attn
        pair = []
        for base, top in zip(("k", "v"), amax[i], strict=True):
            per_head = (
                top / 448.0 if strategy == "attn_head" else (top.max() / 448.0).expand(num_kv)
            )
            initialize_qparams(
                attn,
                base,
                args,
                observed_shape=(num_kv, None, head_dim),
                observed_dtype=torch.float32,
                force_zero_point=False,
            )
            param = getattr(attn, f"{base}_scale")
            param.copy_(per_head.reshape(param.shape) if strategy == "attn_head" else per_head[:1])
            pair.append(per_head.clone())
        scales.append((pair[0], pair[1]))
    hf.config.quantization_config = QuantizationConfig(
        config_groups={}, kv_cache_scheme=args, quantization_status="frozen"
    ).to_dict()
    hf.save_pretrained(out)
    for name in os.listdir(src):  # the tokenizer's files
        if not os.path.exists(os.path.join(out, name)) and "safetensors" not in name:
            shutil.copy(os.path.join(src, name), os.path.join(out, name))
    return scales


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _self_check(tmp)


# ----------------------------------------------------------------- MoE routed experts
EXPERT_TARGET = "re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"


@torch.no_grad()
def compress_routed_experts(
    src, out, scheme: str, *, group_size: int = 32, asymmetric: bool = False
) -> dict[str, torch.Tensor]:
    """Save the MoE checkpoint at `src` (per-expert `...mlp.experts.E.gate_proj.weight`
    tensors, as transformers writes DeepSeek models) to `out` with its routed experts
    compressed by the library, the rest as it was.

    transformers holds a layer's experts stacked (not as nn.Linear), so the library
    cannot target them in the model; llm-compressor unpacks them into linears for the
    same reason. Here each expert projection becomes an nn.Linear under its checkpoint
    name, the library quantizes those (targets: EXPERT_TARGET) and compresses them, and
    writes its quantization_config into `out`'s config.json. Returns each expert
    projection dequantized by `dequantize_reference`, by module name."""
    from pathlib import Path

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    state = load_file(src / "model.safetensors")
    root = torch.nn.Module()
    for name in [n for n in state if n.endswith("_proj.weight") and ".mlp.experts." in n]:
        *parents, leaf, _ = name.split(".")
        parent = root
        for part in parents:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        weight = state.pop(name)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.copy_(weight)
        parent.add_module(leaf, linear)
    group = _quant_scheme(scheme, group_size, asymmetric, None)
    group.targets = [EXPERT_TARGET]
    apply_quantization_config(
        root, QuantizationConfig(config_groups={"group_0": group}, ignore=[]), show_progress=False
    )
    for module in root.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate_weight(module)
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    compressed = {k: v.contiguous() for k, v in root.state_dict().items()}
    out.mkdir(parents=True)
    save_file({**state, **compressed}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    compressor.update_config(str(out))
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    modules = {k.rsplit(".", 1)[0] for k in compressed}
    return {m: dequantize_reference(compressed, m, qcfg).float() for m in sorted(modules)}
