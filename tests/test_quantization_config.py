"""Targeted online quantization's rules: patterns, precedence, fused layers, and every error."""

from __future__ import annotations

import pytest

from minivllm.quantization.config import SchemeSpec, matches, resolve_quantization

QKV = ["l.0.self_attn.q_proj", "l.0.self_attn.k_proj", "l.0.self_attn.v_proj"]


def online(targets: dict, ignore: list | None = None, **extra: object):
    options = {"targets": targets, **extra}
    if ignore is not None:
        options["ignore"] = ignore
    return resolve_quantization("online", options, None)


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj", True),
        ("model.layers.0.mlp", "model.layers.0.mlp.down_proj", False),  # exact, not a prefix
        ("*down_proj", "model.layers.7.mlp.down_proj", True),
        ("*.layers.1.*", "model.layers.11.mlp.down_proj", False),
        ("re:.*layers\\.1\\.", "model.layers.1.mlp.down_proj", True),
        ("re:layers", "model.layers.1.mlp.down_proj", False),  # re.match anchors at the start
        ("re:model\\.layers\\.1", "model.layers.11.mlp.down_proj", True),  # ... but not the end
        ("*", "lm_head", False),  # the LM head only by a pattern naming it
        ("lm_head", "lm_head", True),
        ("re:lm_head", "lm_head", True),
        ("*", "model.embed_tokens", False),
        ("*embed_tokens", "model.embed_tokens", True),
    ],
)
def test_pattern_rules(pattern: str, name: str, expected: bool) -> None:
    assert matches(pattern, name) is expected


def test_shorthands_quantize_every_linear_but_the_lm_head() -> None:
    config = resolve_quantization("int8", None, None)
    assert config.spec_for("model.layers.0.mlp.down_proj", [])[0] == SchemeSpec("int8_w8a16")
    assert config.spec_for("lm_head", []) is None
    int4 = resolve_quantization("int4", {"group_size": 64, "symmetric": False}, None)
    assert int4.spec_for("x.o_proj", [])[0] == SchemeSpec("int4_w4a16", 64, False)
    assert resolve_quantization("fp8", None, None).targets[0].spec.scheme == "fp8_w8a16"
    assert resolve_quantization("int8_w8a8", None, None).targets[0].spec.scheme == "int8_w8a8"
    assert resolve_quantization(None, None, None) is None


def test_targets_pick_layers_and_ignore_excludes() -> None:
    config = online(
        {"*mlp*": "int4", "*self_attn.o_proj": {"scheme": "int8_w8a8"}}, ignore=["*.3.*"]
    )
    spec, pattern = config.spec_for("m.layers.0.mlp.gate_up_proj", [])
    assert (spec.scheme, pattern) == ("int4_w4a16", "*mlp*")
    assert config.spec_for("m.layers.0.self_attn.o_proj", [])[0].scheme == "int8_w8a8"
    assert config.spec_for("m.layers.0.self_attn.qkv_proj", []) is None  # untargeted
    # ignored and untargeted: fine; ignored and targeted: an error
    assert (
        online({"*mlp*": "int8"}, ignore=["*.3.*"]).spec_for("m.layers.3.self_attn.o_proj", [])
        is None
    )
    with pytest.raises(ValueError, match="both `ignore` and the target"):
        config.spec_for("m.layers.3.mlp.down_proj", [])


def test_ignore_carves_layers_out_of_a_shorthand() -> None:
    config = resolve_quantization("int8", {"ignore": ["*.0.*", "*.k_proj"]}, None)
    assert config.spec_for("m.layers.0.mlp.down_proj", []) is None
    assert config.spec_for("m.layers.1.mlp.down_proj", [])[0].scheme == "int8_w8a16"
    shards = [
        "m.layers.1.self_attn.q_proj",
        "m.layers.1.self_attn.k_proj",
        "m.layers.1.self_attn.v_proj",
    ]
    with pytest.raises(
        ValueError, match="only some of the fused"
    ):  # one precision per fused weight
        resolve_quantization("int8", {"ignore": ["*.k_proj"]}, None).spec_for(
            "m.layers.1.self_attn.qkv_proj", shards
        )


def test_top_level_options_are_int4_defaults() -> None:
    config = online({"*mlp*": "int4", "*attn*": "int8"}, symmetric=False, group_size=64)
    assert config.spec_for("m.mlp.down_proj", [])[0] == SchemeSpec("int4_w4a16", 64, False)
    assert config.spec_for("m.self_attn.o_proj", [])[0] == SchemeSpec("int8_w8a16")


def test_a_layer_matching_two_targets_is_an_error() -> None:
    config = online({"*mlp*": "int4", "*down_proj": "int8"})
    with pytest.raises(ValueError, match="more than one target"):
        config.spec_for("m.layers.0.mlp.down_proj", [])


