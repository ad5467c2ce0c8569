"""The bf16 CPU GEMV kernel against a float64 reference, and the engine with it on and off."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.kernels import cpu_has_avx512_bf16, get_cpu_kernels
from minivllm.kernels.registry import select_kernels
from tests.conftest import needs_avx2

needs_kernel = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="CPU lacks AVX512-BF16")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 64])
@pytest.mark.parametrize("n,k", [(64, 1024), (37, 200), (1000, 96)])
def test_gemv_matches_a_float64_reference(rows, n, k):
    kernels = get_cpu_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    ref = x.double() @ w.double().T + bias.double()
    got = kernels.gemv_bf16(x, w, bias).double()
    # fp32 accumulation, one bf16 rounding of the result: relative error ~2^-8
    scale = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((got - ref).abs() <= scale * 2**-7 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_gemv_rows_do_not_depend_on_the_batch(rows):
    """A row's outputs are the same bits alone (1 x 8 tiles) as in a batch (4 x 6 tiles,
    and the single-row tail past a multiple of 6): every output sums the same k in the
    same order, which greedy speculative decoding's verification relies on."""
    kernels = get_cpu_kernels()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).bfloat16()
    w = torch.randn(6 * 8 + 5, 200, generator=gen).bfloat16()
    batch = kernels.gemv_bf16(x, w, None)
    for i in range(rows):
        assert torch.equal(batch[i : i + 1], kernels.gemv_bf16(x[i : i + 1], w, None))


@needs_kernel
def test_engine_outputs_agree_with_and_without_kernels(qwen3_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [40, 41, 42]}]
    logprobs = {}
    for enabled in (False, True):
        llm = LLM(
            str(qwen3_dir),
            dtype="bfloat16",
            kv_cache_memory_bytes=4 << 20,
            max_model_len=64,
            cpu_kernels=enabled,
        )
        linear = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj
        assert (linear.quant_method.cpu_kernel is not None) == enabled
        outs = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True),
            use_tqdm=False,
        )
        logprobs[enabled] = [o.outputs[0].logprobs[0] for o in outs]
    for off, on in zip(logprobs[False], logprobs[True]):
        common = set(off) & set(on)
        assert len(common) >= 3
        for token in common:
            assert on[token].logprob == pytest.approx(off[token].logprob, abs=0.05)


