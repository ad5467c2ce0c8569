"""Fast Start: the weight-cache daemon and `load_format="ipc_cache"` (docs/fast-start.md).

Daemons run as subprocesses (`python -m minivllm.weight_cache`) on a tiny bf16 Qwen3
checkpoint, each with its own socket directory.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import LLM
from minivllm.weight_cache.client import WeightCacheClient, WeightCacheMismatchError
from minivllm.weight_cache.protocol import recv_message, send_message
from minivllm.weight_cache.socket_dir import (
    SocketDirError,
    ensure_socket_dir,
    lock_path,
)
from minivllm.weight_cache.watchdog import WeightCacheDaemonLostError
from tests.weight_cache_harness import (
    ENGINE,
    GREEDY,
    PROMPTS,
    Daemon,
    assert_same_outputs,
    disk_outputs_of,
    short_dir,
)


@pytest.fixture(scope="module")
def shared_daemon(bf16_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that only read from it; stopped (and checked) at the end."""
    root, socket_dir = tmp_path_factory.mktemp("shared_daemon"), short_dir()
    daemon = Daemon(bf16_dir, socket_dir, root / "daemon.log").wait_ready()
    yield daemon
    assert daemon.stop() == 0
    assert not os.path.exists(daemon.path) and not os.path.exists(lock_path(daemon.path))
    shutil.rmtree(socket_dir)


@pytest.fixture(scope="module")
def disk_outputs(bf16_dir: Path) -> list[Any]:
    return disk_outputs_of(bf16_dir, **ENGINE)


def ipc_llm(model_dir: Path, daemon: Daemon, **options: Any) -> LLM:
    extra = {"socket_dir": str(daemon.socket_dir), **options}
    return LLM(str(model_dir), load_format="ipc_cache", model_loader_extra_config=extra, **ENGINE)


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.executor.runner.model


