"""Tensor parallelism over torch.distributed (gloo on CPU): TP=2 against TP=1, tiny checkpoints."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.outputs import RequestOutput
from minivllm.worker.local_workers import WorkerError
from minivllm.worker.multiproc_executor import free_port
from tests.conftest import TINY
from tests.server_utils import REPO_ROOT, RemoteServer

# Long prompts prefill in chunks of 48 tokens, mixed with decodes.
ENGINE = dict(
    dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_batched_tokens=48
)
# 1 KV head over 2 ranks: Llama's KV head is replicated; the others split 2 KV heads.
# Qwen3 runs across two "nodes" in test_multi_node_on_loopback (one start-up fewer).
ARCHS = {
    "LlamaForCausalLM": dict(num_key_value_heads=1),
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {},
}
GREEDY = SamplingParams(
    temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2
)
SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=7),
    SamplingParams(temperature=1.0, top_k=40, max_tokens=10, ignore_eos=True),  # engine generator
]


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(3, 60))]}
        for _ in range(n)
    ]


def _generate(llm: LLM) -> list[RequestOutput]:
    """Five greedy prompts with logprobs, two sampled ones; chunked over several steps."""
    prompts = _prompts(5 + len(SAMPLED))
    return llm.generate(prompts, [GREEDY] * 5 + SAMPLED, use_tqdm=False)


def _token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_logprobs_close(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    for g, w in zip(got, want):
        pairs = list(zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []))
        pairs += list(zip(g.prompt_logprobs or [], w.prompt_logprobs or []))
        for g_pos, w_pos in pairs:
            if w_pos is None:
                assert g_pos is None
                continue
            assert g_pos.keys() == w_pos.keys()
            for token_id, lp in w_pos.items():
                assert g_pos[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)


def _worker_children(parent_pid: int) -> list[int]:
    """Live `python -m minivllm.worker` processes whose parent is `parent_pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent_pid and b"minivllm.worker" in cmdline:
            found.append(int(entry))
    return found


def _shm_segments(pid: int) -> list[str]:
    """Named shared-memory segments `pid` maps (unlinked ones, like a semaphore, cannot leak)."""
    with open(f"/proc/{pid}/maps") as f:
        return [
            line for line in f if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")
        ]


@pytest.fixture
def tp2_engines() -> Iterator[list[LLM]]:
    """TP engines a test starts; shut down (workers stopped) even when the test fails."""
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        llm.llm_engine.shutdown()
    assert _worker_children(os.getpid()) == []


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tp2_matches_tp1(make_checkpoint, tp2_engines, arch: str) -> None:
    model = str(make_checkpoint(arch, **ARCHS[arch]))
    want = _generate(LLM(model, **ENGINE))
    tp2_engines.append(LLM(model, tensor_parallel_size=2, **ENGINE))
    got = _generate(tp2_engines[0])
    assert _token_ids(got) == _token_ids(want)  # greedy, seeded and engine-seeded samples
    _assert_logprobs_close(got, want)
    runner_workers = tp2_engines[0].llm_engine.executor.worker_pids
    assert all(_shm_segments(pid) == [] for pid in runner_workers)


def test_multi_node_on_loopback(
    make_checkpoint, tp2_engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0 (this engine, rank 0 its child) and node 1, a headless `minivllm worker`,
    sharing the control plane's secret."""
    model = str(make_checkpoint("Qwen3ForCausalLM"))
    port = free_port()
    monkeypatch.setenv("MINIVLLM_TP_SECRET", "a shared secret of this test")
    # Node 1 finds node 0 from torchrun's variables.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["PYTHONPATH"] = str(REPO_ROOT)
    log = open(tmp_path / "node1.log", "w")  # noqa: SIM115 - closed below
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minivllm.entrypoints.worker_cli"]
        + ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        init = f"tcp://127.0.0.1:{port}"
        tp2_engines.append(
            LLM(model, tensor_parallel_size=2, nnodes=2, distributed_init_method=init, **ENGINE)
        )
        got = _generate(tp2_engines[0])
        tp2_engines.pop().llm_engine.shutdown()  # node 1 hears it from rank 0 and exits
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        log.close()
    want = _generate(LLM(model, **ENGINE))
    assert _token_ids(got) == _token_ids(want)
    _assert_logprobs_close(got, want)


def test_killed_worker_fails_fast(make_checkpoint, tp2_engines) -> None:
    tp2_engines.append(
        LLM(str(make_checkpoint("Qwen3ForCausalLM")), tensor_parallel_size=2, **ENGINE)
    )
    executor = tp2_engines[0].llm_engine.executor
    rank1 = executor.worker_pids[1]
    os.kill(rank1, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 1 \(pid {rank1}\) was killed by SIGKILL"):
        tp2_engines[0].generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 20  # seconds, not a hang (gloo sees the closed socket)
    assert _worker_children(os.getpid()) == []  # the survivors were stopped with it
    with pytest.raises(WorkerError, match="gone"):
        tp2_engines[0].generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)


def test_worker_error_carries_its_traceback(make_checkpoint, tmp_path: Path) -> None:
    source = make_checkpoint("Qwen3ForCausalLM")
    for f in source.iterdir():  # the config and tokenizer load here, the weights only in ranks
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(WorkerError, match=r"(?s)failed:\nTraceback.*no \.safetensors weights"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)
    assert _worker_children(os.getpid()) == []


def _config_dir(tmp_path: Path, **overrides: object) -> str:
    from transformers import Qwen3Config

    config = {**TINY, "head_dim": 16, "architectures": ["Qwen3ForCausalLM"], **overrides}
    Qwen3Config(**config).save_pretrained(tmp_path)
    return str(tmp_path)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("overrides", "kwargs", "reason"),
    [
        ({}, dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
        (dict(num_attention_heads=6, num_key_value_heads=3), {}, "cannot split the model's 3 KV"),
        (dict(intermediate_size=129), {}, "intermediate size 129"),
        (dict(vocab_size=5), dict(tensor_parallel_size=4), "leaving the last rank none"),
        (None, {}, "CPU cores available"),
        ({}, dict(nnodes=3), "nnodes=3 must be >= 1 and divide"),
        ({}, dict(nnodes=2), "needs the address of node 0"),
        ({}, dict(distributed_init_method="localhost:1234"), "must be tcp://HOST:PORT"),
    ],
)
def test_bad_tp_sizes_are_refused_at_start(
    tmp_path: Path, monkeypatch, overrides, kwargs, reason
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    if overrides is None:  # more ranks than this host has cores, on a model they would divide
        tp = 1 << _cores().bit_length()
        overrides = dict(num_attention_heads=tp, num_key_value_heads=tp, intermediate_size=64 * tp)
        kwargs = dict(tensor_parallel_size=tp)
    args = EngineArgs(_config_dir(tmp_path, **overrides), **{"tensor_parallel_size": 2, **kwargs})
    with pytest.raises(ValueError, match=reason):
        args.create_engine_config()


def test_server_with_tensor_parallel_size_2(qwen3_dir: Path, tmp_path: Path) -> None:
    args = ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "128"]
    server = RemoteServer(qwen3_dir, [*args, "--kv-cache-memory-bytes", "4MiB"], tmp_path / "log")
    try:
        server.wait_ready()
        workers = _worker_children(server.proc.pid)
        assert len(workers) == 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        text = (
            client.completions.create(
                model=str(qwen3_dir), prompt="def main():", temperature=0, max_tokens=8
            )
            .choices[0]
            .text
        )
    finally:
        status = server.stop()
    assert status == 0, server.log()[-4000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    llm = LLM(str(qwen3_dir), **ENGINE)
    want = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert text == want[0].outputs[0].text