@needs_kernel
@pytest.mark.parametrize(
    "group,dim,block_size,window",
    [
        (3, 64, 4, 0),  # blocks smaller than the kernel's 16-token chunks
        (3, 64, 4, 5),
        (2, 128, 16, 0),  # Qwen3-0.6B's heads: 8 KV heads serve 16
        (8, 64, 32, 0),  # two chunks per block; heads taken four at a time
        (7, 96, 16, 21),  # odd group, head_dim 96, a window starting mid-chunk
        (1, 256, 8, 0),
        (1, 128, 16, 0),  # one head a KV head: the one-head scores at head_dim <= 128
        (2, 32, 16, 0),
        (3, 160, 16, 7),  # head_dim past 128: one head at a time
        (2, 192, 16, 0),
        (2, 224, 32, 0),
    ],
)
def test_paged_decode_attention_matches_a_reference(group, dim, block_size, window):
    kernels = get_cpu_kernels()
    gen = torch.Generator().manual_seed(window + dim)
    num_kv, blocks_per_seq = 2, 96 // block_size  # up to 96 tokens a request
    num_blocks = 4 * blocks_per_seq + 2
    k_cache = torch.randn(num_kv, num_blocks, block_size, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_kv, num_blocks, block_size, dim, generator=gen).bfloat16()
    block_tables = torch.randperm(num_blocks, generator=gen)[: 4 * blocks_per_seq].view(4, -1)
    # row 1 has nothing to attend to (zeros out): the thread before it must not fetch
    # ahead into it, and the one after it starts cleanly
    seq_lens = torch.tensor([71, 0, 2, 96])
    # larger queries make peaked softmaxes, so the online max's rescaling matters
    q = (4 * torch.randn(4, num_kv * group, dim, generator=gen)).bfloat16()
    got = kernels.paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, 0.125, window)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    for b in (0, 2, 3):
        n = int(seq_lens[b])
        slots = [
            int(block_tables[b, t // block_size]) * block_size + t % block_size for t in range(n)
        ]
        first = max(0, n - window) if window else 0
        for h in range(num_kv * group):
            keys = k_cache[h // group].reshape(-1, dim)[slots[first:]].double()
            values = v_cache[h // group].reshape(-1, dim)[slots[first:]].double()
            probs = (0.125 * keys @ q[b, h].double()).softmax(0)
            torch.testing.assert_close(got[b, h].double(), probs @ values, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("hidden,head", [(96, 64), (100, 40)])  # 100 and 40: scalar tails too
def test_fused_ops_match_the_layers_plain_paths(hidden, head):
    from minivllm.layers.activation import SiluAndMul
    from minivllm.layers.layernorm import RMSNorm
    from minivllm.layers.rotary import RotaryEmbedding

    kernels = select_kernels("cpu", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)

    def close(a: torch.Tensor, b: torch.Tensor) -> None:  # within two bf16 ulps
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2 * 2**-8)

    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden, generator=gen).bfloat16()
    x = torch.randn(5, hidden, generator=gen).bfloat16()
    res = torch.randn(5, hidden, generator=gen).bfloat16()
    plain = norm(x), norm(x, res.clone())
    norm.select_kernels(kernels)
    fused = norm(x), norm(x, res.clone())
    close(fused[0], plain[0])
    close(fused[1][0], plain[1][0])
    close(fused[1][1], plain[1][1])

    act = SiluAndMul()
    y = (8 * torch.randn(3, 2 * hidden, generator=gen)).bfloat16()  # well into SiLU's tails
    plain_act = act(y)
    act.select_kernels(kernels)
    close(act(y), plain_act)

    rope = RotaryEmbedding(head, {"rope_type": "default", "rope_theta": 10000.0}, 512, 256)
    qkv = torch.randn(4, (4 + 2 + 2) * head, generator=gen).bfloat16()
    positions = torch.tensor([0, 7, 100, 255])
    q, k = qkv[:, : 4 * head].view(4, 4, head), qkv[:, 4 * head : 6 * head].view(4, 2, head)
    plain_q, plain_k = rope(positions, q.clone(), k.clone())
    rope.select_kernels(kernels)
    fused_q, fused_k = rope(positions, q, k)  # strided views into qkv, rotated in place
    close(fused_q, plain_q)
    close(fused_k, plain_k)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5, 16, 70])
@pytest.mark.parametrize("head", [64, 40])  # 40: the scalar tail too
def test_rms_norm_reads_per_head_views_in_place(tokens, head):
    """Qwen3's per-head q/k norms take views into the fused qkv output (tokens further
    apart than their heads): the kernel reads them where they are, and must give what the
    same rows give copied out (bit for bit) and what the plain RMSNorm gives."""
    from minivllm.layers.layernorm import RMSNorm

    kernels = get_cpu_kernels()
    gen = torch.Generator().manual_seed(tokens)
    q_heads, kv_heads = 4, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head, generator=gen).bfloat16()
    weight = torch.randn(head, generator=gen).bfloat16()
    norm = RMSNorm(head, 1e-6)
    norm.weight.data = weight
    for first, heads in ((0, q_heads), (q_heads * head, kv_heads)):
        view = qkv[:, first : first + heads * head].view(tokens, heads, head)
        assert tokens == 1 or not view.is_contiguous()  # one token: a view that is contiguous
        got = kernels.rms_norm(view, weight, 1e-6)
        assert got.is_contiguous() and got.shape == view.shape
        assert torch.equal(got, kernels.rms_norm(view.contiguous(), weight, 1e-6))
        torch.testing.assert_close(
            got.float(), norm(view.contiguous()).float(), atol=2e-2, rtol=2 * 2**-8
        )


