"""Shared fixtures: a small byte-level BPE tokenizer and tiny random HF checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from minivllm.kernels.isa import cpu_flags
from minivllm.utils.random_checkpoint import make_random_checkpoint, train_bpe_tokenizer
from tests.server_utils import (
    API_KEY,
    BODY_LIMIT,
    MAX_MODEL_LEN,
    MODEL,
    OTHER_TEMPLATE,
    RemoteServer,
)

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)
ARCH_CONFIGS = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "MistralForCausalLM": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(vocab_size=500).save_pretrained(out)
    return out


def build_checkpoint(
    out: Path,
    tokenizer_dir: Path,
    arch: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: object,
) -> Path:
    from transformers import AutoTokenizer

    config_name, extra = ARCH_CONFIGS[arch]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return make_random_checkpoint(
        out, config_name, {**TINY, **extra, **overrides}, tokenizer, dtype, seed, max_shard_size
    )


@pytest.fixture(scope="session")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def make(arch: str = "Qwen3ForCausalLM", **kwargs: object) -> Path:
        key = json.dumps([arch, sorted((k, repr(v)) for k, v in kwargs.items())])
        if key not in cache:
            out = tmp_path_factory.mktemp(arch.lower())
            cache[key] = build_checkpoint(out, tokenizer_dir, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def qwen3_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("Qwen3ForCausalLM")


@pytest.fixture(scope="session")
def qwen3_llm(qwen3_dir: Path):
    from minivllm import LLM

    return LLM(str(qwen3_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding effects)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


# Logprob tolerance for fp32 engines with int8 or int4 linears against transformers holding
# the same dequantized weights: up to 8 rows those linears round each block of activations
# to int16 (kernels/avx2_quant.cpp, the integer form: each value moves by at most 2^-15 of
# its block's largest), which moved the tiny test models' logprobs by up to 1.8e-4
# (2026-12-03) where the fp32 forms stay within 2e-6.
QUANTIZED_FP32_TOL = 5e-4


# Prompt logprobs of a bf16 engine on the bf16 kernels against the plain-PyTorch
# reference (`linear_backend_per_quant`): both round each product's float32 sums once to
# bf16, so they differ by bf16 rounding propagated through the tiny models' few layers.
BF16_KERNEL_VS_REFERENCE_TOL = 0.05


def assert_prompt_logprobs_close(
    outputs: list[Any], reference: list[Any], tol: float = BF16_KERNEL_VS_REFERENCE_TOL
) -> None:
    """Each prompt token's logprob in `outputs` within `tol` of the same in `reference`."""
    for got, want in zip(outputs, reference, strict=True):
        for pos in range(1, len(got.prompt_token_ids)):
            token = got.prompt_token_ids[pos]
            diff = (
                got.prompt_logprobs[pos][token].logprob - want.prompt_logprobs[pos][token].logprob
            )
            assert abs(diff) < tol, (pos, diff)


def assert_logprobs_match(
    hf: Any, prompts: list[list[int]], outputs: list[Any], tol: float = 1e-4
) -> None:
    """Every prompt and sampled token's logprob (the run asked for prompt_logprobs and
    logprobs) within `tol` of the transformers model `hf`'s log-softmax."""
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        full = prompt + completion.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([full])).logits[0].log_softmax(-1)
        for pos in range(1, len(full)):
            token = full[pos]
            if pos < len(prompt):
                ours = out.prompt_logprobs[pos][token].logprob
            else:
                ours = completion.logprobs[pos - len(prompt)][token].logprob
            assert abs(ours - ref[pos - 1, token].item()) < tol, (pos, ours)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def servers(
    qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RemoteServer]]:
    """The main server, and a short-lived one with --api-key, --chat-template and a bf16 KV
    cache (started together).

    One set for the whole session, shared by test_server.py and test_server_errors.py.
    """
    logs = tmp_path_factory.mktemp("server-logs")
    common = [
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    template = logs / "template.jinja"
    template.write_text(OTHER_TEMPLATE)
    main = RemoteServer(
        qwen3_dir,
        [
            *common,
            "--kv-cache-memory-bytes",
            "4MiB",
            "--max-request-body-bytes",
            str(BODY_LIMIT),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ],
        logs / "main.log",
    )
    keyed = RemoteServer(
        qwen3_dir,
        [
            *common,
            "--kv-cache-memory-bytes",
            "1MiB",
            "--kv-cache-dtype",
            "bfloat16",
            "--api-key",
            API_KEY,
            "--chat-template",
            str(template),
        ],
        logs / "keyed.log",
    )
    started = {"main": main, "keyed": keyed}
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        statuses = {name: server.stop() for name, server in started.items()}
    assert statuses["main"] == 0, main.log()[-4000:]
    assert "Traceback" not in main.log(), main.log()[-4000:]


@pytest.fixture(scope="session")
def server(servers: dict[str, RemoteServer]) -> RemoteServer:
    return servers["main"]


@pytest.fixture(scope="session")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def tokenizer(qwen3_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU beside the results: the kernel tests skip where AVX512-BF16 is missing."""
    from minivllm.kernels.isa import cpu_flags, cpu_has_avx512_bf16, cpu_model, isa_summary

    fast = "on" if cpu_has_avx512_bf16() else "OFF (no AVX512-BF16: kernel tests skip)"
    avx2 = "on" if {"avx2", "fma", "f16c"} <= cpu_flags() else "OFF (no AVX2/FMA/F16C)"
    return [
        f"CPU: {cpu_model()} [{isa_summary()}]; bf16 kernel path: {fast}; "
        f"fp32 AVX2 kernel path: {avx2}"
    ]


# Fast Start (test_weight_cache*.py): the checkpoint daemons load, and daemons per test
@pytest.fixture(scope="module")
def bf16_dir(make_checkpoint: Any) -> Path:
    return make_checkpoint("Qwen3ForCausalLM", dtype=torch.bfloat16)


@pytest.fixture
def start_daemon(bf16_dir: Path, tmp_path: Path) -> Iterator[Any]:
    """start_daemon(*args) -> a weight_cache_harness.Daemon, stopped after the test; the
    daemons of one test share a socket directory."""
    import shutil

    from tests.weight_cache_harness import Daemon, short_dir

    started: list[Daemon] = []
    socket_dir = short_dir()

    def start(*args: str) -> Daemon:
        daemon = Daemon(bf16_dir, socket_dir, tmp_path / f"daemon{len(started)}.log", *args)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
    shutil.rmtree(socket_dir)


needs_avx2 = pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="CPU lacks AVX2/FMA/F16C"
)


@pytest.fixture(scope="session")
def avx2():
    """The AVX2 kernel family's compiled module (skips where it did not build)."""
    from minivllm.kernels import get_avx2_kernels

    module = get_avx2_kernels()
    if module is None:
        pytest.skip("the AVX2 kernels did not build (no compiler?)")
    return module
