"""Turning a document into prompt tokens: template, system message, chat template, length limit.

A prompt built from ``text_column`` and ``prompt_template`` also says where the
document sits in it: a prefix (system message, chat header, template text
before ``{text}``), the document, and the instruction (template text after
``{text}`` and the chat template's tail). The tokens are those of the whole
rendered prompt, the same for every variant; the split only marks them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

from .source import Document
from .spec import JobSpec

PLACEHOLDER = "\u2060velox-document\u2060"  # rendered in place of the text to find where it goes


@dataclass
class Prompt:
    """Prompt tokens; ``tokens[document_start:document_end]`` is the document (None: no split)."""

    tokens: list[int]
    truncated: bool = False
    document_start: int = 0
    document_end: Optional[int] = None

    @property
    def has_split(self) -> bool:
        return self.document_end is not None

    @property
    def prefix(self) -> list[int]:
        return self.tokens[: self.document_start]

    @property
    def document(self) -> list[int]:
        end = len(self.tokens) if self.document_end is None else self.document_end
        return self.tokens[self.document_start : end]

    @property
    def instruction(self) -> list[int]:
        return [] if self.document_end is None else self.tokens[self.document_end :]


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


def _uses_chat(spec: JobSpec, tokenizer) -> bool:
    return bool(spec.input.chat_template and getattr(tokenizer, "chat_template", None))


def _messages(spec: JobSpec, content: str) -> list[dict]:
    messages = [{"role": "system", "content": spec.input.system}] if spec.input.system else []
    messages.append({"role": "user", "content": content})
    return messages


# transformers warns ("Token indices sequence length is longer than the specified maximum") when a text
# encodes past the tokenizer's model_max_length. Here a length past it is expected: streaming variants read
# documents longer than the context by design, and every other prompt is measured against the model's context
# by ``_limited_prompt`` (``limits.on_too_long``: a ``PromptTooLong`` naming the document, or a truncation),
# the loud and real error. So the pipeline's own encodes ask for no such warning.
_QUIET = {"verbose": False}


def _encode(spec: JobSpec, tokenizer, content: str) -> list[int]:
    if _uses_chat(spec, tokenizer):
        return list(tokenizer.apply_chat_template(_messages(spec, content), add_generation_prompt=True,
                                                  tokenizer_kwargs=_QUIET))
    if spec.input.system:
        content = f"{spec.input.system}\n\n{content}"
    return list(tokenizer.encode(content, **_QUIET))


def _split(spec: JobSpec, tokenizer, document: Document, prompt: Prompt) -> Prompt:
    """Mark where the document sits in ``prompt.tokens`` (no split for a ready prompt or an odd template).

    The prompt is rendered once more with a placeholder for the text; the
    rendered halves before and after it are tokenized alone, and the prefix
    and instruction are the longest runs of the prompt's own tokens that
    agree with them at either end (a token merged across the boundary stays
    with the document).
    """
    if spec.input.prompt_column:
        return prompt
    content = _render(spec, document, PLACEHOLDER)
    if _uses_chat(spec, tokenizer):
        rendered = tokenizer.apply_chat_template(_messages(spec, content), add_generation_prompt=True, tokenize=False)
        special = False
    else:
        rendered = f"{spec.input.system}\n\n{content}" if spec.input.system else content
        special = True
    if not isinstance(rendered, str) or rendered.count(PLACEHOLDER) != 1:
        return prompt
    before, after = rendered.split(PLACEHOLDER)
    tokens = prompt.tokens
    start = _common_prefix(tokens, list(tokenizer.encode(before, add_special_tokens=special)) if before else [])
    after_ids = list(tokenizer.encode(after, add_special_tokens=False)) if after else []
    end = len(tokens) - _common_prefix(tokens[start:][::-1], after_ids[::-1])
    return Prompt(tokens, prompt.truncated, document_start=start, document_end=end)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_prompt(spec: JobSpec, tokenizer, document: Document, *, context_length: Optional[int] = None) -> Prompt:
    """The prompt tokens for one document, applying ``limits`` (truncate cuts the document text), split.

    ``context_length`` is the model's (see ``model_store.context_length``); a
    prompt that would not fit in it follows ``limits.on_too_long`` like one
    over ``limits.max_prompt_tokens``. Streaming variants pass None: they
    read documents past the context.
    """
    return _split(spec, tokenizer, document, _limited_prompt(spec, tokenizer, document, context_length))


def _limited_prompt(spec: JobSpec, tokenizer, document: Document, context_length: Optional[int]) -> Prompt:
    tokens = _encode(spec, tokenizer, _render(spec, document))
    limit, reason = prompt_limit(spec, context_length)
    if limit is None or len(tokens) <= limit:
        return Prompt(tokens)
    full = tokens
    if spec.limits.on_too_long != "truncate" or spec.input.prompt_column:
        raise PromptTooLong(f"prompt has {len(tokens)} tokens, more than {reason}", full)
    text_tokens = tokenizer.encode(document.fields[spec.input.text_column], **_QUIET)
    keep = max(0, len(text_tokens) - (len(tokens) - limit))
    while True:
        tokens = _encode(spec, tokenizer, _render(spec, document, tokenizer.decode(text_tokens[:keep])))
        if len(tokens) <= limit or keep == 0:
            break
        keep = max(0, keep - (len(tokens) - limit))
    if len(tokens) > limit:
        raise PromptTooLong(f"the prompt without any document text has {len(tokens)} tokens, more than {reason}", full)
    return Prompt(tokens, truncated=True)
