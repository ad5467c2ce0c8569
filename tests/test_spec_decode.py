"""Speculative decoding: config validation, the n-gram proposer, greedy outputs equal to plain
decoding for every method, and sampled outputs distributed exactly as the target's."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


# --- config ---


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        (
            {"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2},
            "num_speculative_tokens",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2}, "prompt_lookup_max"),
        ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ({**NGRAM, "draft_sample_method": "probabilistic"}, "draft_sample_method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({**NGRAM, "rejection_sample_method": "synthetic"}, "synthetic_acceptance_rates"),
        (
            {
                **NGRAM,
                "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": [0.5, 2, 0.1],
            },
            "synthetic_acceptance_rates",
        ),
        ({**NGRAM, "bogus": 1}, "bogus"),
    ],
)
def test_invalid_configs_are_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_value(fields)


def test_a_draft_with_another_vocabulary_is_refused_before_loading(make_checkpoint, qwen3_dir):
    other = make_checkpoint("Qwen3ForCausalLM", vocab_size=256)
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(qwen3_dir), dtype="float32", speculative_config=spec)
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(str(qwen3_dir), speculative_config={**spec, "model": "/no/such/dir"})


# --- the n-gram proposer ---


def test_ngram_takes_the_longest_suffix_and_its_earliest_occurrence():
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0 and 4: the earliest wins -> 9, 1, 2
    assert proposer.propose_one(tokens, 5) == [9, 1, 2]
    assert proposer.propose_one(tokens, 2) == [9, 1]  # capped by the limit
    # the longest matching suffix wins over a shorter, earlier one
    assert NgramProposer(2, 1, 2).propose_one([5, 7, 4, 6, 7, 5, 6, 7], 9) == [5, 6]


def test_ngram_min_max_no_match_and_the_end_of_the_sequence():
    assert NgramProposer(3, 1, 3).propose_one([1, 2, 3, 4], 3) == []  # nothing repeats
    assert NgramProposer(3, 2, 3).propose_one([1, 5, 2, 1], 3) == []  # only a 1-gram repeats
    assert NgramProposer(3, 1, 3).propose_one([1, 5, 2, 1], 3) == [5, 2, 1]
    assert NgramProposer(4, 1, 2).propose_one([7, 7], 4) == [7]  # only one token follows
    assert NgramProposer(3, 1, 3).propose_one([4], 3) == []
    assert NgramProposer(3, 1, 3).propose_one([1, 2, 1], 0) == []


# --- greedy: the same tokens as without speculation ---


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 200) for _ in range(rng.randrange(3, 8))]
        out.append({"prompt_token_ids": (base * 6)[: rng.randrange(12, 40)]})
    return out


def _run(llm: LLM, prompts, params) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (c.token_ids, [d[t].logprob for d, t in zip(c.logprobs or [], c.token_ids)])
        for o in outs
        for c in o.outputs
    ]


@pytest.fixture(scope="module")
def draft_dir(make_checkpoint):
    """A smaller random model with the target's vocabulary: a poor but honest drafter."""
    return make_checkpoint("Qwen3ForCausalLM", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def eagle_dir(qwen3_dir, tmp_path_factory):
    """A random EAGLE-1 head for the qwen3 target."""
    from tests.test_eagle import make_eagle_head

    return make_eagle_head(qwen3_dir, tmp_path_factory.mktemp("eagle"))


def _specs(draft_dir, eagle_dir=None) -> dict[str, dict]:
    return {
        "eagle": {"method": "eagle", "model": str(eagle_dir), "num_speculative_tokens": 3},
        "ngram": NGRAM,
        "draft_model": {
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": 3,
        },
        "draft_model_probabilistic": {
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": 2,
            "draft_sample_method": "probabilistic",
        },
        # a draft identical to the target: every greedy draft is accepted
        "self_draft": {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 4},
    }


@pytest.mark.parametrize(
    "method", ["ngram", "draft_model", "draft_model_probabilistic", "self_draft", "eagle"]
)
def test_greedy_outputs_equal_plain_decoding(qwen3_dir, qwen3_llm, draft_dir, eagle_dir, method):
    spec = dict(_specs(draft_dir, eagle_dir)[method])
    if spec.get("model") == "SELF":
        spec["model"] = str(qwen3_dir)
    prompts = _prompts(8)
    stop_params = [
        SamplingParams(temperature=0, max_tokens=m, logprobs=1, ignore_eos=True) for m in (17, 9)
    ]
    expected = _run(qwen3_llm, prompts, stop_params * 4)
    llm = LLM(
        str(qwen3_dir),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_model_len=256,
        max_num_batched_tokens=24,  # chunked prefill, mixed with verifying decodes
        speculative_config=spec,
    )
    got = _run(llm, prompts, stop_params * 4)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, expected):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-4)
    stats = llm.llm_engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > 0
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepted only after accepted
    if method in ("ngram", "self_draft"):
        assert stats.num_accepted_tokens > 0  # repetitive prompts: some drafts pass
    if method == "self_draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    pool = llm.llm_engine.kv_cache_manager.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_preemption_prefix_caching_and_stop_tokens_under_speculation(
    qwen3_dir, qwen3_llm, draft_dir, eagle_dir
):
    from tests.test_engine import small_block_bytes

    prompts = _prompts(6, seed=3)
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:16] + [9, 9]}]  # prefix hit
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _run(qwen3_llm, prompts, greedy)
    # a stop id the plain run emits mid-way: speculation must stop exactly there too
    stop_id = plain[1][0][7]
    stopping = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]
    )
    expected_stop = _run(qwen3_llm, prompts[1:2], stopping)
    specs = _specs(draft_dir, eagle_dir)
    for spec in (NGRAM, specs["draft_model"], specs["eagle"]):
        small = LLM(
            str(qwen3_dir),
            dtype="float32",
            block_size=8,
            max_model_len=64,
            kv_cache_memory_bytes=14
            * small_block_bytes(qwen3_dir, 8)
            * (2 if "model" in spec else 1),
            speculative_config=spec,
        )
        assert _run(small, prompts, greedy) == [(t, []) for t, _ in plain]
        assert small.llm_engine.stats().num_preemptions > 0
        assert _run(small, prompts[1:2], stopping) == [(t, []) for t, _ in expected_stop]
        pool = small.llm_engine.kv_cache_manager.pool
        pool.check_integrity()
        assert pool.num_free_blocks == pool.num_blocks


