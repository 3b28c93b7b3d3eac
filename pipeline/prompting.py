"""Turning a document into prompt tokens: template, system message, chat template, length limit."""

from __future__ import annotations

from dataclasses import dataclass

from .source import Document
from .spec import JobSpec


@dataclass
class Prompt:
    tokens: list[int]
    truncated: bool = False


class PromptTooLong(Exception):
    """The prompt exceeds ``limits.max_prompt_tokens`` under ``skip`` or ``fail``."""


def _render(spec: JobSpec, document: Document, text: str | None = None) -> str:
    if spec.input.prompt_column:
        return document.fields[spec.input.prompt_column]
    values = {"text": text if text is not None else document.fields[spec.input.text_column]}
    for column in spec.input.template_columns():
        values.setdefault(column, document.fields[column])
    return spec.input.prompt_template.format(**values)


def _encode(spec: JobSpec, tokenizer, content: str) -> list[int]:
    use_chat = spec.input.chat_template and getattr(tokenizer, "chat_template", None)
    if use_chat:
        messages = [{"role": "system", "content": spec.input.system}] if spec.input.system else []
        messages.append({"role": "user", "content": content})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    if spec.input.system:
        content = f"{spec.input.system}\n\n{content}"
    return list(tokenizer.encode(content))


def build_prompt(spec: JobSpec, tokenizer, document: Document) -> Prompt:
    """The prompt tokens for one document, applying ``limits`` (truncate cuts the document text)."""
    tokens = _encode(spec, tokenizer, _render(spec, document))
    limit = spec.limits.max_prompt_tokens
    if limit is None or len(tokens) <= limit:
        return Prompt(tokens)
    if spec.limits.on_too_long != "truncate" or spec.input.prompt_column:
        raise PromptTooLong(f"prompt has {len(tokens)} tokens, more than limits.max_prompt_tokens={limit}")
    text_tokens = tokenizer.encode(document.fields[spec.input.text_column])
    keep = max(0, len(text_tokens) - (len(tokens) - limit))
    while True:
        tokens = _encode(spec, tokenizer, _render(spec, document, tokenizer.decode(text_tokens[:keep])))
        if len(tokens) <= limit or keep == 0:
            break
        keep = max(0, keep - (len(tokens) - limit))
    if len(tokens) > limit:
        raise PromptTooLong(f"the prompt without any document text is longer than {limit} tokens")
    return Prompt(tokens, truncated=True)
