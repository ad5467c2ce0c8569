"""Adaptive verification: the online acceptance estimator, the planner, and the engine with both."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.spec_decode.acceptance import AcceptanceEstimator, sigmoid
from minivllm.spec_decode.adaptive import AdaptiveVerifier, CostCurve


def test_labels_are_censoring_aware():
    est = AcceptanceEstimator(num_positions=4)
    est.observe([1.0, 2.0, 3.0, 4.0], num_verified=3, num_accepted=1)
    # position 0 accepted, position 1 rejected; 2 and 3 were never reached
    assert [s.count for s in est.stats] == [1, 1, 0, 0]
    assert est.stats[0].g_1 > 0 > est.stats[1].g_1
    est.observe([1.0, 2.0], num_verified=2, num_accepted=2)  # all verified drafts passed
    assert [s.count for s in est.stats] == [2, 2, 0, 0]


def test_unobserved_positions_start_from_the_position_before():
    """Drafts accepted 10% of the time: 64 requests a step leave positions 1 and 2 with a
    handful of observations per refit; they take position 0's fit, not the 0.82 prior,
    until their own data is enough."""
    rng = random.Random(1)
    est = AcceptanceEstimator(3)
    for _ in range(3):
        for _ in range(64):
            accepted = 0
            while accepted < 3 and rng.random() < 0.1:
                accepted += 1
            est.observe([], 3, accepted)
        est.step()
    assert est.num_refits >= 1 and est.fitted == [True, False, False]
    assert est.predict(0, 0.0) < 0.3
    assert est.predict(1, 0.0) == est.predict(2, 0.0) == est.predict(0, 0.0)


def test_the_estimator_converges_on_a_known_acceptance_process():
    """Position k accepts (given k-1 did) with sigmoid(w_k x + b_k), x the draft's margin."""
    truth = [(0.6, -1.0), (0.3, 0.2), (0.0, -0.4)]
    rng = random.Random(0)
    est = AcceptanceEstimator(3, refit_interval=2000, refit_observations=10**9)
    for _ in range(12):  # refits, each from its window's statistics only
        for _ in range(2000):
            xs = [rng.uniform(0, 8) for _ in truth]
            accepted = 0
            while accepted < 3 and rng.random() < sigmoid(
                truth[accepted][0] * xs[accepted] + truth[accepted][1]
            ):
                accepted += 1
            est.observe(xs, 3, accepted)
            est.step()
    for k, (w, b) in enumerate(truth):
        for x in (0.5, 3.0, 7.0):
            assert est.predict(k, x) == pytest.approx(sigmoid(w * x + b), abs=0.06), (k, x)


def test_the_planner_takes_the_best_tokens_per_second():
    """Against a brute force over every prefix allocation: the same best rate."""
    curve = CostCurve.from_points({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.6, 16: 3.0})
    verifier = AdaptiveVerifier(4, verify_cost=curve, warmup_refits=0, explore_interval=10**9)
    est = verifier.estimator
    est.weights, est.biases = [0.3, 0.2, 0.1, 0.0], [0.5, 0.0, -0.5, -1.0]
    drafts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    features = [[4.0, 3.0, 0.1, 0.0], [0.0, 0.0], [6.0, 6.0, 6.0]]
    plan = verifier.plan(drafts, features, num_tokens_base=3)
    survival = [verifier.survival(f, len(d)) for d, f in zip(drafts, features)]

    def rate(alloc) -> float:
        tokens = 3 + sum(sum(s[:n]) for s, n in zip(survival, alloc))
        return tokens / curve(3 + sum(alloc))

    best = max(itertools.product(*(range(len(d) + 1) for d in drafts)), key=rate)
    assert rate(plan.admitted) == pytest.approx(rate(best))
    assert plan.expected_tokens / plan.expected_seconds == pytest.approx(rate(best))


def test_nothing_is_trimmed_while_warming_up_or_without_a_cost_curve():
    verifier = AdaptiveVerifier(2, CostCurve.from_points({1: 1.0, 4: 100.0}), warmup_refits=1)
    assert verifier.plan([[1, 2], [3]], [[], []], 2).admitted == [2, 1]
    assert AdaptiveVerifier(2, CostCurve(), 0).plan([[1, 2]], [[]], 1).admitted == [2]


def test_cost_curves_are_monotone_and_interpolate():
    curve = CostCurve.from_points({1: 2.0, 4: 1.0, 8: 5.0})
    assert curve(1) == 2.0 and curve(4) == 2.0  # a larger step never costs less
    assert curve(6) == pytest.approx(3.5)
    assert curve(16) == pytest.approx(11.0)  # extrapolated along the last segment
    assert math.isclose(curve(0), 2.0)


def test_adaptive_verification_trims_and_keeps_greedy_outputs(qwen3_dir, qwen3_llm, caplog):
    import logging

    draft = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    from tests.test_spec_decode import _prompts

    prompts = _prompts(6)  # repetitive: n-gram drafts exist and some are accepted
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = LLM(
            str(qwen3_dir),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            max_model_len=128,
            speculative_config={**draft, "enable_adaptive_verification": True},
        )
    assert "adaptive verification: step cost" in caplog.text
    adaptive = llm.llm_engine.executor.runner.spec_decoder.adaptive
    adaptive.warmup_refits, adaptive.estimator.refit_interval = 0, 5
    # verifying grows steeply dearer past a few drafts: only the likeliest pay
    adaptive.verify_cost = CostCurve.from_points({6: 1.0, 8: 1.1, 12: 2.0, 30: 10.0})
    got = llm.generate(prompts, params, use_tqdm=False)
    want = qwen3_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.llm_engine.stats().spec_decode
    assert adaptive.estimator.num_refits > 0
    assert adaptive.num_trimmed > 0 and stats.num_draft_tokens > 0


