"""Turning user text into prompt token ids (chat template or raw); `serving/detokenize.py` turns
tokens back into text."""

from __future__ import annotations

import dataclasses

import jinja2


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` has a chat template: the default for `chat` wherever text is encoded
    (the CLI, the benchmarks, evaluation prompts)."""
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer, checkpoint, remedy: str) -> None:
    """A ValueError naming the checkpoint (`checkpoint`, its path) when `tokenizer` has no chat
    template: what command lines check before encoding, with a `remedy` in their flags' words
    (`encode_prompt`'s own message names its `chat` argument)."""
    if not has_chat_template(tokenizer):
        raise ValueError(f"the tokenizer of {checkpoint} has no chat template: {remedy}")


def require_unicode(text: str, what: str) -> str:
    """`text`, refused (ValueError naming it as `what`) when it is not Unicode text: it holds an
    unpaired UTF-16 surrogate, as Python reads bytes that are not UTF-8 from a command line or
    stdin (surrogateescape) and as JSON's escapes admit (`"\\ud800"`). No tokenizer encodes one
    (transformers raises a bare TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds an unpaired UTF-16 surrogate, {text[e.start]!r} at character "
            f"{e.start} (a byte that is not UTF-8, or a JSON escape): not Unicode text"
        ) from None
    return text


def encode_prompt(
    tokenizer, text: str, *, chat: bool, system: str | None = None, thinking: bool = False
) -> list[int]:
    """Token ids of `text`, optionally wrapped in the tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer.
        text: the user's message (chat) or the raw prompt.
        chat: apply the chat template with a generation prompt for the assistant's turn.
        system: an optional system message (chat only).
        thinking: the template's `enable_thinking` switch (read by Qwen3 templates, ignored by
            others); off by default, as in the benchmarks of the field.

    Raises:
        ValueError: chat was asked for but the tokenizer has no chat template, a system message
            was given without chat, or `text` or `system` is not Unicode (`require_unicode`).
    """
    require_unicode(text, "the prompt")
    if system is not None:
        require_unicode(system, "the system message")
    if not chat:
        if system is not None:
            raise ValueError("a system message needs the chat template (chat=True)")
        return tokenizer.encode(text, add_special_tokens=True)
    if not has_chat_template(tokenizer):
        raise ValueError("this tokenizer has no chat template; use a raw prompt (chat=False)")
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": text})
    return encode_chat(tokenizer, messages, thinking=thinking)


def encode_chat(tokenizer, messages: list[dict], *, thinking: bool = False) -> list[int]:
    """Token ids of `messages` (`{"role", "content"}` dicts) rendered by the tokenizer's chat
    template, with the generation prompt for the assistant's turn; the one rendering the CLI,
    the benchmarks and the server's chat endpoint share.

    Raises:
        ValueError: the template refuses the messages (jinja's `raise_exception`, e.g. a system
            message in a template without that role).
    """
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template refuses these messages: {e}") from e
    # The template already holds every special token; encoding must not add a second BOS.
    return tokenizer.encode(rendered, add_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class PromptEncoding:
    """`encode_prompt`'s switches as one value: how training data was encoded (recorded by
    `train.py regenerate`), so that evaluation prompts can be encoded alike."""

    chat: bool = True
    system: str | None = None
    thinking: bool = False

    def encode(self, tokenizer, text: str) -> list[int]:
        """`encode_prompt(tokenizer, text, ...)` with these switches."""
        return encode_prompt(
            tokenizer, text, chat=self.chat, system=self.system, thinking=self.thinking
        )
