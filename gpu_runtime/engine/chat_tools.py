"""A chat rendered with tools: the base's own chat template given `tools` (transformers' apply_chat_template), whether
that template takes tools at all, and which family's call format it teaches the model (the app's parser picks on it).
"""

from __future__ import annotations

from typing import Any, cast

import jinja2
import jinja2.meta

from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.errors import BadInput

# A marker each family's template writes, first match wins (GPT-OSS's harmony also says "tool" everywhere).
FAMILY_MARKERS = (("gpt_oss", "<|channel|>"), ("hermes", "<tool_call>"), ("llama3_json", "<|python_tag|>"),
                  ("llama3_json", "ipython"))


def template_of(tokenizer: Any, tools: bool) -> str | None:
    """The template apply_chat_template would use: a dict of named ones gives `tool_use` to a call with tools."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use" if tools and "tool_use" in template else "default")
    return template if isinstance(template, str) else None


def takes_tools(template: str) -> bool:
    """Whether the template reads a `tools` variable (a template that never does would silently drop them)."""
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return "tools" in template


def tool_format(template: str | None) -> str | None:
    """The call format the template teaches: "hermes", "llama3_json" or "gpt_oss"; None when it names none."""
    for family, marker in FAMILY_MARKERS:
        if template is not None and marker in template:
            return family
    return None


def render_messages(tokenizer: Any, messages: list[JSONObject], tools: list[JSONObject] | None,
                    prefill: str | None, history: tuple[list[int], int] | None = None) -> list[int]:
    """The conversation's ids with the generation prompt opened (tokenize=True: the template's own BOS, once), then
    `prefill`'s (the opening of a forced tool call: special tokens in it read as such). With `history` (the ids an
    assistant turn was sampled as, its prompt's included, and that turn's index), those ids replace the rendering
    of every message through that turn where they can (reused_history)."""
    template = template_of(tokenizer, bool(tools))
    if template is None:
        raise BadInput("this model has no chat template: use /v1/completions with a prompt", field="messages")
    if tools and not takes_tools(template):
        raise BadInput("this model's chat template takes no tools: it cannot be given tool definitions",
                       field="tools")
    reused = reused_history(tokenizer, messages, tools, *history) if history is not None else None
    if reused is not None:
        ids = reused
    else:
        rendered = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)
        ids = [int(t) for t in cast(list[int], rendered)]  # tokenize=True, one conversation: its ids
    if prefill:
        ids += [int(t) for t in tokenizer(prefill, add_special_tokens=False)["input_ids"]]
    return ids


TURN_MARKER = "<<signal-sampled-turn-5f3c>>"  # stands for a sampled turn's content while the rest is rendered


def reused_history(tokenizer: Any, messages: list[JSONObject], tools: list[JSONObject] | None,
                   history: list[int], through: int) -> list[int] | None:
    """`history` (the ids messages[:through + 1] were sampled as) and then the rendering of what follows that turn
    (its end as the template writes it, the later messages, the generation prompt), so a later turn's prompt is
    exactly what the model saw and wrote: no re-rendering of an earlier answer from its text. None (render it all)
    when the template drops the turn's content or renders the messages before it other than `history` begins."""
    marked = [*messages[:through], {"role": "assistant", "content": TURN_MARKER}, *messages[through + 1:]]
    text = cast(str, tokenizer.apply_chat_template(marked, tools=tools or None, tokenize=False,
                                                   add_generation_prompt=True))
    at = text.find(TURN_MARKER)
    if at < 0:
        return None
    before = [int(t) for t in tokenizer(text[:at], add_special_tokens=False)["input_ids"]]  # as tokenize=True does
    if history[:len(before)] != before:  # other instructions, tools or messages than that turn's prompt had
        return None
    after = tokenizer(text[at + len(TURN_MARKER):], add_special_tokens=False)["input_ids"]
    return list(history) + [int(t) for t in after]