def test_drafting_stops_when_it_never_pays_except_for_explorers():
    curve = CostCurve.from_points({1: 1.0, 2: 100.0})  # any draft doubles nothing but costs 100x
    verifier = AdaptiveVerifier(2, curve, warmup_refits=0, explore_interval=5, explore_fraction=2)
    drafted = []
    for _ in range(100):
        if verifier.should_draft() or verifier.exploring:
            plan = verifier.plan([[1, 2]] * 4, [[], []] * 2, 4)
            drafted.append(sum(plan.admitted))
        else:
            verifier.skip()
            drafted.append(None)
    # three empty plans, then only exploration steps draft, for every 2nd request; each
    # exploration that still finds no gain doubles the wait (5, 10, 20, then 40 = 8 x 5)
    assert drafted[:3] == [0, 0, 0]
    explored = [i for i, d in enumerate(drafted) if d is not None][3:]
    assert explored == [4, 14, 34, 74]
    assert all(drafted[i] == 2 * 2 for i in explored)


def test_an_exploration_step_without_drafts_plans_nothing():
    """At the end of a run every request may be at its token limit when an exploration
    step comes: no drafts, no explorers, no crash (it once indexed an empty list)."""
    verifier = AdaptiveVerifier(2, CostCurve.from_points({1: 1.0, 2: 2.0}), explore_interval=1)
    assert verifier.exploring and verifier.explorers(0) == []
    assert verifier.plan([], [], 3).admitted == []
    # that exploration found no gain: the next comes after two steps instead of one
    assert not verifier.exploring
    verifier.skip()
    assert verifier.exploring
    assert verifier.plan([[4, 5]], [[1.0, 1.0]], 1).admitted == [2]  # explorers draft fully


def test_an_exploration_verifies_every_explorer_that_drafted():
    """With drafting off, only the explorers (one request in eight) drafted: the exploring
    plan verifies all of them, not one in eight of them again."""
    curve = CostCurve.from_points({1: 1.0, 2: 100.0})  # no draft ever pays
    verifier = AdaptiveVerifier(3, curve, explore_interval=1, explore_fraction=8)
    drafts, features = [[1, 2, 3]] * 8, [[0.0] * 3] * 8
    assert verifier.plan(drafts, features, 64, 64, only_explorers=True).admitted == [3] * 8
    verifier.skip()  # back-off: the next exploration comes a step later
    assert sum(verifier.plan(drafts, features, 64, 64).admitted) == 3


def test_whether_drafting_pays_is_judged_for_the_whole_batch():
    """Explorers (a few requests) stand in for the batch: drafting resumes only if every
    request drafting would pay, at the whole batch's draft cost."""
    curve = CostCurve.from_points({1: 1.0, 64: 1.0, 128: 1.1, 256: 1.3})
    verifier = AdaptiveVerifier(3, curve, explore_interval=10**9)
    verifier.draft_cost.observe(64, 5.0)  # drafting for 64 requests: 5x a plain step
    verifier.draft_cost.observe(8, 0.05)
    drafts, features = [[1, 2, 3]] * 8, [[9.0, 9.0, 9.0]] * 8
    verifier.plan(drafts, features, num_tokens_base=64, num_requests=64)
    # 8 cheap drafters would have paid; 64 lose by far more than a fifth: stop at once
    assert not verifier.should_draft()
    verifier.plan(drafts, features, num_tokens_base=8)  # only these 8 requests exist
    assert verifier.num_empty_plans == 0 and verifier.should_draft()


def test_an_unobserved_draft_cost_scales_from_the_nearest_bucket():
    verifier = AdaptiveVerifier(2, CostCurve.from_points({1: 1.0}))
    assert verifier.draft_cost(64) == 0.0  # nothing observed yet
    verifier.draft_cost.observe(8, 0.5)
    assert verifier.draft_cost(8) == 0.5
    assert verifier.draft_cost(64) == pytest.approx(4.0)  # 3 buckets up: 8x
    assert verifier.draft_cost(2) == pytest.approx(0.125)


def test_explorers_that_would_pay_for_the_whole_batch_turn_drafting_back_on():
    """8 of 64 requests explore with cheap, mostly accepted drafts: the plan must count their
    gain for all 64 (it once ranked by the scaled gain but judged by the unscaled one)."""
    curve = CostCurve.from_points({1: 1.0, 64: 1.0, 128: 1.1, 256: 1.3})
    verifier = AdaptiveVerifier(3, curve, explore_interval=10**9)
    verifier.num_empty_plans = verifier.idle_plans  # drafting had stopped
    verifier.draft_cost.observe(64, 0.3)
    est = verifier.estimator
    est.weights, est.biases = [0.0] * 3, [2.2, 1.4, 0.85]  # survival ~0.9, 0.72, 0.5
    plan = verifier.plan([[1, 2, 3]] * 8, [[1.0] * 3] * 8, num_tokens_base=64, num_requests=64)
    assert verifier.should_draft()
    # this step verifies only the explorers' drafts: its own expectation is unscaled
    assert plan.expected_tokens == pytest.approx(64 + 8 * sum(verifier.survival([1.0] * 3, 3)))
