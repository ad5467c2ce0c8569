"""Scheduler in scripted runs, without a model: token budgets, chunking, preemption, abort."""

from __future__ import annotations

from minivllm.config import SchedulerConfig
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request, RequestStatus
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from minivllm.sampling_params import SamplingParams


def _scheduler(
    num_blocks: int, block_size: int = 4, budget: int = 64, max_seqs: int = 8, caching: bool = False
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, 128), kv)


def _add(s: Scheduler, req_id: str, num_prompt: int, max_tokens: int = 4) -> Request:
    req = Request(
        req_id,
        list(range(1, num_prompt + 1)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        frozenset({0}),
        0.0,
    )
    s.add_request(req)
    return req


def _fake_run(s: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Sample `token` for every request whose scheduled tokens reach its end."""
    result = ModelRunnerOutput()
    for req_id in out.num_scheduled_tokens:
        req = s.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            result.sampled_token_ids[req_id] = [token]
    return result


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, _fake_run(s, out))
    s.kv.pool.check_integrity()
    return out


def test_mixed_batch_chunks_long_prompts_under_the_budget():
    s = _scheduler(num_blocks=32, budget=10)
    _add(s, "a", 3)
    _add(s, "b", 15)
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 3, "b": 7}
    assert [r.block_ids for r in out.new_reqs] == [[0], [1, 2]]
    out = _step(s)  # a decodes one token, b continues its prompt
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}
    assert [c.new_block_ids for c in out.cached_reqs] == [[], [3, 4]]
    assert s.requests["b"].num_output_tokens == 1  # its prompt finished this step


def test_max_num_seqs_is_respected():
    s = _scheduler(num_blocks=32, max_seqs=2)
    for name in "abc":
        _add(s, name, 2)
    out = _step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_newest_request_is_preempted_and_recomputed():
    s = _scheduler(num_blocks=3, block_size=2, max_seqs=4)
    a = _add(s, "a", 2, max_tokens=3)
    b = _add(s, "b", 2, max_tokens=3)
    out = _step(s)  # a: block 0, b: block 1; both sample one token
    assert [r.block_ids for r in out.new_reqs] == [[0], [1]]
    out = _step(s)  # each needs a new block; only one free: b is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert s.kv.block_ids("a") == [0, 2]
    while s.has_unfinished_requests():
        out = _step(s)
    assert a.output_token_ids == [7, 7, 7] and b.output_token_ids == [7, 7, 7]
    assert s.kv.pool.num_free_blocks == 3
    assert s.num_preemptions >= 1


def test_preempted_request_is_told_to_the_runner_and_resent_in_full():
    s = _scheduler(num_blocks=3, block_size=2)
    _add(s, "a", 2, max_tokens=3)
    _add(s, "b", 2, max_tokens=3)
    _step(s)
    out = _step(s)  # b is preempted while this step is scheduled
    assert "b" in out.removed_req_ids and "b" not in out.num_scheduled_tokens
    out = _step(s)  # a finishes; b cannot fit before that
    out = _step(s)
    (resumed,) = out.new_reqs
    assert resumed.req_id == "b" and resumed.token_ids == [1, 2, 7]
    assert resumed.num_computed_tokens == 0 and out.num_scheduled_tokens["b"] == 3


def test_abort_frees_blocks_and_reports_to_the_runner():
    s = _scheduler(num_blocks=8)
    _add(s, "a", 5, max_tokens=10)
    _add(s, "b", 5, max_tokens=10)
    _step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    s.kv.pool.check_integrity()
    assert s.kv.pool.num_free_blocks == 6
    out = _step(s)
    assert "a" in out.removed_req_ids and list(out.num_scheduled_tokens) == ["b"]


def test_length_and_stop_token_rules():
    s = _scheduler(num_blocks=8)
    req = Request(
        "a",
        [1, 2],
        SamplingParams(max_tokens=5, stop_token_ids=[9], min_tokens=2),
        frozenset({0}),
        0.0,
    )
    s.add_request(req)
    out = s.schedule()
    s.update(out, ModelRunnerOutput(sampled_token_ids={"a": [9]}))  # under min_tokens: ignored
    assert req.status == RequestStatus.RUNNING
    out = s.schedule()
    (result,) = s.update(out, ModelRunnerOutput(sampled_token_ids={"a": [9]}))
    assert result.finish_reason == "stop" and result.stop_reason == 9
    assert s.kv.pool.num_free_blocks == 8


def test_admission_is_fair_between_clients():
    """One client's flood queued first does not hold back another's request: admission
    goes to the client with the fewest running sequences (FCFS within a client)."""
    s = _scheduler(num_blocks=64, max_seqs=4)
    for i in range(10):
        _add(s, f"flood{i}", 3).client_id = "10.0.0.1"
    _add(s, "other", 3).client_id = "10.0.0.2"
    out = _step(s)
    assert set(out.num_scheduled_tokens) == {"flood0", "other", "flood1", "flood2"}
    # one client alone: plain first come, first served
    s = _scheduler(num_blocks=64, max_seqs=4)
    for i in range(6):
        _add(s, f"r{i}", 3).client_id = "10.0.0.1"
    assert list(_step(s).num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]


def test_after_a_failed_step_requests_run_alone_until_each_passes():
    s = _scheduler(num_blocks=64)
    for name in "abc":
        _add(s, name, 3, max_tokens=8)
    _step(s)
    _add(s, "d", 3)
    out = s.schedule()  # this step "raises": its requests' state is unknown
    assert set(out.num_scheduled_tokens) == {"a", "b", "c", "d"}
    s.recover_from_failed_step(list(out.num_scheduled_tokens))
    assert not s.running and s.kv.usage == 0.0  # everything is recomputed
    for name in "abcd":
        assert list(_step(s).num_scheduled_tokens) == [name]
    assert not s.isolating
    assert set(_step(s).num_scheduled_tokens) == {"a", "b", "c", "d"}  # batched again


def test_isolation_never_stalls_when_blocks_are_short():
    """An isolated request that cannot get blocks takes them back from the requests that
    already passed (preempting them), instead of leaving every step empty."""
    s = _scheduler(num_blocks=9, budget=32)
    _add(s, "a", 20, max_tokens=8)
    _add(s, "b", 20, max_tokens=8)
    out = s.schedule()  # this step "raises"
    s.recover_from_failed_step(list(out.num_scheduled_tokens))
    finished = set()
    for _ in range(40):
        _step(s)
        finished = {"a", "b"} - set(s.requests)
        if finished == {"a", "b"}:
            break
    assert finished == {"a", "b"} and not s.isolating