@needs_kernel
@pytest.mark.parametrize(
    "num_context,num_query,group,dim,window",
    [
        (0, 77, 2, 128, 0),
        (0, 5, 3, 64, 0),
        (37, 40, 2, 64, 0),
        (0, 70, 1, 32, 9),
        (50, 20, 2, 64, 16),
        (3, 150, 4, 96, 0),
    ],
)
@pytest.mark.parametrize("allow_amx", [True, False], ids=["amx-if-present", "avx512"])
def test_prefill_attention_matches_a_reference(
    num_context, num_query, group, dim, window, allow_amx
):
    kernels = get_cpu_kernels()
    gen = torch.Generator().manual_seed(num_context + num_query + dim)
    num_kv, block_size, num_blocks = 2, 8, 20
    k_cache = torch.randn(num_kv, num_blocks, block_size, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_kv, num_blocks, block_size, dim, generator=gen).bfloat16()
    seq_len = num_context + num_query
    block_table = torch.randperm(num_blocks, generator=gen)[: -(-seq_len // block_size)]
    q = torch.randn(num_query, num_kv * group, dim, generator=gen).bfloat16()
    got = kernels.prefill_attention(
        q, k_cache, v_cache, block_table, num_context, 0.1, window, allow_amx=allow_amx
    )
    slots = [
        int(block_table[t // block_size]) * block_size + t % block_size for t in range(seq_len)
    ]
    for h in range(num_kv * group):
        keys = k_cache[h // group].reshape(-1, dim)[slots].double()
        values = v_cache[h // group].reshape(-1, dim)[slots].double()
        scores = 0.1 * q[:, h].double() @ keys.T  # [query, key]
        q_pos = torch.arange(num_context, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values
        # bf16 probabilities in the second product: errors of a few bf16 ulps
        torch.testing.assert_close(got[:, h].double(), want, atol=3e-2, rtol=3e-2)


@needs_kernel
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("Qwen3ForCausalLM", {}),  # per-head q/k RMSNorm
        ("Qwen2ForCausalLM", dict(hidden_size=128)),  # QKV bias
        ("LlamaForCausalLM", dict(hidden_size=128)),
        ("MistralForCausalLM", dict(hidden_size=128, sliding_window=6)),
    ],
)
def test_fused_decode_layers_equal_the_per_layer_path(make_checkpoint, arch, overrides):
    """The one-call decode step and the per-layer Python path run the same kernels: equal bits."""
    llm = LLM(
        str(make_checkpoint(arch, **overrides)),
        dtype="bfloat16",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,  # the second run must not start from the first one's blocks
    )
    runner = llm.llm_engine.executor.runner
    assert runner.fused_decode is not None
    assert (
        runner.model.model.layers[0].mlp.down_proj.quant_method.cpu_kernel.packed_weight is not None
    )
    # 20 requests: past MAX_KERNEL_ROWS_PACKED rows, so the oneDNN-packed linears run too
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 1, *range(2, 19))]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    results = []
    for fused in (runner.fused_decode, None):
        runner.fused_decode = fused
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            [
                (
                    o.outputs[0].token_ids,
                    [{t: p.logprob for t, p in d.items()} for d in o.outputs[0].logprobs],
                )
                for o in outs
            ]
        )
    assert results[0] == results[1]


@needs_kernel
def test_write_kv_cache_equals_index_copy():
    kernels = get_cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    num_kv, dim, num_blocks, block_size = 2, 64, 6, 4
    qkv = torch.randn(5, (4 + 2 * num_kv) * dim, generator=gen).bfloat16()
    k = qkv[:, 4 * dim : (4 + num_kv) * dim].view(5, num_kv, dim)  # strided rows, as in a layer
    v = qkv[:, (4 + num_kv) * dim :].view(5, num_kv, dim)
    slots = torch.tensor([3, 17, 4, 22, 0])
    want = torch.zeros(2, num_kv, num_blocks, block_size, dim, dtype=torch.bfloat16)
    got = want.clone()
    for which, x in ((0, k), (1, v)):
        want[which].view(num_kv, -1, dim).index_copy_(1, slots, x.transpose(0, 1))
    kernels.write_kv_cache(got, k, v, slots)
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 17, 40, 130])
def test_cpu_linear_method_matches_f_linear_with_and_without_packed_weights(rows):
    from minivllm.layers.cpu_linear import CpuLinearKernel, fits_prepacked

    gen = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(96, 80, bias=True).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    want = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    gemv = get_cpu_kernels().gemv_bf16
    assert not fits_prepacked(layer.weight.nbytes, available_bytes=layer.weight.nbytes * 8 - 1)
    plain = CpuLinearKernel.build(gemv, layer.weight, prepack=False)(x, layer.weight, layer.bias)
    assert fits_prepacked(layer.weight.nbytes, available_bytes=1 << 30)
    packed_kernel = CpuLinearKernel.build(gemv, layer.weight, prepack=True)
    assert packed_kernel.packed_weight is not None
    packed = packed_kernel(x, layer.weight, layer.bias)
    for got in (plain, packed):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2**-7)


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 37, 160, 1003])
def test_argmax_bf16_equals_torch_argmax_with_ties(vocab):
    gen = torch.Generator().manual_seed(vocab)
    # few distinct values: many ties, which torch resolves to the first index
    logits = torch.randint(-3, 4, (9, vocab), generator=gen).bfloat16()
    logits[0] = float("-inf")
    logits[1, -1] = 100.0  # the maximum in the scalar tail
    got = get_cpu_kernels().argmax_bf16(logits)
    assert torch.equal(got, logits.float().argmax(dim=-1))