def mapping_of(ptr: int) -> tuple[int, str] | None:
    """(inode, path) of the /proc/self/maps region holding address `ptr`."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in parts[0].split("-"))
            if low <= ptr < high:
                return int(parts[4]), parts[5].strip() if len(parts) > 5 else ""
    return None


def test_ipc_cache_matches_disk_load(
    bf16_dir: Path, shared_daemon: Daemon, disk_outputs: list[Any], caplog: Any
) -> None:
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = ipc_llm(bf16_dir, shared_daemon)
    assert "tensors from the weight cache daemon (zero_copy mode)" in caplog.text
    assert "falling back" not in caplog.text
    assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), disk_outputs)
    weight = model_of(llm).model.layers[0].mlp.down_proj.weight
    assert "memfd:minivllm-weights" in mapping_of(weight.data_ptr())[1]
    llm.llm_engine.shutdown()


def test_two_zero_copy_engines_map_the_same_memory(
    bf16_dir: Path, shared_daemon: Daemon, disk_outputs: list[Any]
) -> None:
    engines = [ipc_llm(bf16_dir, shared_daemon) for _ in range(2)]
    weights = [model_of(e).model.layers[1].self_attn.qkv_proj.weight for e in engines]
    regions = [mapping_of(w.data_ptr()) for w in weights]
    # two mappings of one memfd: the same inode, which is the daemon's own fd
    assert regions[0] == regions[1] and "memfd:minivllm-weights" in regions[0][1]
    fd_dir = f"/proc/{shared_daemon.proc.pid}/fd"
    daemon_inodes = {os.stat(os.path.join(fd_dir, fd)).st_ino for fd in os.listdir(fd_dir)}
    assert regions[0][0] in daemon_inodes
    # tied embeddings stay tied; the shared rotary table stays shared
    model = model_of(engines[0])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layers = model.model.layers
    assert layers[0].self_attn.rotary_emb.cos_cache is layers[1].self_attn.rotary_emb.cos_cache
    for engine in engines:
        assert_same_outputs(engine.generate(PROMPTS, GREEDY, use_tqdm=False), disk_outputs)
        engine.llm_engine.shutdown()


def test_copy_engine_exit_leaves_zero_copy_engine_intact(
    bf16_dir: Path, start_daemon: Any, disk_outputs: list[Any], caplog: Any
) -> None:
    daemon = start_daemon().wait_ready()
    zero_copy = ipc_llm(bf16_dir, daemon)
    copy = ipc_llm(bf16_dir, daemon, mode="copy")
    weight = model_of(copy).model.layers[0].mlp.down_proj.weight
    assert "memfd" not in (mapping_of(weight.data_ptr()) or (0, ""))[1]
    assert_same_outputs(copy.generate(PROMPTS, GREEDY, use_tqdm=False), disk_outputs)
    # copy mode told the daemon to release: the next engine falls back to disk
    assert WeightCacheClient(daemon.path, 5, 30).ping()["released"] is True
    copy.llm_engine.shutdown()
    del copy, weight
    gc.collect()
    assert_same_outputs(zero_copy.generate(PROMPTS, GREEDY, use_tqdm=False), disk_outputs)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        ipc_llm(bf16_dir, daemon).llm_engine.shutdown()
    assert "weights were released" in caplog.text and "falling back to disk" in caplog.text
    zero_copy.llm_engine.shutdown()


def test_killed_daemon_fails_engine_and_leaves_a_stale_socket(
    bf16_dir: Path, start_daemon: Any, disk_outputs: list[Any]
) -> None:
    daemon = start_daemon().wait_ready()
    llm = ipc_llm(bf16_dir, daemon)
    daemon.proc.kill()
    daemon.proc.wait()
    with pytest.raises(WeightCacheDaemonLostError, match="has exited"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()
    # the killed daemon left its socket: a client sees it stale, a new daemon cleans it
    assert os.path.exists(daemon.path)
    with pytest.raises(RuntimeError, match="stale socket"):
        WeightCacheClient(daemon.path, 5, 30).ping()
    with pytest.raises(RuntimeError, match="stale socket"):
        ipc_llm(bf16_dir, daemon, fallback=False, state_timeout_s=0.5)
    second = start_daemon().wait_ready()
    assert "removed the stale socket" in second.log.read_text()
    fresh = ipc_llm(bf16_dir, second)
    assert_same_outputs(fresh.generate(PROMPTS, GREEDY, use_tqdm=False), disk_outputs)
    fresh.llm_engine.shutdown()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_speculative_draft_maps_from_the_daemon(
    bf16_dir: Path,
    start_daemon: Any,
    make_checkpoint: Any,
    tmp_path: Path,
    method: str,
    caplog: Any,
) -> None:
    """A daemon started with the engine's speculative_config holds the draft too; the
    engine maps target and draft (one memfd) and decodes as a disk load does. An engine
    without that draft falls back, naming the key's `draft` field."""
    if method == "eagle":
        from tests.test_eagle import make_eagle_head

        draft = make_eagle_head(bf16_dir, tmp_path / "eagle")
    else:
        draft = make_checkpoint(
            "Qwen3ForCausalLM", dtype=torch.bfloat16, seed=1, num_hidden_layers=1
        )
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 2}
    disk = LLM(str(bf16_dir), speculative_config=spec, **ENGINE)
    expected = disk.generate(PROMPTS, GREEDY, use_tqdm=False)
    disk.llm_engine.shutdown()
    daemon = start_daemon("--speculative-config", json.dumps(spec)).wait_ready()
    extra = {"socket_dir": str(daemon.socket_dir), "fallback": False}  # map, or raise
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = LLM(
            str(bf16_dir),
            load_format="ipc_cache",
            model_loader_extra_config=extra,
            speculative_config=spec,
            **ENGINE,
        )
    try:
        assert "draft model tensors from the weight cache daemon" in caplog.text
        target = model_of(llm)
        drafter = llm.llm_engine.executor.runner.spec_decoder.proposer.model
        inode, path = mapping_of(next(target.parameters()).data_ptr())
        assert "memfd:minivllm-weights" in path
        assert all(mapping_of(p.data_ptr()) == (inode, path) for p in drafter.parameters())
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_same_outputs(outputs, expected)
    finally:
        llm.llm_engine.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        plain = ipc_llm(bf16_dir, daemon)
    assert "mismatch on fields: ['draft']" in caplog.text
    assert "memfd" not in mapping_of(next(model_of(plain).parameters()).data_ptr())[1]
    plain.llm_engine.shutdown()


def test_second_daemon_on_one_socket_is_refused(shared_daemon: Daemon, bf16_dir: Path) -> None:
    log = shared_daemon.log.with_name("second.log")
    second = Daemon(bf16_dir, shared_daemon.socket_dir, log)
    assert second.proc.wait(120) != 0
    assert "already owns" in log.read_text()
    assert WeightCacheClient(shared_daemon.path, 5, 30).ping()["status"] == "ok"


