"""Turning a document into prompt tokens: template, system message, chat template, length limit."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

from .source import Document
from .spec import JobSpec


@dataclass
class Prompt:
    tokens: list[int]
    truncated: bool = False


def tokens_hash(tokens: list[int]) -> str:
    """A short hash of a prompt's token ids: what the model actually reads."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


class PromptTooLong(Exception):
    """The prompt exceeds its limit (``limits.max_prompt_tokens`` or the model's context).

    ``tokens`` is the whole prompt as it would have been, before any cutting.
    """

    def __init__(self, message: str, tokens: list[int]):
        super().__init__(message)
        self.tokens = tokens


def prompt_limit(spec: JobSpec, context_length: Optional[int]) -> tuple[Optional[int], str]:
    """The most prompt tokens a document may have, and what sets that limit (for messages).

    The model's context must hold the prompt and ``generation.max_tokens`` new
    tokens; ``limits.max_prompt_tokens``, when set, may ask for less.
    """
    limits = []
    if spec.limits.max_prompt_tokens is not None:
        limits.append((spec.limits.max_prompt_tokens, f"limits.max_prompt_tokens={spec.limits.max_prompt_tokens}"))
    if context_length is not None:
        room = context_length - spec.generation.max_tokens
        limits.append(
            (room, f"{room} (the model's context of {context_length} positions "
                   f"minus generation.max_tokens={spec.generation.max_tokens})")
        )
    return min(limits) if limits else (None, "")


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


def build_prompt(spec: JobSpec, tokenizer, document: Document, *, context_length: Optional[int] = None) -> Prompt:
    """The prompt tokens for one document, applying ``limits`` (truncate cuts the document text).

    ``context_length`` is the model's (see ``model_store.context_length``); a
    prompt that would not fit in it follows ``limits.on_too_long`` like one
    over ``limits.max_prompt_tokens``.
    """
    tokens = _encode(spec, tokenizer, _render(spec, document))
    limit, reason = prompt_limit(spec, context_length)
    if limit is None or len(tokens) <= limit:
        return Prompt(tokens)
    full = tokens
    if spec.limits.on_too_long != "truncate" or spec.input.prompt_column:
        raise PromptTooLong(f"prompt has {len(tokens)} tokens, more than {reason}", full)
    text_tokens = tokenizer.encode(document.fields[spec.input.text_column])
    keep = max(0, len(text_tokens) - (len(tokens) - limit))
    while True:
        tokens = _encode(spec, tokenizer, _render(spec, document, tokenizer.decode(text_tokens[:keep])))
        if len(tokens) <= limit or keep == 0:
            break
        keep = max(0, keep - (len(tokens) - limit))
    if len(tokens) > limit:
        raise PromptTooLong(f"the prompt without any document text has {len(tokens)} tokens, more than {reason}", full)
    return Prompt(tokens, truncated=True)
