"""EAGLE drafting: the engine's head against the plain-PyTorch head fed transformers'
hidden states (a second code path), greedy outputs equal to plain decoding on Llama and
Qwen3 targets, the bundled demo-eagle head, and the checks made before loading."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.spec_decode.eagle import EagleProposer

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _eagle_head_module():
    spec = importlib.util.spec_from_file_location("eagle_head", TOOLS / "eagle_head.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("eagle_head", module)
    spec.loader.exec_module(module)
    return module


eagle_head = _eagle_head_module()


def make_eagle_head(target_dir: Path, out: Path, seed: int = 0) -> Path:
    """A random EAGLE-1 head for the target at `target_dir`, saved as a checkpoint."""
    from transformers import AutoConfig

    config = eagle_head.head_config(AutoConfig.from_pretrained(target_dir))
    torch.manual_seed(seed)
    head = eagle_head.EagleHead(config)
    with torch.no_grad():  # norms away from 1 so a wrong norm placement shows
        for p in head.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    eagle_head.save_head(head, config, out)
    return out


@pytest.fixture(scope="module")
def eagle_dirs(qwen3_dir, make_checkpoint, tmp_path_factory):
    llama = make_checkpoint("LlamaForCausalLM")
    return {
        "qwen3": (qwen3_dir, make_eagle_head(qwen3_dir, tmp_path_factory.mktemp("eq"))),
        "llama": (llama, make_eagle_head(llama, tmp_path_factory.mktemp("el"), seed=1)),
    }


def _prompts(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [
        {"prompt_token_ids": torch.randint(3, 200, (int(10 + 7 * i),), generator=g).tolist()}
        for i in range(n)
    ]


def _record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Wrap the runner's EAGLE proposer: every (tokens so far, drafts) it proposes."""
    proposer = llm.llm_engine.executor.runner.spec_decoder.proposer
    assert isinstance(proposer, EagleProposer)
    seen, inner = [], proposer.propose

    def propose(states, limits):
        out = inner(states, limits)
        seen.extend((list(s.token_ids), out[s.req_id].drafts) for s in states if s.req_id in out)
        return out

    proposer.propose = propose
    return seen


@torch.no_grad()
def _reference_drafts(target, head, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """The head's k greedy drafts after `tokens`, from transformers' features, recomputing
    the whole head sequence per draft (no cache): the second code path. Also the top-2
    margin of each draft's logits."""
    ids = torch.tensor([tokens])
    features = target.model(input_ids=ids).last_hidden_state  # post-norm: what lm_head reads
    embeds = target.model.embed_tokens(ids[:, 1:])
    feats = features[:, :-1]
    drafts, margins = [], []
    for _ in range(k):
        positions = torch.arange(feats.shape[1]).unsqueeze(0)
        predicted = head(embeds, feats, positions)[:, -1:]
        logits = target.lm_head(predicted)[0, -1]
        top2 = logits.topk(2).values
        drafts.append(int(logits.argmax()))
        margins.append(float(top2[0] - top2[1]))
        embeds = torch.cat([embeds, target.model.embed_tokens(torch.tensor([[drafts[-1]]]))], 1)
        feats = torch.cat([feats, predicted], 1)
    return drafts, margins


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_drafts_equal_the_reference_head_on_transformers_features(eagle_dirs, arch):
    from transformers import AutoModelForCausalLM

    target_dir, head_dir = eagle_dirs[arch]
    k = 3
    llm = LLM(
        str(target_dir),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_model_len=256,
        max_num_batched_tokens=16,  # prompts arrive in chunks: features cross steps
        speculative_config={"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k},
    )
    seen = _record_proposals(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(_prompts(4), params, use_tqdm=False)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = eagle_head.load_head(head_dir)
    assert len(seen) >= 8
    compared = 0
    for tokens, drafts in seen:
        want, margins = _reference_drafts(target, head, tokens, len(drafts))
        for got_d, want_d, margin in zip(drafts, want, margins):
            if margin < 1e-3:  # a near-tie may flip either way in float32
                break
            assert got_d == want_d, (tokens, drafts, want)
            compared += 1
            if got_d != want_d:
                break
    assert compared >= len(seen)  # at least one draft per proposal on average


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_eagle_output_equals_plain_decoding(eagle_dirs, arch):
    target_dir, head_dir = eagle_dirs[arch]
    engine = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (17, 9)
    ]
    prompts = _prompts(6)
    plain = LLM(str(target_dir), **engine).generate(prompts, params * 3, use_tqdm=False)
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 4}
    llm = LLM(
        str(target_dir),
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        speculative_config=spec,
        **engine,
    )
    got = llm.generate(prompts + prompts[:2], params * 4, use_tqdm=False)  # prefix hits too
    for g, w in zip(got, list(plain) + list(plain[:2])):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        got_lps = [d[t].logprob for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        want_lps = [d[t].logprob for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]
        assert got_lps == pytest.approx(want_lps, abs=1e-4)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_draft_tokens > 0
    pool = llm.llm_engine.kv_cache_manager.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_the_bundled_demo_eagle_head_drafts_for_demo_base():
    """demo-eagle was trained on demo-base's features (tools/train_eagle.py); if the engine
    fed it anything else (pre-norm states, shifted tokens, wrong positions) its drafts
    would be as poor as a random head's."""
    prompts = [
        "The for statement in Python",
        "To open a file for reading, the",
        "This module provides functions for",
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM("demo-base", dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(
        "demo-base",
        dtype="float32",
        speculative_config={"method": "eagle", "model": "demo-eagle", "num_speculative_tokens": 3},
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.3


def test_a_head_for_another_target_is_refused_before_loading(eagle_dirs, make_checkpoint):
    wider = make_checkpoint("Qwen3ForCausalLM", hidden_size=96)
    _, head_dir = eagle_dirs["qwen3"]
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="hidden size"):
        LLM(str(wider), dtype="float32", speculative_config=spec)
    with pytest.raises(ValueError, match="one layer"):
        LLM(str(wider), speculative_config={**spec, "model": str(wider)})
    with pytest.raises(ValueError, match="demo-eagle"):
        LLM(str(wider), speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="EAGLE draft head"):
        LLM(str(head_dir))  # a head is not a model to serve