def test_fused_layers_by_their_own_name_or_by_every_shard() -> None:
    fused = "l.0.self_attn.qkv_proj"
    assert online({"*qkv_proj": "int8"}).spec_for(fused, QKV)[0].scheme == "int8_w8a16"
    shards = online({"*.q_proj": "int8", "*.k_proj": "int8", "*.v_proj": "int8"})
    assert shards.spec_for(fused, QKV)[0].scheme == "int8_w8a16"
    assert online({"*o_proj": "int8"}).spec_for(fused, QKV) is None
    with pytest.raises(ValueError, match="not all its shards"):  # "*v_proj" also hits qkv_proj
        online({"*v_proj": "int8"}).spec_for(fused, QKV)
    with pytest.raises(ValueError, match="different schemes"):
        online({"*.q_proj": "int8", "*.k_proj": "int4", "*.v_proj": "int8"}).spec_for(fused, QKV)
    with pytest.raises(ValueError, match="not all targeted"):
        online({"*.q_proj": "int8", "*.k_proj": "int8"}).spec_for(fused, QKV)
    with pytest.raises(ValueError, match="different schemes"):  # same scheme id, other groups
        online(
            {
                "*.q_proj": "int4",
                "*.k_proj": {"scheme": "int4", "group_size": 64},
                "*.v_proj": "int4",
            }
        ).spec_for(fused, QKV)
    with pytest.raises(ValueError, match="only some of the fused"):
        online({"re:.*\\.[qkv]_proj": "int8"}, ignore=["*.k_proj"]).spec_for(fused, QKV)
    with pytest.raises(ValueError, match="both `ignore` and the target"):
        online({"*qkv_proj": "int8"}, ignore=["*_proj"]).spec_for(fused, QKV)
    assert resolve_quantization("int8", {"ignore": ["*_proj"]}, None).spec_for(fused, QKV) is None


@pytest.mark.parametrize(
    ("quantization", "options", "kernel", "message"),
    [
        ("int5", None, None, "unknown quantization"),
        ("online", None, None, "needs quantization_config"),
        ("online", {"targets": {}}, None, "needs quantization_config"),
        ("online", {"targets": {"*": "int3"}}, None, "unknown scheme"),
        ("online", {"targets": {"*": {"scheme": "int4", "bits": 4}}}, None, "unknown key"),
        ("online", {"targets": {"*": 8}}, None, "give a scheme name"),
        ("online", {"targets": {"re:(": "int8"}}, None, "not a valid regular expression"),
        ("online", {"targets": {"": "int8"}}, None, "non-empty string"),
        ("online", {"targets": {"*": "int8"}, "ignore": "lm_head"}, None, "list of patterns"),
        ("online", {"targets": {"*": "int8"}, "layers": []}, None, "unknown quantization_config"),
        ("int4", {"group_size": 48}, None, "multiple of 32"),
        ("int8", {"symmetric": False}, None, "symmetric only"),
        ("int8", {"targets": {"*": "int8"}}, None, "targets go with"),
        (None, {"targets": {"*": "int8"}}, None, "needs quantization='online'"),
        ("int8", "{not json", None, "not valid JSON"),
        ("int8", None, {"linear_backend": "x"}, "unknown kernel_config"),
        ("int8", None, {"linear_backend_per_quant": {"nvfp4": "torch"}}, "unknown scheme"),
        ("int8", None, {"linear_backend_per_quant": {"int8_w8a16": "marlin"}}, "unknown backend"),
    ],
)
def test_bad_configurations_are_refused(quantization, options, kernel, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_quantization(quantization, options, kernel)


def test_kernel_config_alone_and_from_json() -> None:
    config = resolve_quantization(
        "int8", None, '{"linear_backend_per_quant": {"int8_w8a16": "torch"}}'
    )
    assert config.backends == {"int8_w8a16": "torch"}
    alone = resolve_quantization(
        None, None, {"linear_backend_per_quant": {"int4_w4a16": "cpu_kernel"}}
    )
    assert alone.targets == () and alone.backends == {"int4_w4a16": "cpu_kernel"}


def test_serve_flags_reach_the_engine_arguments() -> None:
    from minivllm.entrypoints.cli import build_parser
    from minivllm.entrypoints.engine_flags import engine_args_from

    targets = '{"targets": {"*mlp*": "int4"}, "ignore": ["*.0.*"]}'
    kernel = '{"linear_backend_per_quant": {"int4_w4a16": "torch"}}'
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--quantization",
            "online",
            "--quantization-config",
            targets,
            "--kernel-config",
            kernel,
        ]
    )
    engine = engine_args_from(args)
    config = resolve_quantization(
        engine.quantization, engine.quantization_config, engine.kernel_config
    )
    assert config.spec_for("m.layers.1.mlp.down_proj", [])[0].scheme == "int4_w4a16"
    assert config.spec_for("m.layers.0.self_attn.o_proj", []) is None
    assert config.backends == {"int4_w4a16": "torch"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--quantization", "int3"])
