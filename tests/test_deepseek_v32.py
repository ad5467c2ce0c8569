"""DeepSeek-V3.2 (MLA + DSA indexer + MoE) against transformers' DeepseekV32ForCausalLM.

Tiny random checkpoints whose `index_topk` (16) is well below the prompts' lengths, so the
indexer's selection decides what each query attends to; float32 throughout, so the only
difference from the oracle is summation order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers.attention.dsa import (
    indexer_topk,
    mla_decode,
    mla_prefill,
    selection_mask,
)
from minivllm.layers.moe import FusedMoE, GroupedTopKRouter
from tests.conftest import assert_logprobs_match, hf_greedy

DSA = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    # 16 index heads: a key scores exactly 0 (a tie) only if all 16 ReLUs zero it
    index_n_heads=16,
    index_head_dim=16,
    index_topk=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
YARN = dict(
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=128,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
)
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20)


# GLM-MoE-DSA: the same dimensions, interleaved indexer RoPE, and two layers that reuse
# the selection of the full layer before them
GLM = dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"])


def build_dsa_checkpoint(
    out: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    round_to_bf16: bool = False,
    glm: bool = False,
    **overrides,
) -> Path:
    """A random DeepseekV32ForCausalLM (`glm`: GlmMoeDsaForCausalLM); the routers'
    load-balancing biases are random too (transformers initialises them to zero, which
    would leave that path untested). `round_to_bf16`: every weight a bf16 value (stored
    in fp32), as a bf16 checkpoint's are in an fp32 engine, where the AVX2 family holds
    such linears as bf16 panels."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV32Config, GlmMoeDsaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config_class = GlmMoeDsaConfig if glm else DeepseekV32Config
    config = config_class(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **{**DSA, **overrides}
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
        # transformers zeroes the pad token's embedding row; the pad is the EOS here, which
        # greedy decoding with ignore_eos emits, and a zero hidden state makes layer 0's
        # index query zero: every key ties at score 0 and the oracle's selection is arbitrary
        emb = model.get_input_embeddings().weight
        emb[eos] = torch.randn_like(emb[eos]) * config.initializer_range
        if round_to_bf16:
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dsa_checkpoint(tmp_path_factory, tokenizer_dir):
    made: dict[str, Path] = {}

    def make(name: str = "moe", **overrides) -> Path:
        if name not in made:
            made[name] = build_dsa_checkpoint(
                tmp_path_factory.mktemp(f"dsa-{name}"), tokenizer_dir, **overrides
            )
        return made[name]

    return make


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(
    temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1
)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("moe", {}),
        ("dense-yarn", dict(first_k_dense_replace=3, **YARN)),
        # bf16-valued weights: the fp32 engine's linears, kv_b_proj included, on bf16 panels
        ("moe-bf16-valued", dict(round_to_bf16=True)),
        ("glm-moe-dsa", dict(glm=True, **GLM)),
    ],
)
def test_logprobs_and_greedy_match_transformers(dsa_checkpoint, name, overrides) -> None:
    """Prompt and sampled logprobs within 1e-4 of transformers, greedy tokens equal, for
    prompts shorter and far longer than index_topk (prefill sparse, decode sparse)."""
    path = dsa_checkpoint(name, **overrides)
    prompts = _prompts([5, 40, 90])
    llm = LLM(str(path), **ENGINE)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    if llm.llm_engine.executor.runner.kernels.module is not None:
        # the compiled routing (moe_routing.cpp) is what ran
        routers = [
            m
            for m in llm.llm_engine.executor.runner.model.modules()
            if isinstance(m, GroupedTopKRouter)
        ]
        assert bool(routers) == ("moe" in name)
        assert all(r.topk_op is not None for r in routers)
        # a bf16 checkpoint's experts (bf16 values) as bf16 panels, run by moe_bf16w
        for m in llm.llm_engine.executor.runner.model.modules():
            if isinstance(m, FusedMoE):
                assert (m.panels_op is not None) == ("bf16-valued" in name)
                assert m.w13.dtype == (torch.bfloat16 if "bf16-valued" in name else torch.float32)
    hf = _hf(path)
    assert_logprobs_match(hf, prompts, outputs)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 12)


