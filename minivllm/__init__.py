"""minivllm: a compact, readable LLM inference and serving engine with vLLM's interface."""

from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput, TokensPrompt
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "TokensPrompt", "RequestOutput", "CompletionOutput", "Logprob"]
