"""Fast Start with tensor parallelism: a daemon group (one process per rank) and TP=2
engines mapping it, on one node and over two "nodes" of this host (docs/fast-start.md).
The harness is tests/weight_cache_harness.py; single-rank tests are in test_weight_cache.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM
from minivllm.weight_cache.client import WeightCacheClient
from minivllm.weight_cache.process import process_start_time
from minivllm.weight_cache.socket_dir import lock_path, socket_path
from tests.weight_cache_harness import (
    ENGINE,
    GREEDY,
    PROMPTS,
    REPO,
    Daemon,
    assert_same_outputs,
    disk_outputs_of,
)

TP2 = dict(ENGINE, tensor_parallel_size=2)


def rank_sockets(daemon: Daemon) -> list[str]:
    return [socket_path(str(daemon.socket_dir), tp_rank=r) for r in range(2)]


def memfd_inodes(pid: int) -> set[int]:
    """Inodes of the weight memfds process `pid` maps."""
    with open(f"/proc/{pid}/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:minivllm-weights" in line}


def memfd_fd_inodes(pid: int) -> set[int]:
    """Inodes of the weight memfds process `pid` holds open (a daemon rank's arena)."""
    fd_dir = f"/proc/{pid}/fd"
    paths = [os.path.join(fd_dir, fd) for fd in os.listdir(fd_dir)]
    return {os.stat(p).st_ino for p in paths if "memfd:minivllm-weights" in os.readlink(p)}


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 60  # a safety net, not a measurement
    while process_start_time(pid) is not None:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tp2_disk_outputs(bf16_dir: Path) -> list[Any]:
    return disk_outputs_of(bf16_dir, **TP2)


def test_tp2_ipc_cache_matches_tp2_disk_load(
    bf16_dir: Path, start_daemon: Any, tp2_disk_outputs: list[Any], capfd: Any
) -> None:
    daemon = start_daemon("-tp", "2").wait_ready()
    paths = rank_sockets(daemon)
    rank_pids = [WeightCacheClient(p, 5, 30).ping()["pid"] for p in paths]
    assert len(set(rank_pids)) == 2 and daemon.proc.pid not in rank_pids
    extra = {"socket_dir": str(daemon.socket_dir), "fallback": False}  # map, or raise
    llm = LLM(str(bf16_dir), load_format="ipc_cache", model_loader_extra_config=extra, **TP2)
    try:
        assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), tp2_disk_outputs)
        # engine rank r maps daemon rank r's memfd, and only that one
        worker_pids = llm.llm_engine.executor.worker_pids
        mapped = [memfd_inodes(pid) for pid in worker_pids]
        for inodes, rank_pid, other_pid in zip(mapped, rank_pids, rank_pids[::-1]):
            assert inodes and inodes == memfd_fd_inodes(rank_pid)
            assert not inodes & memfd_fd_inodes(other_pid)
    finally:
        llm.llm_engine.shutdown()
    # rank 1's daemon lets go of its weights: engine rank 1 falls back, and rank 0 with it
    WeightCacheClient(paths[1], 5, 30).release()
    capfd.readouterr()
    extra["fallback"] = True
    llm = LLM(str(bf16_dir), load_format="ipc_cache", model_loader_extra_config=extra, **TP2)
    try:
        assert not any(memfd_inodes(pid) for pid in llm.llm_engine.executor.worker_pids)
        assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), tp2_disk_outputs)
    finally:
        llm.llm_engine.shutdown()
    err = capfd.readouterr().err
    assert "weights were released" in err and "rank 0 mapped its weights but another" in err
    assert daemon.stop() == 0
    assert not any(os.path.exists(p) or os.path.exists(lock_path(p)) for p in paths)
    assert all(process_start_time(pid) is None for pid in rank_pids)


@pytest.mark.parametrize("victim", ["parent", "rank 1"])
def test_tp2_daemon_group_goes_down_together(start_daemon: Any, victim: str) -> None:
    daemon = start_daemon("-tp", "2").wait_ready()
    paths = rank_sockets(daemon)
    rank_pids = [WeightCacheClient(p, 5, 30).ping()["pid"] for p in paths]
    if victim == "parent":
        daemon.proc.kill()
        daemon.proc.wait()
        for pid in rank_pids:  # each rank sees its link to the parent close, and stops
            wait_gone(pid)
        assert not any(os.path.exists(p) or os.path.exists(lock_path(p)) for p in paths)
    else:
        os.kill(rank_pids[1], signal.SIGKILL)
        assert daemon.proc.wait(60) == 1
        assert f"rank 1 (pid {rank_pids[1]}) was killed by SIGKILL" in daemon.log.read_text()
        wait_gone(rank_pids[0])
        assert not os.path.exists(paths[0]) and not os.path.exists(lock_path(paths[0]))
        with pytest.raises(RuntimeError, match="stale socket"):  # SIGKILL left rank 1's
            WeightCacheClient(paths[1], 5, 30).ping()


