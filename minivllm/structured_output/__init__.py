"""Structured output: a grammar (JSON schema, JSON, regex, choice, EBNF) masks each step's logits.

`StructuredOutputsParams` (in `sampling_params`) says what a request must produce;
`backend.GrammarBackend` compiles it with xgrammar, the engine vLLM uses, whose CPU
token-bitmask fill is what makes per-step masking cheap; `manager.StructuredOutputManager`
keeps one matcher per request in the model runner, fills the bitmask rows before sampling
and advances the matchers with the tokens that were sampled.
"""
