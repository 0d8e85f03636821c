"""Tool calling's request side on /v1: `tools`, `tool_choice`, `parallel_tool_calls` checked, bounded, and turned into
what the runtime renders (the base's chat template given the tools) and how the answer is read back
(app/openai/tool_parsers.py). Every refusal is a 400 naming the parameter.

A forced `tool_choice` (a named function, or `required`) ends the prompt with the opening of a call in the template's
format (tool_parsers.NAMED_HEADS / ANY_HEADS), so the model writes the arguments (or, for `required`, the name and
arguments): that opening is part of `prompt_token_ids`, the model's own tokens are the completion's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from app.openai import tool_parsers
from app.openai.errors import bad
from gpu_runtime.contract.json_types import JSON, JSONObject, as_json, as_object, get_str

MAX_TOOLS = 128  # OpenAI's own bound on tools per request
MAX_TOOL_BYTES = 16_384  # one tool's definition, as JSON
MAX_TOOLS_BYTES = 65_536  # all of them: they are rendered into every prompt
MAX_MESSAGES = 1_024  # a conversation's history
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class Tools:
    """A request's tools: definitions for the template, the choice, and the names a call may use."""

    definitions: list[JSONObject] = field(default_factory=list)
    choice: str = "auto"  # auto | none | required | named
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True
    family: str | None = None  # the template's call format, once rendered (RenderChatResult.tool_format)
    forced: str | None = None  # the forced call's opening the prompt ends with

    @property
    def names(self) -> set[str]:
        return {function_name(d) for d in self.definitions}

    @property
    def parsing(self) -> bool:
        return bool(self.definitions) and self.choice != "none"

    def head(self, family: str | None) -> str | None:
        """The prompt's forced opening of a call, if the choice forces one."""
        family = family or tool_parsers.DEFAULT_FAMILY
        if self.choice == "named":
            return tool_parsers.NAMED_HEADS[family] % self.named
        if self.choice == "required":
            return tool_parsers.ANY_HEADS[family]
        return None


def function_name(entry: Mapping[str, object]) -> str:
    """The function a definition or a call names (both are {function: {name, …}}, checked when built)."""
    return get_str(as_object(entry["function"], "function"), "name")


def _function(tool: object, i: int) -> JSONObject:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad(param, f"{param} must be {{type: 'function', function: {{name, description, parameters}}}}")
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not NAME.match(function["name"]):
        raise bad(f"{param}.function.name", f"{param}.function.name must be 1-64 letters, digits, '_', '-' or '.'")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise bad(f"{param}.function.description", f"{param}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"{param}.function.parameters", f"{param}.function.parameters must be a JSON schema object")
    size = len(json.dumps(tool))
    if size > MAX_TOOL_BYTES:
        raise bad(param, f"{param} is {size} bytes as JSON; at most {MAX_TOOL_BYTES}")
    kept = {k: function[k] for k in ("name", "description", "parameters") if function.get(k) is not None}
    return {"type": "function", "function": kept}


def definitions(tools: object) -> list[JSONObject]:
    """Chat completions' `tools`, checked and bounded."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list of function definitions")
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    out = [_function(tool, i) for i, tool in enumerate(tools)]
    if len({function_name(d) for d in out}) < len(out):
        raise bad("tools", "tools has two functions of the same name")
    size = len(json.dumps(out))
    if size > MAX_TOOLS_BYTES:
        raise bad("tools", f"tools are {size} bytes as JSON; at most {MAX_TOOLS_BYTES}")
    return out


def from_body(body: Mapping[str, object], defs: list[JSONObject]) -> Tools:
    """`tool_choice` and `parallel_tool_calls` against the request's tools."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) not in (None, "none", []):
            raise bad(legacy, f"{legacy} is the deprecated form: use tools and tool_choice")
    tools = Tools(definitions=defs)
    choice = body.get("tool_choice")
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        tools.choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else \
            choice.get("name")  # the Responses API's {type, name}
        if name not in tools.names:
            raise bad("tool_choice", f"tool_choice names {name!r}, which is not one of tools")
        tools.choice, tools.named = "named", name
    elif choice is not None:
        raise bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or {type: 'function', function: "
                                 "{name}}")
    if tools.choice != "none" and choice is not None and not defs:  # as OpenAI: only with tools
        raise bad("tool_choice", f"tool_choice {choice!r} needs tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be true or false")
    tools.parallel = parallel is not False
    return tools


def _arguments(text: object, param: str) -> JSON:
    """A call's arguments as the template wants them: an object (Hermes, Llama and harmony templates tojson them)."""
    if not isinstance(text, str):
        raise bad(param, f"{param} must be a JSON string")
    try:
        return as_json(json.loads(text))
    except ValueError:
        return text  # what the model wrote, kept as it was so the history renders as it was sampled


def assistant_calls(calls: object, i: int) -> list[JSONObject]:
    """An assistant message's `tool_calls` in the template's shape."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(param, f"{param} must be a list")
    out: list[JSONObject] = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{param}[{j}]", f"{param}[{j}] must be {{id, type: 'function', function: {{name, arguments}}}}")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": function["name"],
                                 "arguments": _arguments(function.get("arguments", "{}"), f"{param}[{j}].function"
                                                                                          ".arguments")}})
    return out


def tool_message(message: Mapping[str, object], content: str, i: int, names: dict[str, str]) -> JSONObject:
    """A `tool` message: its result, the call it answers and that call's function name (templates print either)."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"messages[{i}].tool_call_id", f"messages[{i}]: a tool message needs tool_call_id")
    return {"role": "tool", "content": content, "tool_call_id": call_id,
            "name": names.get(call_id, str(message.get("name") or ""))}


def check_history(messages: object) -> None:
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise bad("messages", f"messages has {len(messages)} entries; at most {MAX_MESSAGES}")
