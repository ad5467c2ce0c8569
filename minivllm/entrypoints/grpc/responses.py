"""`RequestOutput`s -> `GenerateResponse`s: stream chunks and one `GenerateComplete` per sample.

The messages carry what vLLM's servicer puts in them:

    stream=true:   chunk(index 0, new ids) ... chunk(index 0, last ids) complete(index 0)
                   (the samples of n > 1 interleave; each ends with its own complete)
    stream=false:  complete(index 0, all ids) complete(index 1, all ids) ...

A chunk's `completion_tokens` counts its own ids (the client adds them up); in a
stream the complete repeats the last chunk's ids, as vLLM's does, and carries the
finish reason and the matched stop. The first chunk of each sample carries the
prompt's logprobs.
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from minivllm.entrypoints.openai.serving_engine import finite, top_entries
from minivllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput


def chunk(
    output: RequestOutput,
    completion: CompletionOutput,
    num_logprobs: int | None,
    prompt_logprobs: pb.InputLogProbs | None = None,
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(
            token_ids=completion.token_ids,
            prompt_tokens=len(output.prompt_token_ids),
            completion_tokens=len(completion.token_ids),
            cached_tokens=output.num_cached_tokens,
            output_logprobs=output_logprobs(completion, num_logprobs),
            input_logprobs=prompt_logprobs,
            index=completion.index,
        )
    )


def complete(
    output: RequestOutput,
    completion: CompletionOutput,
    num_logprobs: int | None,
    prompt_logprobs: pb.InputLogProbs | None = None,
) -> pb.GenerateResponse:
    message = pb.GenerateComplete(
        output_ids=completion.token_ids,
        finish_reason=completion.finish_reason or "stop",
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(completion.token_ids),
        cached_tokens=output.num_cached_tokens,
        output_logprobs=output_logprobs(completion, num_logprobs),
        input_logprobs=prompt_logprobs,
        index=completion.index,
    )
    # vLLM's stop_reason: the stop token id or stop string that ended the sample (None
    # for EOS, max_tokens and aborts), which the gateway reports as `matched_stop`.
    if isinstance(completion.stop_reason, int):
        message.matched_token_id = completion.stop_reason
    elif isinstance(completion.stop_reason, str):
        message.matched_stop_str = completion.stop_reason
    return pb.GenerateResponse(complete=message)


def output_logprobs(completion: CompletionOutput, k: int | None) -> pb.OutputLogProbs | None:
    """Per output token: its logprob, and with k > 0 the top-k alternatives."""
    if k is None or not completion.logprobs:
        return None
    message = pb.OutputLogProbs()
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        message.token_ids.append(token_id)
        message.token_logprobs.append(finite(entry[token_id].logprob))
        if k > 0:
            message.top_logprobs.append(_top(entry, k))
    return message


def input_logprobs(
    entries: PromptLogprobs | None, prompt_ids: list[int], k: int | None
) -> pb.InputLogProbs | None:
    """Per prompt token: its logprob (none for the first, which nothing predicts)."""
    if k is None or not entries:
        return None
    message = pb.InputLogProbs()
    for token_id, entry in zip(prompt_ids, entries):
        value = pb.InputTokenLogProb()
        if entry is not None and token_id in entry:
            value.value = finite(entry[token_id].logprob)
        message.token_ids.append(token_id)
        message.token_logprobs.append(value)
        if k > 0:
            message.top_logprobs.append(_top(entry or {}, k))
    return message


def _top(entry: dict[int, Logprob], k: int) -> pb.TopLogProbs:
    ranked = top_entries(entry, k)
    return pb.TopLogProbs(
        token_ids=[token_id for token_id, _ in ranked],
        values=[finite(lp.logprob) for _, lp in ranked],
    )