def child_pids(parent_pid: int) -> list[int]:
    with open(f"/proc/{parent_pid}/task/{parent_pid}/children") as f:
        return [int(pid) for pid in f.read().split()]


def test_two_node_daemon_groups_serve_a_two_node_engine(
    bf16_dir: Path, start_daemon: Any, tp2_disk_outputs: list[Any], tmp_path: Path, monkeypatch: Any
) -> None:
    """Two "nodes" on this host: a daemon per node (`--nnodes 2 --node-rank R`), rank r of
    the group serving rank r's shard; a two-node engine (here plus a `minivllm worker`)
    maps each rank's shard from its node's daemon. A rank dying on one node then takes
    the other node's daemon down too (its barrier with the dead rank fails)."""
    from minivllm.worker.multiproc_executor import free_port

    monkeypatch.setenv("MINIVLLM_TP_SECRET", "a-test-secret-shared-by-both-nodes")
    group = ("-tp", "2", "--nnodes", "2", "--distributed-init-method")
    group += (f"tcp://127.0.0.1:{free_port()}",)
    nodes = [start_daemon(*group, "--node-rank", str(r)) for r in range(2)]
    for node in nodes:
        node.wait_ready()
    assert "node 1 of 2" in nodes[1].log.read_text()
    paths = rank_sockets(nodes[0])
    rank_pids = [WeightCacheClient(p, 5, 30).ping()["pid"] for p in paths]
    assert [child_pids(node.proc.pid) for node in nodes] == [[rank_pids[0]], [rank_pids[1]]]

    engine_init = f"tcp://127.0.0.1:{free_port()}"
    worker_log = open(tmp_path / "node1.log", "w")  # noqa: SIM115 - closed below
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minivllm.entrypoints.worker_cli", "-tp", "2", "--nnodes", "2"]
        + ["--node-rank", "1", "--distributed-init-method", engine_init],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=worker_log,
        stderr=subprocess.STDOUT,
    )
    extra = {"socket_dir": str(nodes[0].socket_dir), "fallback": False}  # map, or raise
    try:
        llm = LLM(
            str(bf16_dir),
            load_format="ipc_cache",
            model_loader_extra_config=extra,
            nnodes=2,
            distributed_init_method=engine_init,
            **TP2,
        )
        try:
            assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), tp2_disk_outputs)
            engine_ranks = [llm.llm_engine.executor.worker_pids[0], *child_pids(node1.pid)]
            for engine_pid, rank_pid in zip(engine_ranks, rank_pids, strict=True):
                assert memfd_inodes(engine_pid) == memfd_fd_inodes(rank_pid) != set()
        finally:
            llm.llm_engine.shutdown()
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        worker_log.close()

    os.kill(rank_pids[1], signal.SIGKILL)
    assert nodes[1].proc.wait(60) == 1
    assert nodes[0].proc.wait(60) == 1  # without a signal of its own
    assert "lost the daemon group" in nodes[0].log.read_text()
    wait_gone(rank_pids[0])
    assert not os.path.exists(paths[0]) and not os.path.exists(lock_path(paths[0]))


def test_multi_node_daemon_flags_are_checked(
    bf16_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from minivllm.entrypoints import weight_cache_cli

    flags = [str(bf16_dir), "--socket-dir", str(tmp_path), "-tp", "2", "--nnodes", "2"]
    for name in ("MINIVLLM_TP_SECRET", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    # two in this process (the CLI's main; its log handler left out, so caplog sees the
    # records), the last through the command itself: its exit status and stderr
    monkeypatch.setattr(weight_cache_cli, "setup_logging", lambda: None)
    monkeypatch.setattr(logging.getLogger("minivllm"), "propagate", True)
    for args, message in [
        ([], "needs the address of node 0"),
        (["--distributed-init-method", "tcp://127.0.0.1:1", "--node-rank", "2"], "not in 0 .. 1"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="minivllm"):
            assert weight_cache_cli.main(flags + args) != 0
        assert message in caplog.text, caplog.text
    env = {k: v for k, v in os.environ.items() if k not in ("MINIVLLM_TP_SECRET", "MASTER_ADDR")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "minivllm.weight_cache", *flags]
    command += ["--distributed-init-method", "tcp://127.0.0.1:1"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "MINIVLLM_TP_SECRET" in run.stderr, run.stderr