def test_selection_matters(dsa_checkpoint, tokenizer_dir, tmp_path) -> None:
    """The same weights with an index_topk past every length (dense attention) give other
    logprobs past position 16: the test above really exercises sparse attention."""
    sparse_path = dsa_checkpoint("moe")
    dense_path = build_dsa_checkpoint(tmp_path, tokenizer_dir, index_topk=1024)
    prompt = _prompts([60])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    got = [
        LLM(str(p), **ENGINE).generate([{"prompt_token_ids": prompt[0]}], params, use_tqdm=False)[0]
        for p in (sparse_path, dense_path)
    ]
    lps = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in got]
    assert lps[0][:16] == pytest.approx(lps[1][:16], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(lps[0][16:], lps[1][16:])) > 1e-3


@pytest.mark.parametrize("name", ["moe", "glm-moe-dsa"])
def test_prefix_caching_chunked_prefill_and_preemption(dsa_checkpoint, name) -> None:
    """Shared prefixes (cache hits), 24-token prefill chunks and a KV budget too small for
    all requests at once (preemption and recompute) change no greedy token."""
    glm = name.startswith("glm")
    path = dsa_checkpoint(name, **(dict(glm=True, **GLM) if glm else {}))
    base = _prompts([70], seed=1)[0]
    prompts = [base + p for p in _prompts([3, 20, 35, 8], seed=2)] + _prompts([50, 64], seed=3)
    want = hf_greedy(path, prompts, 16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        # 16 blocks of 16 tokens (3 layers x [latent 40 | index key 16] floats a token;
        # GLM: 4 layers, the 2 shared ones without index keys): under two full requests
        kv_cache_memory_bytes=16 * 16 * (4 * 40 + 2 * 16 if glm else 3 * (40 + 16)) * 4,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = llm.llm_engine.scheduler
    assert stats.kv.num_hits > 0
    assert stats.num_preemptions > 0


def test_ngram_speculative_decoding_keeps_greedy_tokens(dsa_checkpoint) -> None:
    """Verifying drafts runs the absorbed decode with several query rows per request."""
    path = dsa_checkpoint("moe")
    prompts = [p * 3 for p in _prompts([20, 30], seed=4)]  # repetitive: n-gram drafts hit
    want = hf_greedy(path, prompts, 16)
    llm = LLM(
        str(path),
        **ENGINE,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
        },
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0


def test_absorbed_decode_equals_mha_form() -> None:
    """The two MLA forms agree on random inputs with a sparse mask (reference vs reference)."""
    torch.manual_seed(0)
    heads, nope, rope, v, lora, length = 4, 16, 8, 16, 32, 40
    kv_b = torch.nn.Linear(lora, heads * (nope + v), bias=False)
    latent = torch.randn(length, lora + rope)
    q = torch.randn(3, heads, nope + rope)
    rows = torch.stack([torch.randperm(length)[:10] for _ in range(3)]).sort(dim=1).values
    rows[1, 7:] = -1  # fewer than k tokens
    mask = selection_mask(rows, length)
    w = kv_b.weight.view(heads, nope + v, lora)
    with torch.no_grad():
        mha = mla_prefill(q, latent, kv_b, mask, 0.2, lora, v)
        absorbed = mla_decode(q, latent, w[:, :nope], w[:, nope:], rows, 0.2)
    torch.testing.assert_close(absorbed, mha, atol=1e-5, rtol=1e-5)


def test_indexer_topk_against_transformers_indexer() -> None:
    """Our scoring + selection picks exactly the keys transformers' indexer picks."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    config = DeepseekV32Config(**DSA)
    torch.manual_seed(0)
    indexer = DeepseekV32Indexer(config, 0).eval()
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seq = 50
    hidden = torch.randn(1, seq, DSA["hidden_size"])
    q_resid = torch.randn(1, seq, DSA["q_lora_rank"])
    rope = DSA["qk_rope_head_dim"]
    cos, sin = torch.ones(1, seq, rope), torch.zeros(1, seq, rope)  # rotation tested elsewhere
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().unsqueeze(0)
    with torch.no_grad():
        want = indexer(hidden, q_resid, (cos, sin), causal, None).long()[0]
        q = indexer.wq_b(q_resid[0]).view(seq, 16, 16)
        k = indexer.k_norm(indexer.wk(hidden[0]))
        w = indexer.weights_proj(hidden[0]) * 16**-0.5
        got = indexer_topk(
            q,
            w,
            torch.arange(seq).unsqueeze(0),  # token t's key is row t
            torch.zeros(seq, dtype=torch.long),
            torch.arange(seq),
            k,
            None,
            DSA["index_topk"],
            16**-0.5,
        )
    for s in range(seq):
        expected = sorted(t for t in want[s].tolist() if t <= s)
        assert [t for t in got[s].tolist() if t >= 0] == expected


# bf16-valued: on the AVX2 kernels each rank holds its experts' slices as bf16 panels;
# GLM's float32 values keep them float32
@pytest.mark.parametrize("name", ["moe-bf16-valued", "glm-moe-dsa"])
def test_tensor_parallel_2_matches_transformers(dsa_checkpoint, name) -> None:
    """Heads, dense MLPs and every expert's intermediate dimension split over two ranks;
    latent cache and indexer replicated (each rank selects the same tokens)."""
    glm = name.startswith("glm")
    path = dsa_checkpoint(name, **(dict(glm=True, **GLM) if glm else dict(round_to_bf16=True)))
    prompts = _prompts([30, 70], seed=5)
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    hf = _hf(path)
    assert_logprobs_match(hf, prompts, outputs)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 12)


def test_bf16_kernels_agree_with_plain_pytorch(dsa_checkpoint) -> None:
    """The compiled indexer top-k, sparse attention (absorbed form, prefill and decode)
    and MoE ops, where this CPU has them, are as accurate as plain PyTorch in bf16: both
    runs' prompt logprobs against the float32 engine's (bf16 rounding alone moves this
    random model's logprobs by ~0.1 on average)."""
    path = dsa_checkpoint("moe")
    prompts = _prompts([40, 90], seed=10)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)

    def prompt_logprobs(**kwargs) -> list[float]:
        outs = LLM(str(path), max_model_len=256, **kwargs).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]

    exact = prompt_logprobs(dtype="float32")
    compiled = prompt_logprobs(dtype="bfloat16", cpu_kernels=True)
    plain = prompt_logprobs(dtype="bfloat16", cpu_kernels=False)

    def error(got: list[float]) -> float:
        return sum(abs(a - b) for a, b in zip(got, exact)) / len(exact)

    assert error(compiled) < 1.5 * error(plain) + 0.01
    assert error(plain) < 0.3


