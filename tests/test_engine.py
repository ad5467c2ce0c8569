"""End-to-end engine behaviour through the offline `LLM` API."""

from __future__ import annotations

import random

import pytest
import torch

from minivllm import LLM, SamplingParams


def _prompts(n: int, lo: int = 3, hi: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))]}
        for _ in range(n)
    ]


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_logprobs_match_transformers(qwen3_dir, qwen3_llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    prompts = _prompts(3)
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    for prompt, out in zip(prompts, qwen3_llm.generate(prompts, params, use_tqdm=False)):
        ids = prompt["prompt_token_ids"]
        completion = out.outputs[0]
        full = ids + completion.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([full])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert entry[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
            assert len(entry) in (2, 3)
        cumulative = 0.0
        for step, token in enumerate(completion.token_ids):
            row = ref[len(ids) - 1 + step]
            entry = completion.logprobs[step]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == 1  # greedy picks the top token
            top3 = row.topk(3).indices.tolist()
            assert set(top3) <= set(entry)
            cumulative += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)


def test_prefix_caching_on_and_off_agree_and_hits_are_reported(qwen3_dir):
    shared = [random.Random(1).randrange(3, 500) for _ in range(40)]
    prompts = [{"prompt_token_ids": shared + [10 + i, 20 + i]} for i in range(4)]
    runs = {}
    for caching in (False, True):
        llm = LLM(
            str(qwen3_dir),
            dtype="float32",
            kv_cache_memory_bytes=8 << 20,
            max_model_len=256,
            enable_prefix_caching=caching,
            block_size=8,
        )
        together = llm.generate(prompts, GREEDY, use_tqdm=False)
        one_by_one = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        runs[caching] = (together, one_by_one)
    assert _tokens(runs[False][0]) == _tokens(runs[True][0]) == _tokens(runs[True][1])
    assert all(o.num_cached_tokens == 0 for o in runs[False][1])
    # one after another: 40 shared tokens = 5 full blocks of 8 are served from the cache
    assert [o.num_cached_tokens for o in runs[True][1]] == [40, 40, 40, 40]
    # sent together, the first computes the prefix; blocks cached at allocation serve the rest
    assert runs[True][0][0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in runs[True][0][1:])


def test_preemption_keeps_outputs_identical(qwen3_dir, qwen3_llm):
    prompts = _prompts(6, lo=20, hi=30)
    expected = _tokens(qwen3_llm.generate(prompts, GREEDY, use_tqdm=False))
    # 12 blocks of 8 tokens: 6 requests of ~45 tokens cannot all stay resident
    small = LLM(
        str(qwen3_dir),
        dtype="float32",
        block_size=8,
        max_model_len=64,
        kv_cache_memory_bytes=12 * small_block_bytes(qwen3_dir, 8),
    )
    assert _tokens(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert small.llm_engine.stats().num_preemptions > 0
    small.llm_engine.kv_cache_manager.pool.check_integrity()
    assert small.llm_engine.kv_cache_manager.pool.num_free_blocks == 12


def small_block_bytes(model_dir, block_size: int) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * 4


def test_chunked_prefill_keeps_outputs_identical(qwen3_dir, qwen3_llm):
    prompts = _prompts(4, lo=20, hi=60)
    expected = _tokens(qwen3_llm.generate(prompts, GREEDY, use_tqdm=False))
    chunked = LLM(
        str(qwen3_dir),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_model_len=256,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
    )
    engine = chunked.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    saw_chunk = set()
    outputs = {}
    while engine.has_unfinished_requests():
        for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            if 0 < req.num_computed_tokens < req.num_prompt_tokens:
                saw_chunk.add(req.request_id)
        for out in engine.step():
            outputs[out.request_id] = out
        engine.kv_cache_manager.pool.check_integrity()
    assert saw_chunk == {"0", "1", "2", "3"}  # every prompt was split across steps
    assert [outputs[str(i)].outputs[0].token_ids for i in range(4)] == expected


def test_seeded_sampling_is_independent_of_the_batch(qwen3_llm):
    prompt = _prompts(1)[0]
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = qwen3_llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(5, seed=7)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 5 + [seeded]
    mixed = qwen3_llm.generate(others + [prompt], params, use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone
    again = qwen3_llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_n_samples_are_distinct_and_reproducible(qwen3_llm):
    prompt = _prompts(1)[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    (out,) = qwen3_llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) > 1
    (again,) = qwen3_llm.generate([prompt], params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_text_matches_tokenizer_decode_and_stop_strings(qwen3_llm):
    tokenizer = qwen3_llm.get_tokenizer()
    prompts = ["def main(", "import os", "return x", "class A:", "for i in"]
    outs = qwen3_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    for out in outs:
        c = out.outputs[0]
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert out.prompt_token_ids == tokenizer(out.prompt).input_ids
    prompt, cut_at, stop = _cross_token_stop(tokenizer, outs)
    full = next(o.outputs[0].text for o in outs if o.prompt == prompt)
    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        got = qwen3_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert got.text == full[: cut_at + (len(stop) if include else 0)]
        assert got.finish_reason == "stop" and got.stop_reason == stop


def _cross_token_stop(tokenizer, outs) -> tuple[str, int, str]:
    """A 2-character stop string whose characters come from two different tokens."""
    for out in outs:
        c = out.outputs[0]
        for k in range(1, len(c.token_ids)):
            prefix = tokenizer.decode(c.token_ids[:k])
            if not prefix or "\ufffd" in prefix or not c.text.startswith(prefix):
                continue
            stop = c.text[len(prefix) - 1 : len(prefix) + 1]
            if len(stop) == 2 and "\ufffd" not in stop and c.text.find(stop) == len(prefix) - 1:
                return out.prompt, len(prefix) - 1, stop
    raise AssertionError("no cross-token stop string found in the greedy outputs")


def test_stop_token_ids_min_and_max_tokens(qwen3_llm):
    prompt = _prompts(1)[0]
    free = qwen3_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    got = qwen3_llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert got.token_ids == free.token_ids[: first + 1]
    assert got.finish_reason == "stop" and got.stop_reason == stop_id
    # min_tokens forbids the stop token until enough tokens exist
    got = qwen3_llm.generate(
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=10,
            ignore_eos=True,
            stop_token_ids=[stop_id],
            min_tokens=first + 2,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert stop_id not in got.token_ids[: first + 2]


def test_eos_from_generation_config_stops(make_checkpoint, tmp_path):
    import json
    import shutil

    src = make_checkpoint("Qwen3ForCausalLM")
    model_dir = tmp_path / "m"
    shutil.copytree(src, model_dir)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=64)
    prompt = _prompts(1)[0]
    free = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    eos = free.token_ids[2]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eos]}))
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=64)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[
        0
    ].outputs[0]
    first = free.token_ids.index(eos)
    assert got.token_ids == free.token_ids[: first + 1] and got.finish_reason == "stop"


def test_abort_frees_blocks(qwen3_llm):
    engine = qwen3_llm.llm_engine
    engine.add_request("x", _prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.pool.num_free_blocks < engine.kv_cache_manager.pool.num_blocks
    (out,) = engine.abort_request("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    engine.kv_cache_manager.pool.check_integrity()
    assert all(b.ref_cnt == 0 for b in engine.kv_cache_manager.pool.blocks)


def test_chat_uses_the_template(qwen3_llm):
    messages = [{"role": "user", "content": "hello"}]
    (out,) = qwen3_llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    tokenizer = qwen3_llm.get_tokenizer()
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) >= 1