def test_n_samples_and_penalties_run_under_speculation(qwen3_dir):
    llm = LLM(
        str(qwen3_dir),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        speculative_config=NGRAM,
    )
    params = SamplingParams(
        n=3,
        temperature=0.8,
        seed=5,
        max_tokens=20,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        min_tokens=5,
        logit_bias={7: 1.0},
        ignore_eos=True,
    )
    out = llm.generate(_prompts(2), params, use_tqdm=False)
    again = llm.generate(_prompts(2), params, use_tqdm=False)
    for o, a in zip(out, again):
        assert len(o.outputs) == 3 and all(len(c.token_ids) == 20 for c in o.outputs)
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in a.outputs]  # seeded


# --- sampled: the distribution of continuations is the target's ---


def _exact_joint(model_dir, prompt: list[int], vocab: int, temperature: float) -> dict:
    """P(x1, x2, x3 | prompt) from transformers, over every 3-token continuation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    probs = {}
    with torch.no_grad():
        p1 = (model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        for x1 in range(vocab):
            p2 = (model(torch.tensor([prompt + [x1]])).logits[0, -1] / temperature).softmax(-1)
            seqs = torch.tensor([prompt + [x1, x2] for x2 in range(vocab)])
            p3 = (model(seqs).logits[:, -1] / temperature).softmax(-1)
            for x2, x3 in itertools.product(range(vocab), range(vocab)):
                probs[(x1, x2, x3)] = float(p1[x1] * p2[x2] * p3[x2, x3])
    return probs


def _chi_square_p_value(counts: dict, probs: dict, n: int) -> float:
    """Pearson's test, cells with expected count < 5 pooled into one."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0.0, 0.0
    for cell, p in probs.items():
        expected = n * p
        if expected < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    # Wilson-Hilferty: the chi-square upper tail through a normal approximation
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def small_vocab(make_checkpoint):
    """Vocabulary of 6: every 3-token continuation (216) can be counted."""
    target = make_checkpoint("Qwen3ForCausalLM", vocab_size=6, initializer_range=0.5, seed=4)
    draft = make_checkpoint(
        "Qwen3ForCausalLM", vocab_size=6, initializer_range=0.5, seed=5, num_hidden_layers=1
    )
    return target, draft


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "draft_model", "num_speculative_tokens": 2},
        {
            "method": "draft_model",
            "num_speculative_tokens": 2,
            "draft_sample_method": "probabilistic",
        },
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    ],
    ids=["greedy-drafts", "probabilistic-drafts", "ngram"],
)
def test_sampled_continuations_follow_the_targets_distribution(small_vocab, spec):
    """Fixed seeds; each case fails falsely with probability 1e-3 (the p-value bound)."""
    target, draft = small_vocab
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(draft)}
    prompt = [4, 3, 0, 1, 2, 5]  # every token occurs once: the n-gram proposer always drafts
    temperature, n = 0.9, 6000
    llm = LLM(
        str(target),
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        max_model_len=16,
        max_num_seqs=512,
        seed=11,
        speculative_config=spec,
    )
    params = SamplingParams(
        temperature=temperature, max_tokens=3, ignore_eos=True, detokenize=False
    )
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    counts: dict = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    probs = _exact_joint(target, prompt, 6, temperature)
    assert _chi_square_p_value(counts, probs, n) > 1e-3


