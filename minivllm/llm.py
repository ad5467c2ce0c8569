"""`LLM`: vLLM's offline entry point: a list of prompts in, a list of outputs out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.input_processor import PromptType
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate text from a HF checkpoint directory (or a bundled demo model name).

    Keyword arguments are vLLM's: `dtype`, `seed`, `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens`, `block_size`, `kv_cache_memory_bytes`,
    `kv_cache_dtype`, `enable_prefix_caching`, `trust_remote_code`, `device`, `tensor_parallel_size`
    (with `nnodes` and `distributed_init_method` for several hosts),
    `enforce_eager` (every step layer by layer), and minivllm's own `cpu_kernels` and
    `attention_backend`. Unknown keywords raise `TypeError` naming them.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`; each prompt is a str or `{"prompt_token_ids": [...]}`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.llm_engine.add_request(None, prompt, params))
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or `chat_template`) to each conversation and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
            )
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters so far: scheduler state, prefix cache and, with speculative
        decoding, drafts, acceptance rate, mean acceptance length and acceptance per position."""
        stats = self.llm_engine.stats()
        metrics: dict[str, Any] = {
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
        }
        spec = stats.spec_decode
        if spec is not None:
            metrics["spec_decode"] = {
                "num_drafts": spec.num_drafts,
                "num_draft_tokens": spec.num_draft_tokens,
                "num_accepted_tokens": spec.num_accepted_tokens,
                "acceptance_rate": spec.acceptance_rate,
                "mean_acceptance_length": spec.mean_acceptance_length,
                # per draft position: accepted / verifications that drafted it
                "acceptance_rate_per_position": [
                    a / max(d, 1)
                    for a, d in zip(spec.num_accepted_tokens_per_pos, spec.num_draft_tokens_per_pos)
                ],
            }
        return metrics

    def _spec_summary(self) -> str:
        spec = self.llm_engine.stats().spec_decode
        if spec is None or not spec.num_drafts:
            return ""
        return (
            f", drafts accepted {100 * spec.acceptance_rate:.0f}%"
            f", mean accepted length {spec.mean_acceptance_length:.2f}"
        )

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        order = {rid: i for i, rid in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        start, num_out_tokens = time.perf_counter(), 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        num_out_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        rate = num_out_tokens / (time.perf_counter() - start)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s{self._spec_summary()}")
        finally:
            bar.close()
        missing = [rid for rid, r in zip(request_ids, results) if r is None]
        if missing:
            raise RuntimeError(f"requests {missing} ended without an output")
        return results  # type: ignore[return-value]
