"""`GenerateRequest.sampling_params` -> `SamplingParams`, mapped field by field as vLLM's
servicer maps them, within the bounds the HTTP server applies."""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from minivllm.entrypoints.grpc.errors import invalid, unsupported
from minivllm.entrypoints.openai.protocol import MAX_STOP
from minivllm.sampling_params import MAX_GRAMMAR_CHARS, SamplingParams, StructuredOutputsParams

MAX_STOP_CHARS = 1024  # one stop string, as /v1/completions
MAX_TOKEN_IDS = 1024  # stop_token_ids and logit_bias entries, as /v1/completions
# The proto's constraint oneof -> `StructuredOutputsParams`' field for the text kinds.
_TEXT_CONSTRAINTS = {"json_schema": "json", "regex": "regex", "grammar": "grammar"}


def to_sampling_params(params: pb.SamplingParams, max_tokens: int) -> SamplingParams:
    """`max_tokens` is the checked budget (the request's, or the rest of the context).

    Proto3 zeros mean "unset" where vLLM's servicer reads them so: `top_p`,
    `repetition_penalty` and `n` of 0 are 1. Outputs are detokenized only for stop
    strings: a gRPC client reads token ids. Raises StatusError, ValueError or
    TypeError (`SamplingParams`' own checks) naming the field.
    """
    _check_sizes(params)
    return SamplingParams(
        n=params.n or 1,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty or 1.0,
        seed=params.seed if params.HasField("seed") else None,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=params.min_tokens,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        detokenize=bool(params.stop),
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=dict(params.logit_bias) or None,
        structured_outputs=constraint(params),
    )


def constraint(params: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The `constraint` oneof as `StructuredOutputsParams` (xgrammar compiles it when the
    engine admits the request, so a bad schema is the caller's error)."""
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "structural_tag":
        raise unsupported("the structural_tag constraint is not supported by minivllm")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True) if params.json_object else None
    if kind == "choice":
        return StructuredOutputsParams(choice=list(params.choice.choices))
    text = getattr(params, kind)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise invalid(f"{kind} is longer than {MAX_GRAMMAR_CHARS} characters")
    return StructuredOutputsParams(**{_TEXT_CONSTRAINTS[kind]: text})


def _check_sizes(params: pb.SamplingParams) -> None:
    if len(params.stop) > MAX_STOP:
        raise invalid(f"stop has {len(params.stop)} strings; at most {MAX_STOP} are allowed")
    for i, stop in enumerate(params.stop):
        if len(stop) > MAX_STOP_CHARS:
            raise invalid(f"stop[{i}] is longer than {MAX_STOP_CHARS} characters")
    for name in ("stop_token_ids", "logit_bias"):
        size = len(getattr(params, name))
        if size > MAX_TOKEN_IDS:
            raise invalid(f"{name} has {size} entries; at most {MAX_TOKEN_IDS} are allowed")