def test_demo_sparse_logprobs_match_transformers() -> None:
    """The bundled demo-sparse (trained weights; index_topk 64, 4 index heads) on a
    70-token prompt and 12 greedy tokens. With 4 index heads exact score ties are real,
    and transformers breaks them by its row length: its logprob at a position can change
    with the length of what follows. Positions where its own answers for the whole
    sequence and for the sequence cut after the position disagree are skipped (there
    must be few); every other one must match to 1e-4."""
    from minivllm.loader.hub import resolve_model_path

    hf = _hf(resolve_model_path("demo-sparse", None, None))
    prompt = _prompts([70], seed=12)[0]
    out = LLM("demo-sparse", **ENGINE).generate(
        [{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False
    )[0]
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        whole = hf(torch.tensor([full])).logits[0].log_softmax(-1)
    checked = 0
    for pos in range(1, len(full)):
        token = full[pos]
        with torch.no_grad():
            cut = hf(torch.tensor([full[:pos]])).logits[0, -1].log_softmax(-1)
        if abs(cut[token] - whole[pos - 1, token]) > 1e-5:
            continue  # transformers contradicts itself here (a tie at the top-k boundary)
        if pos < len(prompt):
            ours = out.prompt_logprobs[pos][token].logprob
        else:
            ours = out.outputs[0].logprobs[pos - len(prompt)][token].logprob
        assert abs(ours - whole[pos - 1, token].item()) < 1e-4, pos
        checked += 1
    assert checked >= 0.8 * (len(full) - 1)