def test_mismatched_key_falls_back_naming_the_field(
    bf16_dir: Path, shared_daemon: Daemon, caplog: Any
) -> None:
    extra = {"socket_dir": str(shared_daemon.socket_dir)}
    args = dict(ENGINE, max_model_len=128, load_format="ipc_cache")
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = LLM(str(bf16_dir), model_loader_extra_config=extra, **args)
    assert "mismatch on fields: ['max_model_len']" in caplog.text
    assert "falling back to disk loading" in caplog.text
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.shutdown()
    with pytest.raises(WeightCacheMismatchError, match="max_model_len") as info:
        LLM(str(bf16_dir), model_loader_extra_config={**extra, "fallback": False}, **args)
    assert info.value.fields == ["max_model_len"]


def raw_request(path: str, payload: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        return recv_message(sock, 1 << 20)[0]


def frame(body: bytes) -> bytes:
    return struct.pack("!Q", len(body)) + body


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (struct.pack("!Q", 1 << 40), "exceeds the limit"),
        (frame(b"\xff{not json"), "not JSON"),
        (frame(b"[1, 2]"), "not a JSON object"),
        (frame(b'{"cmd": "exec"}'), "unknown command"),
        (frame(b'{"cmd": "get_state", "key": {"dtype": 1}}'), "bad get_state request"),
        (b"\x00\x00", "closed mid-message"),
    ],
)
def test_malformed_request_gets_an_error_and_daemon_keeps_serving(
    shared_daemon: Daemon, payload: bytes, message: str
) -> None:
    reply = raw_request(shared_daemon.path, payload)
    assert reply["status"] == "error" and message in reply["message"]
    assert WeightCacheClient(shared_daemon.path, 5, 30).ping()["status"] == "ok"


def test_socket_and_directory_permissions(shared_daemon: Daemon) -> None:
    assert os.stat(shared_daemon.path).st_mode & 0o777 == 0o600
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(shared_daemon.path)
        send_message(sock, {"cmd": "ping"})
        reply, _ = recv_message(sock, 1 << 20)
    assert reply["pid"] == shared_daemon.proc.pid
    assert json.dumps(reply)  # plain JSON, no pickle anywhere