def _avx2_build() -> Path:
    """The AVX2 family's build directory, built (every AVX-512 CPU has AVX2 too)."""
    from minivllm.kernels import get_avx2_kernels, kernel_build_dir

    assert get_avx2_kernels() is not None
    return Path(kernel_build_dir()) / "avx2"


@needs_avx2
def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    build = _avx2_build()
    # what torch's FileBaton leaves when its builder is killed, left under our build lock
    # (a build in progress elsewhere must not meet it); the build is up to date, so the
    # next start has only the lock to get past
    with _build_lock(build):
        (build / "lock").touch()
    code = "from minivllm.kernels import get_avx2_kernels; assert get_avx2_kernels() is not None"
    try:
        _run_in_own_group([sys.executable, "-c", code], timeout=120)
        assert not (build / "lock").exists()
    finally:  # never leave the shared cache locked
        with _build_lock(build):
            (build / "lock").unlink(missing_ok=True)


@contextlib.contextmanager
def _build_lock(build: Path):
    with open(build / "minivllm.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        yield


def _run_in_own_group(command: list[str], timeout: float, **kwargs) -> None:
    """Run `command`; past `timeout`, kill its whole process group (a compile it started
    must not go on writing into the shared cache) and fail."""
    proc = subprocess.Popen(command, start_new_session=True, **kwargs)
    try:
        assert proc.wait(timeout) == 0, f"{command} exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


@needs_avx2
def test_a_second_checkout_of_the_same_kernels_reuses_the_build(tmp_path):
    """The sources compile from copies in the build directory (kernels/__init__.py's
    _stage_sources), so a package at another path (a fresh clone, a reinstall) loads the
    cached build instead of compiling for minutes."""
    build = _avx2_build()
    library = build / "minivllm_cpu_kernels_avx2.so"
    before = library.stat().st_mtime_ns
    ninja = (build / "build.ninja").read_bytes()
    package = Path(minivllm.__file__).parent
    shutil.copytree(package, tmp_path / "minivllm", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import minivllm, minivllm.kernels as k; "
        f"assert minivllm.__file__.startswith({str(tmp_path)!r}), minivllm.__file__; "
        "assert k.get_avx2_kernels() is not None"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    # a rebuild takes minutes on 2 cores: the timeout fails it long before
    _run_in_own_group([sys.executable, "-c", code], timeout=90, env=env, cwd=tmp_path)
    assert library.stat().st_mtime_ns == before, "the second checkout recompiled the kernels"
    assert (build / "build.ninja").read_bytes() == ninja  # the same sources, by the same paths


@needs_kernel
@pytest.mark.parametrize("prepack", [False, True])
def test_cpu_linear_kernel_streams_up_to_this_cpus_row_limit(prepack, monkeypatch):
    """Our GEMV takes batches up to `kernel_row_limits()` rows (fewer where oneDNN has
    AMX-BF16 tiles), oneDNN the larger ones; both give F.linear's numbers."""
    from minivllm.kernels.isa import cpu_flags
    from minivllm.layers import cpu_linear

    plain, packed = cpu_linear.kernel_row_limits()
    amx = "amx_bf16" in cpu_flags()
    assert (plain, packed) == ((8, 4) if amx else (64, 16))
    calls = []
    gemv = get_cpu_kernels().gemv_bf16

    def recording(x, w, b):
        calls.append(x.shape[0])
        return gemv(x, w, b)

    layer = torch.nn.Linear(64, 48, bias=False).bfloat16()
    kernel = cpu_linear.CpuLinearKernel.build(recording, layer.weight, prepack=prepack)
    limit = packed if prepack else plain
    assert kernel.max_rows == limit
    for rows in (1, limit, limit + 1, 3 * limit):
        x = torch.randn(rows, 64).bfloat16()
        got = kernel(x, layer.weight, None)
        want = torch.nn.functional.linear(x.double(), layer.weight.double())
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2**-7)
    assert calls == [1, limit]