def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(qwen3_dir, qwen3_llm):
    prompts = _prompts(4, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    spec_llm = LLM(
        str(qwen3_dir),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        speculative_config={**NGRAM, "num_speculative_tokens": 5},
    )
    for prompt in prompts:
        text = qwen3_llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if not stop.strip():
            continue
        params = SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, logprobs=0, stop=[stop]
        )
        want = qwen3_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    assert spec_llm.llm_engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft_model_probabilistic", "eagle"])
def test_tp2_speculation_matches_tp1(qwen3_dir, qwen3_llm, draft_dir, eagle_dir, method):
    """The draft model (or EAGLE head) is sharded like the target and runs on every rank;
    rank 0's drafts and verification results are broadcast."""
    prompts = _prompts(4, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    spec = _specs(draft_dir, eagle_dir)[method]
    engine = dict(
        dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128, speculative_config=spec
    )
    one = LLM(str(qwen3_dir), **engine)
    two = LLM(str(qwen3_dir), tensor_parallel_size=2, **engine)
    try:
        for params in (greedy, sampled):
            got, want = _run(two, prompts, params), _run(one, prompts, params)
            assert [t for t, _ in got] == [t for t, _ in want]
            for (_, g), (_, w) in zip(got, want):
                assert g == pytest.approx(w, abs=1e-4)
        assert [t for t, _ in _run(two, prompts, greedy)] == [
            t for t, _ in _run(qwen3_llm, prompts, greedy)
        ]
    finally:
        two.llm_engine.shutdown()


def test_the_server_streams_speculative_output_and_exports_its_counters(qwen3_dir, tmp_path):
    import json as _json

    import openai

    from tests.server_utils import RemoteServer, metrics

    spec = _json.dumps({**NGRAM, "num_speculative_tokens": 4})
    server = RemoteServer(
        qwen3_dir,
        [
            "--served-model-name",
            "m",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--kv-cache-memory-bytes",
            "4MiB",
            "--speculative-config",
            spec,
        ],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        prompt = "one two three one two three one two three one two"
        args = dict(model="m", prompt=prompt, max_tokens=40, temperature=0)
        whole = client.completions.create(**args).choices[0].text
        chunks = [c.choices[0].text for c in client.completions.create(**args, stream=True)]
        assert "".join(chunks) == whole
        found = metrics(server)
        drafted = found["minivllm:spec_decode_num_draft_tokens_total"]
        accepted = found["minivllm:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and 0 <= accepted <= drafted
        assert (
            found['minivllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}']
            <= (found["minivllm:spec_decode_num_drafts_total"])
        )
    finally:
        assert server.stop() == 0, server.log()[-3000:]
