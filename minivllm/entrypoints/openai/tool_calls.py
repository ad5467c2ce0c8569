"""Tool calls in chat completions: what `tool_choice` constrains, and how calls are read back.

- `tool_choice` "none": the tools reach the chat template, the reply is plain text.
- a named function: the output is constrained to that function's `parameters` schema
  and returned as one call (finish_reason "stop", as OpenAI answers a forced call).
- "required": the output is constrained to a JSON array of {"name", "parameters"}
  objects, one schema branch per tool (one item only when parallel_tool_calls is false),
  and every item becomes a call (finish_reason "tool_calls").
- "auto" (the default when tools are given): the model decides; its text is read by the
  server's `--tool-call-parser`, which `--enable-auto-tool-choice` requires, as in vLLM.

Parsers: `hermes` reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, the format of Hermes, Qwen2.5 and Qwen3 chat templates.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from minivllm.entrypoints.openai.errors import APIError
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from minivllm.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)


@dataclass(slots=True)
class ToolPlan:
    mode: str  # "none", "named", "required" or "auto"
    tools: list[dict[str, Any]] | None  # for the chat template
    constraint: StructuredOutputsParams | None
    name: str | None = None  # the named function


def plan_tools(request: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """How this request uses its tools; 400 for a choice the request or server cannot serve."""
    choice, tools = request.tool_choice, request.tools
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs a non-empty tools list", "tool_choice")
        return ToolPlan("none", None, None)
    for_template = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice == "none":
        return ToolPlan("none", for_template, None)
    if _constrained_elsewhere(request) and choice is not None and choice != "auto":
        raise APIError(
            400, "tool_choice and response_format/guided_* constrain the same output", "tool_choice"
        )
    if choice == "required":
        schema = _required_schema(tools, request.parallel_tool_calls)
        return ToolPlan("required", for_template, StructuredOutputsParams(json=schema))
    if choice is not None and choice != "auto":  # a named function
        by_name = {tool.function.name: tool for tool in tools}
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise APIError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not in tools "
                f"({', '.join(by_name)})",
                "tool_choice",
            )
        schema = tool.function.parameters or {"type": "object"}
        return ToolPlan(
            "named", for_template, StructuredOutputsParams(json=schema), tool.function.name
        )
    if parser is None:
        raise APIError(
            400,
            '"auto" tool choice (the default when tools are given) needs a server started with '
            "--enable-auto-tool-choice --tool-call-parser hermes; or pass tool_choice "
            '"required", "none" or a named function',
            "tool_choice",
        )
    return ToolPlan("auto", for_template, None)


def _constrained_elsewhere(request: ChatCompletionRequest) -> bool:
    fmt = request.response_format
    return (fmt is not None and fmt.type != "text") or any(
        getattr(request, f) is not None
        for f in (
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        )
    )


def _required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished reply under `plan`. A constrained reply that
    does not parse (cut off by max_tokens) stays content, with no calls."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [new_call(plan.name, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [
            new_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in items
        ]
    if plan.mode == "auto":
        return parse_hermes(text)
    return text, []


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-format calls out of free text; blocks that are not JSON with a "name" stay text."""
    calls, spans = [], []
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(new_call(body["name"], arguments))
        spans.append(match.span())
    if not calls:
        return text, []
    rest, last = [], 0
    for start, end in spans:
        rest.append(text[last:start])
        last = end
    rest.append(text[last:])
    content = "".join(rest).strip()
    return content or None, calls
