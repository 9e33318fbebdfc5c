"""Tool calls through a model's own chat template: OpenAI's `tools` go to the template (which tells the model how
to call them), and the model's answer is read back for calls.

Two written forms are read, those of the families leanlm's models come from: Qwen 2.5's (and Hermes') JSON
objects between `<tool_call>` and `</tool_call>`, and Llama 3.x's answer that is one JSON object with `name` and
`parameters` (or `arguments`). `tool_choice: "required"` or a named function is enforced rather than hoped for,
with a grammar (llguidance's Lark with an embedded JSON schema) that admits only a `<tool_call>` block calling
one of the allowed functions with arguments of its schema; that needs a template of the `<tool_call>` form.
"""

from __future__ import annotations

import json
import re
import uuid

TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_takes_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def template_tags_calls(tokenizer) -> bool:
    return "<tool_call>" in (getattr(tokenizer, "chat_template", None) or "")


def read_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the answer's text besides its calls, or None; the calls in OpenAI's form), from what the model wrote."""
    calls, rest = [], text
    for match in TAGGED.finditer(text):
        call = _call(match.group(1))
        if call is not None:
            calls.append(call)
            rest = rest.replace(match.group(0), "", 1)
    if not calls and text.strip().startswith("{"):
        call = _call(text.strip())
        if call is not None:
            calls, rest = [call], ""
    if not calls:
        return text, []
    return (rest.strip() or None), calls


def _call(written: str) -> dict | None:
    try:
        value = json.loads(written)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments)},
    }


def _literal(tokenizer, text: str) -> str:
    """`text` in llguidance's Lark: a token of its own (Qwen's `<tool_call>` is an added token, which llguidance
    reads as a special token and matches only by id), else the quoted text."""
    added = {token.content: index for index, token in tokenizer.added_tokens_decoder.items()}
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


def call_grammar(tokenizer, tools: list[dict], allowed: list[str]) -> str:
    """llguidance's grammar of one `<tool_call>` block calling a function of `allowed` (names of `tools`) with
    arguments of its schema, in compact JSON."""
    import llguidance

    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
        if tool["function"]["name"] in allowed
    ]
    schema = {"anyOf": schemas, "x-guidance": {"whitespace_flexible": False}}
    opener, closer = _literal(tokenizer, "<tool_call>"), _literal(tokenizer, "</tool_call>")
    lark = f'start: {opener} "\\n" call "\\n" {closer}\ncall: %json {json.dumps(schema)}'
    return llguidance.LLMatcher.grammar_from_lark(lark)