def test_unsafe_socket_directories_are_refused(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    default = ensure_socket_dir(None)
    assert default == str(tmp_path / f"minivllm_weight_cache_{os.getuid()}")
    assert os.stat(default).st_mode & 0o777 == 0o700
    os.chmod(default, 0o750)
    with pytest.raises(SocketDirError, match="must be 0700"):
        ensure_socket_dir(None)
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    ensure_socket_dir(str(real))  # an explicit directory: ownership and symlink checks only
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(SocketDirError, match="symlink"):
        ensure_socket_dir(str(tmp_path / "link"))


def test_unsafe_default_directory_fails_the_engine_even_with_fallback(
    bf16_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    os.mkdir(tmp_path / f"minivllm_weight_cache_{os.getuid()}", 0o777)
    os.chmod(tmp_path / f"minivllm_weight_cache_{os.getuid()}", 0o777)
    with pytest.raises(SocketDirError):
        LLM(str(bf16_dir), load_format="ipc_cache", **ENGINE)


def test_extra_config_is_validated(bf16_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown model_loader_extra_config key"):
        LLM(str(bf16_dir), load_format="ipc_cache", model_loader_extra_config={"mod": 1}, **ENGINE)
    with pytest.raises(ValueError, match="mode must be one of"):
        LLM(str(bf16_dir), load_format="ipc_cache", model_loader_extra_config='{"mode": "x"}')
    with pytest.raises(ValueError, match="only read with load_format 'ipc_cache'"):
        LLM(str(bf16_dir), model_loader_extra_config={"mode": "copy"})
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(str(bf16_dir), load_format="pt")


def test_quantized_model_maps_its_quantized_tensors(start_daemon: Any, bf16_dir: Path) -> None:
    """The daemon holds the online-quantized tensors (int4 gate/up with zero points, int4_w4a8
    down projections, int8_w8a8 attention, an int8 LM head) and the GEMMs' prepacked copies
    (int8_w8a8's, int4_w4a8's panels); a mapping engine runs them as a disk-loading one does,
    on the daemon's copies, not on copies of its own."""
    from safetensors import safe_open

    from minivllm.quantization import formats, kernel_limits

    config = {
        "targets": {
            "*gate_up_proj": {"scheme": "int4_w4a16", "group_size": 32, "symmetric": False},
            "*down_proj": {"scheme": "int4_w4a8", "group_size": 32},
            "*self_attn*": "int8_w8a8",
            "lm_head": "int8",
        }
    }
    quant = dict(quantization="online", quantization_config=config)
    disk = LLM(str(bf16_dir), **ENGINE, **quant)
    expected = disk.generate(PROMPTS, GREEDY, use_tqdm=False)
    names = ("self_attn.qkv_proj", "mlp.down_proj")
    disk_layer = model_of(disk).model.layers[1]
    disk_packed = {n: disk_layer.get_submodule(n).quant_method.quant_weights.packed for n in names}
    disk_packed = {n: None if p is None else p.clone() for n, p in disk_packed.items()}
    disk.llm_engine.shutdown()
    daemon = start_daemon("--quantization", "online", "--quantization-config", json.dumps(config))
    daemon.wait_ready()
    extra = {"socket_dir": str(daemon.socket_dir), "fallback": False}
    llm = LLM(
        str(bf16_dir), load_format="ipc_cache", model_loader_extra_config=extra, **ENGINE, **quant
    )
    assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), expected)
    layer = model_of(llm).model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.uint8 and layer.zero is not None
    assert "memfd:minivllm-weights" in mapping_of(layer.weight.data_ptr())[1]
    assert "packed" not in dict(layer.named_buffers())  # weight-only: no GEMM copy
    assert model_of(llm).lm_head.weight.dtype == torch.int8
    for name in names:
        module = model_of(llm).model.layers[1].get_submodule(name)
        qw = module.quant_method.quant_weights
        assert (qw.packed is not None) == module.quant_method.kernels_on  # VNNI kernels here
        if qw.packed is None:
            continue
        assert module.packed is qw.packed
        assert "memfd:minivllm-weights" in mapping_of(qw.packed.data_ptr())[1]
        assert torch.equal(qw.packed, disk_packed[name])  # what the disk engine packed
        # on VNNI panels (int4_w4a8's; int8_w8a8's without AMX) no row copy, held or mapped
        amx = qw.scheme == "int8_w8a8" and kernel_limits.packed_layout(qw.packed) == "amx"
        assert qw.has_rows == amx
        assert module.weight.shape == qw.weight.shape
    # an engine on the reference backend maps the same daemon and leaves the copies unused
    backends = {"linear_backend_per_quant": {"int8_w8a8": "torch", "int4_w4a8": "torch"}}
    reference = LLM(
        str(bf16_dir),
        load_format="ipc_cache",
        model_loader_extra_config=extra,
        kernel_config=backends,
        **ENGINE,
        **quant,
    )
    down = model_of(reference).model.layers[1].mlp.down_proj
    assert down.quant_method.backend == "torch" and "packed" not in dict(down.named_buffers())
    if disk_packed["mlp.down_proj"] is not None:  # the daemon held panels, not rows
        # rebuilt from the mapped panels: the rows quantizing the checkpoint's weight gives
        with safe_open(bf16_dir / "model.safetensors", "pt") as f:
            full = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        want = formats.quantize(full, "int4_w4a8", 32, symmetric=True)
        assert torch.equal(down.weight, want.weight) and down.quant_method.quant_weights.has_rows
    qkv = model_of(reference).model.layers[1].self_attn.qkv_proj
    with safe_open(bf16_dir / "model.safetensors", "pt") as f:
        names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
        full = torch.cat([f.get_tensor(name) for name in names])
    assert torch.equal(qkv.weight, formats.quantize(full, "int8_w8a8").weight)  # as rebuilt
    reference.llm_engine.shutdown()
    # a daemon holding another quantization does not serve the engine: the key says which
    with pytest.raises(WeightCacheMismatchError, match="quant"):
        LLM(
            str(bf16_dir),
            load_format="ipc_cache",
            model_loader_extra_config=extra,
            **ENGINE,
            quantization="int8",
        )
    llm.llm_engine.shutdown()


def test_fp32_engine_maps_the_daemons_bf16_weight_panels(start_daemon: Any, bf16_dir: Path) -> None:
    """An fp32 engine on the AVX2 kernels holds a bf16 checkpoint's linears as bf16 panels
    (`layers/panel_linear.py`); a daemon started with --dtype float32 holds the panels, and a
    mapping engine runs them as they are, with the disk load's outputs."""
    from minivllm.kernels.registry import select_kernels

    if select_kernels("cpu", torch.float32).op("linear_bf16w") is None:
        pytest.skip("no AVX2 kernels here")
    fp32 = {**ENGINE, "dtype": "float32"}
    disk = LLM(str(bf16_dir), **fp32)
    expected = disk.generate(PROMPTS, GREEDY, use_tqdm=False)
    disk.llm_engine.shutdown()
    daemon = start_daemon("--dtype", "float32").wait_ready()
    extra = {"socket_dir": str(daemon.socket_dir), "fallback": False}
    llm = LLM(str(bf16_dir), load_format="ipc_cache", model_loader_extra_config=extra, **fp32)
    assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), expected)
    for layer in (model_of(llm).model.layers[0].mlp.down_proj, model_of(llm).lm_head):
        assert layer.weight.dim() == 3 and layer.weight.dtype == torch.bfloat16
        assert layer.quant_method.panel_kernel is not None
        assert "memfd:minivllm-weights" in mapping_of(layer.weight.data_ptr())[1]
    llm.llm_engine.shutdown()


