"""OpenAI response objects: completions, chat completions, their streamed chunks, and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

from jetspec_jax.decoding.results import GenerationResult


def new_id(chat: bool) -> str:
    """A fresh response id, prefixed as OpenAI's (`chatcmpl-` or `cmpl-`)."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The response's `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stats(result: GenerationResult | None) -> dict[str, Any]:
    """Our extension: `{"jetspec": decoding statistics of the request}`; empty without a result
    (the request's batch failed after its stop string had ended the text)."""
    if result is None:
        return {}
    return {
        "jetspec": {
            "tau": round(result.tau, 4),
            "target_forwards": len(result.acceptance_lengths),
            "prefill_seconds": round(result.timing.prefill_seconds, 6),
            "decode_seconds": round(result.timing.decode_seconds, 6),
            "compile_seconds": round(result.timing.compile_seconds, 6),
        }
    }


def _envelope(
    object_type: str, request_id: str, model: str, created: int, choices: list
) -> dict[str, Any]:
    """The fields every answer and chunk begins with."""
    return {
        "id": request_id,
        "object": object_type,
        "created": created,
        "model": model,
        "choices": choices,
    }


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def full_response(
    *,
    chat: bool,
    request_id: str,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    result: GenerationResult | None,
) -> dict[str, Any]:
    """The non-streamed answer."""
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    object_type = "chat.completion" if chat else "text_completion"
    return {
        **_envelope(object_type, request_id, model, int(time.time()), [choice]),
        "usage": usage(prompt_tokens, completion_tokens),
        **stats(result),
    }


def chunk(
    *,
    chat: bool,
    request_id: str,
    model: str,
    created: int,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: a text delta (chat: the first also carries the role) or the finish.
    `created` is the stream's timestamp (every chunk of a stream carries the same one). With
    `include_usage` (the request's `stream_options`) it carries `"usage": null`, as OpenAI's
    chunks before the usage chunk do."""
    if chat:
        delta: dict[str, str] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {
        **_envelope(_chunk_object(chat), request_id, model, created, [choice]),
        **({"usage": None} if include_usage else {}),
    }


def usage_chunk(
    *,
    chat: bool,
    request_id: str,
    model: str,
    created: int,
    prompt_tokens: int,
    completion_tokens: int,
    result: GenerationResult | None,
) -> dict[str, Any]:
    """The last streamed chunk when `stream_options.include_usage` is set: no choices."""
    return {
        **_envelope(_chunk_object(chat), request_id, model, created, []),
        "usage": usage(prompt_tokens, completion_tokens),
        **stats(result),
    }