def test_key_from_a_peer_without_a_defaulted_field() -> None:
    """A key from before the `draft` field existed reads as draft "none", so a comparison
    names the field instead of refusing the request; required fields stay required."""
    from minivllm.weight_cache.key import WEIGHT_LAYOUT, WeightCacheKey

    fields = {f.name: f for f in WeightCacheKey.__dataclass_fields__.values()}
    full = {name: (1 if f.type == "int" else "x") for name, f in fields.items()}
    full["draft"] = "draft_model:abc"
    full["layout"] = WEIGHT_LAYOUT
    key = WeightCacheKey.from_json(full)
    old = WeightCacheKey.from_json({k: v for k, v in full.items() if k != "draft"})
    assert old.draft == "none" and key.mismatched_fields(old) == ["draft"]
    # a daemon from before processed layouts were versioned: its experts may be laid out
    # otherwise, so the key differs in `layout` and the engine falls back
    older = WeightCacheKey.from_json({k: v for k, v in full.items() if k != "layout"})
    assert older.layout == "1" != WEIGHT_LAYOUT and key.mismatched_fields(older) == ["layout"]
    with pytest.raises(ValueError, match="fields differ"):
        WeightCacheKey.from_json({k: v for k, v in full.items() if k != "checkpoint"})


def test_fp8_kv_scales_map_read_only(bf16_dir: Path, tmp_path: Path) -> None:
    """A checkpoint with fp8 KV-cache scales, one layer's missing: the daemon holds the
    scale parameters as loaded and a zero-copy engine maps them read-only, so the engine
    derives the missing ones without writing to them; outputs equal a disk load's."""
    from safetensors.torch import load_file, save_file

    from tests.compressed_tensors_utils import add_fp8_kv_cache_scales

    model = tmp_path / "fp8-kv"
    model.mkdir()
    add_fp8_kv_cache_scales(bf16_dir, model, "tensor", [list(range(5, 30))])
    (weights,) = list(model.glob("*.safetensors"))
    tensors = load_file(weights)
    del tensors["model.layers.1.self_attn.k_scale"], tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, weights, metadata={"format": "pt"})
    # fp8 named outright: with the bf16 CPU kernels (AVX512-BF16), whose attention reads
    # bf16 caches only, `auto` keeps the cache in bf16 and leaves the scales unused
    engine = dict(ENGINE, kv_cache_dtype="fp8")
    disk = LLM(str(model), **engine)
    expected = disk.generate(PROMPTS, GREEDY, use_tqdm=False)
    disk.llm_engine.shutdown()
    socket_dir = short_dir()
    daemon = Daemon(model, socket_dir, tmp_path / "daemon.log").wait_ready()
    try:
        extra = {"socket_dir": str(socket_dir), "fallback": False}
        llm = LLM(str(model), load_format="ipc_cache", model_loader_extra_config=extra, **engine)
        assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), expected)
        layer = model_of(llm).model.layers[1].self_attn.attn
        assert "memfd:minivllm-weights" in mapping_of(layer.k_scale.data_ptr())[1]
        assert torch.equal(layer.kv_scales[:2], torch.ones(2, layer.num_kv_heads))
        llm.llm_engine.shutdown()
    finally:
        daemon.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
