"""OpenAI request bodies → validated generation requests, with OpenAI-style error answers.

Supported: `/v1/completions` (`prompt`: a string, a list of token ids, or a one-element list of
either) and `/v1/chat/completions` (`messages` of system / user / assistant turns; string or
text-part content, the parts joined by newlines as vLLM joins them), with `model`, `max_tokens`
(chat: also `max_completion_tokens`), `temperature` (0..2), `top_p` (0 keeps only the most likely
token), `top_k` (an extension, as in vLLM), `seed` (any 64-bit integer, folded to 32 bits), `stop`
(up to 4 strings), `stream`, `stream_options.include_usage` and chat's
`chat_template_kwargs.enable_thinking` (vLLM's); a chat message's `name` is passed to the chat
template. Fields that would change the output in ways this server does not implement (`n` > 1,
`logprobs`, `echo`, non-zero penalties, `logit_bias`, `tools` and a forced `tool_choice`, tool
calls in the history, `suffix`, `best_of` > 1, a `response_format` other than text, output
modalities other than text, vLLM's `stream_options.continuous_usage_stats`, and vLLM's extensions
away from their neutral values: `EXTENSIONS_AT_NEUTRAL`, `CHAT_EXTENSIONS_AT_NEUTRAL`) are
refused with 400 rather than silently ignored; other unknown fields are ignored, as clients send
many.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any

from jetspec_jax.prompting import encode_chat, has_chat_template, require_unicode
from jetspec_jax.sampling import MAX_TOP_K, MIN_TEMPERATURE, SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# vLLM's request extensions that change the output, and the values at which they change nothing
# (what this server does): any other value is refused, never silently ignored. Absent or null is
# always neutral.
EXTENSIONS_AT_NEUTRAL = {
    "min_p": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "length_penalty": (1, 1.0),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "use_beam_search": (False,),
    "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "prompt_logprobs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),  # would cut the prompt
}
# vLLM's chat-only extensions: how the prompt is rendered (ours: `prompting.encode_chat`).
CHAT_EXTENSIONS_AT_NEUTRAL = {
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "chat_template": (),
    "documents": ([],),  # rendered by the template
}
# A chat request's choices between a text answer and a tool call that leave it a text answer.
_TEXT_ANSWER_CHOICES = (None, "none", "auto")


class RequestError(Exception):
    """An invalid request: answered with `status` and an OpenAI error object.

    Attributes:
        status: the HTTP status (400, 401, 404, 503, ...).
        message: what is wrong, for a person.
        param: the offending request field, if any.
        code: a machine-readable code (e.g. "model_not_found", "context_length_exceeded").
        type: the OpenAI error type.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        """The error's JSON response body, in OpenAI's shape."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def model_not_found(asked: str, served: str) -> RequestError:
    """The 404 for a model id this server does not serve."""
    return RequestError(
        404,
        f"the model {asked!r} does not exist; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A validated request, ready for the scheduler.

    Attributes:
        chat: from `/v1/chat/completions`.
        prompt_ids: the prompt's token ids (chat template applied for chat).
        max_tokens: the token budget.
        sampling: temperature / top-k / top-p / seed.
        stop: stop strings (the output is cut before the first one).
        stream: answer with server-sent events.
        include_usage: streaming: send a final chunk with token usage.
    """

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What request parsing needs to know about the served model.

    Attributes:
        name: the model id clients must send.
        tokenizer: a transformers tokenizer.
        context_length: prompt plus output tokens at most.
        default_max_tokens: the chat budget when a request gives none (capped by the context).
    """

    name: str
    tokenizer: Any
    context_length: int
    default_max_tokens: int = 256


def parse_completion(body: Any, model: ModelInfo) -> GenerationRequest:
    """Validates a `/v1/completions` body."""
    body = _common_checks(body, model)
    if "prompt" not in body:
        raise RequestError(400, "missing required parameter: 'prompt'", param="prompt")
    if body.get("echo"):
        raise RequestError(400, "echo is not supported", param="echo")
    _check_neutral(body, {"add_special_tokens": (True,)})
    prompt_ids = _prompt_ids(body["prompt"], model)
    default = _default_budget(COMPLETION_DEFAULT_MAX_TOKENS, prompt_ids, model)
    max_tokens = _max_tokens(body, "max_tokens", default, prompt_ids, model)
    return _request(body, False, prompt_ids, max_tokens)


def parse_chat(body: Any, model: ModelInfo) -> GenerationRequest:
    """Validates a `/v1/chat/completions` body and applies the chat template."""
    body = _common_checks(body, model)
    if "messages" not in body:
        raise RequestError(400, "missing required parameter: 'messages'", param="messages")
    for name in ("tools", "functions"):
        if body.get(name):
            raise RequestError(400, "tools / function calling are not supported", param=name)
    for name in ("tool_choice", "function_call"):  # a forced call, even with no tools given
        if body.get(name) not in _TEXT_ANSWER_CHOICES:
            raise RequestError(
                400,
                f"{name}={body[name]!r} is not supported (must be 'none' or 'auto')",
                param=name,
            )
    if body.get("modalities") not in (None, ["text"]):
        raise RequestError(
            400,
            f"modalities={body['modalities']!r} is not supported (only text output)",
            param="modalities",
        )
    if body.get("audio") is not None:
        raise RequestError(400, "audio output is not supported", param="audio")
    _check_neutral(body, CHAT_EXTENSIONS_AT_NEUTRAL)
    messages = _messages(body["messages"])
    tokenizer = model.tokenizer
    if not has_chat_template(tokenizer):
        raise RequestError(400, "this model's tokenizer has no chat template; use /v1/completions")
    try:
        prompt_ids = encode_chat(tokenizer, messages, thinking=_thinking(body))
    except ValueError as e:  # the template refuses them (jinja's raise_exception)
        raise RequestError(400, str(e), param="messages") from None
    default = _default_budget(model.default_max_tokens, prompt_ids, model)
    # The budget is `max_completion_tokens`, else the older `max_tokens`; a sent one not used is
    # still checked, as a typed request model would.
    sent = [n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None]
    for unused in sent[1:]:
        _check_token_count(unused, body[unused])
    max_tokens = _max_tokens(body, sent[0] if sent else "max_tokens", default, prompt_ids, model)
    return _request(body, True, prompt_ids, max_tokens)


def _common_checks(body: Any, model: ModelInfo) -> dict:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if "model" not in body:
        raise RequestError(400, "missing required parameter: 'model'", param="model")
    if not isinstance(body["model"], str):
        raise RequestError(400, "model must be a string", param="model")
    if body["model"] != model.name:
        raise model_not_found(body["model"], model.name)
    if not _is_one(body.get("n")):
        raise RequestError(400, "n must be 1 (send concurrent requests instead)", param="n")
    # Completions' fields, refused on chat too: a client that sends them expects them honoured.
    if not _is_one(body.get("best_of")):
        raise RequestError(400, "best_of must be 1", param="best_of")
    if body.get("suffix"):
        raise RequestError(400, "suffix is not supported", param="suffix")
    # Identity, not equality: logprobs=0 asks for the chosen tokens' logprobs (and 0 == False).
    logprobs = body.get("logprobs")
    if not (logprobs is None or logprobs is False):
        raise RequestError(400, "logprobs are not supported", param="logprobs")
    if not _is_zero(body.get("top_logprobs")):
        raise RequestError(400, "top_logprobs is not supported (must be 0)", param="top_logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _is_zero(body.get(name)):
            raise RequestError(400, f"{name} is not supported (must be 0)", param=name)
    bias = body.get("logit_bias")
    if bias and not (isinstance(bias, dict) and all(_is_zero(v) for v in bias.values())):
        raise RequestError(400, "logit_bias is not supported", param="logit_bias")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError(
            400, "response_format other than text is not supported", param="response_format"
        )
    _check_neutral(body, EXTENSIONS_AT_NEUTRAL)
    return body


def _thinking(body: dict) -> bool:
    """vLLM's `chat_template_kwargs`, of which only `enable_thinking` (read by Qwen3 templates;
    off unless asked for) is passed on: any other key could change the rendering unseen."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return False
    if (
        not isinstance(kwargs, dict)
        or set(kwargs) - {"enable_thinking"}
        or not isinstance(kwargs.get("enable_thinking", False), bool)
    ):
        raise RequestError(
            400,
            f"chat_template_kwargs={kwargs!r} is not supported (only enable_thinking: a boolean)",
            param="chat_template_kwargs",
        )
    return kwargs.get("enable_thinking", False)


def _is_one(value: Any) -> bool:
    """Absent, or the integer 1 (not `True`, which equals 1)."""
    return value is None or (type(value) is int and value == 1)


def _is_zero(value: Any) -> bool:
    """Absent, null or a numeric 0 (not `False`, which equals 0): a neutral penalty or bias."""
    return value is None or (
        not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0
    )


def _check_neutral(body: dict, extensions: dict[str, tuple]) -> None:
    """Refuses an extension (`{name: neutral values}`) given at a value that is not neutral;
    absent or null always is."""
    for name, neutral in extensions.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            allowed = " or ".join(repr(v) for v in neutral) or "absent"
            raise RequestError(
                400, f"{name}={value!r} is not supported (must be {allowed})", param=name
            )


def _request(body: dict, chat: bool, prompt_ids: list[int], max_tokens: int) -> GenerationRequest:
    stream, include_usage = _streaming(body)
    return GenerationRequest(
        chat=chat,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
    )


def _streaming(body: dict) -> tuple[bool, bool]:
    """`stream`, and `stream_options.include_usage` (allowed only when streaming)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise RequestError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object", param="stream_options")
    include_usage = options.get("include_usage")
    include_usage = False if include_usage is None else include_usage
    if not isinstance(include_usage, bool):
        raise RequestError(
            400, "stream_options.include_usage must be a boolean", param="stream_options"
        )
    if options.get("continuous_usage_stats") not in (None, False):  # vLLM's usage in every chunk
        raise RequestError(
            400,
            "stream_options.continuous_usage_stats is not supported (usage comes in the last "
            "chunk: include_usage)",
            param="stream_options",
        )
    return stream, include_usage


def _sampling(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0 or 0 < temperature < MIN_TEMPERATURE:
        raise RequestError(
            400,
            f"temperature must be 0 or in [{MIN_TEMPERATURE:g}, 2], got {temperature}",
            param="temperature",
        )
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 <= top_p <= 1.0:
        raise RequestError(400, f"top_p must be in [0, 1], got {top_p}", param="top_p")
    top_k = body.get("top_k")
    top_k = 0 if top_k in (None, -1) else top_k  # vLLM's -1 = disabled
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise RequestError(
            400, f"top_k must be an integer in [0, {MAX_TOP_K}], got {top_k!r}", param="top_k"
        )
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(2**32)  # OpenAI: unseeded requests are not reproducible
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise RequestError(400, f"seed must be a 64-bit integer, got {seed!r}", param="seed")
    # Clients send any int64 (or uint64); PRNG keys take 32 bits.
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed % 2**32)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{name} must be a number, got {value!r}", param=name)
    try:
        number = float(value)  # an int past float's range overflows
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise RequestError(400, f"{name} must be a finite number, got {value!r}", param=name)
    return number


def _default_budget(default: int, prompt_ids: list[int], model: ModelInfo) -> int:
    """A budget the client did not set: `default`, cut to the context left after the prompt (a
    prompt that fills the context still gets 1, refused by `_max_tokens` as too long)."""
    return max(1, min(default, model.context_length - len(prompt_ids)))


def _max_tokens(
    body: dict, name: str, default: int, prompt_ids: list[int], model: ModelInfo
) -> int:
    value = body.get(name)
    given = value is not None
    if not given:
        value = default
    _check_token_count(name, value)
    if len(prompt_ids) + value > model.context_length:
        budget = (
            f"{name} asks for {value}. Shorten the prompt or lower {name}."
            if given
            else "no token is left for the completion. Shorten the prompt."
        )
        raise RequestError(
            400,
            f"this model's context is {model.context_length} tokens; the prompt has "
            f"{len(prompt_ids)} and {budget}",
            param="messages" if "messages" in body else "prompt",
            code="context_length_exceeded",
        )
    return value


def _check_token_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(400, f"{name} must be an integer >= 1, got {value!r}", param=name)


def _prompt_ids(prompt: Any, model: ModelInfo) -> list[int]:
    # A batch is told apart before a batch of one is unwrapped: a prompt nested a level deeper
    # (`[["a"]]`) is malformed, not a batch to send as concurrent requests.
    if isinstance(prompt, list) and len(prompt) > 1:
        if all(isinstance(i, list) for i in prompt) or all(isinstance(i, str) for i in prompt):
            raise RequestError(
                400, "one prompt per request; send concurrent requests", param="prompt"
            )
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(400, "prompt is empty", param="prompt")
        return model.tokenizer.encode(_unicode(prompt, "prompt"), add_special_tokens=True)
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(
            400, "prompt must be a non-empty string or list of token ids", param="prompt"
        )
    for i in prompt:  # the range is checked against the model's vocabulary by the scheduler
        if isinstance(i, bool) or not isinstance(i, int):
            raise RequestError(400, f"prompt holds an invalid token id {i!r}", param="prompt")
    return list(prompt)


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise RequestError(
                400,
                f"{where}.role must be system, developer, user or assistant, got {role!r}",
                param=f"{where}.role",
            )
        for name in ("tool_calls", "function_call"):  # a template renders them: not ignored
            if message.get(name):
                raise RequestError(
                    400, f"{where}.{name}: tool calls are not supported", param=f"{where}.{name}"
                )
        if "content" not in message:
            raise RequestError(
                400, f"missing required parameter: '{where}.content'", param=f"{where}.content"
            )
        turn = {
            "role": "system" if role == "developer" else role,
            "content": _content(message["content"], f"{where}.content"),
        }
        name = message.get("name")
        if name is not None:  # a participant's name, which templates may render (as vLLM's)
            if not isinstance(name, str):
                raise RequestError(400, f"{where}.name must be a string", param=f"{where}.name")
            turn["name"] = _unicode(name, f"{where}.name")
        out.append(turn)
    return out


def _content(content: Any, where: str) -> str:
    """A message's content as text; `where` names it in errors (`messages[i].content`)."""
    if isinstance(content, str):
        return _unicode(content, where)
    if isinstance(content, list):
        if not content:
            raise RequestError(400, f"{where}: an empty list of parts", param=where)
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(400, f"{where}: only text parts are supported", param=where)
            texts.append(part["text"])
        return _unicode("\n".join(texts), where)  # as vLLM joins a message's text parts
    raise RequestError(400, f"{where} must be a string or a list of text parts", param=where)


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise RequestError(
            400, "stop must be a string or a list of at most 4 strings", param="stop"
        )
    return tuple(_unicode(s, "stop") for s in stops if s)


def _unicode(text: str, param: str) -> str:
    """`text`, refused (400) if it is not Unicode text (`require_unicode`)."""
    try:
        return require_unicode(text, param)
    except ValueError as e:
        raise RequestError(400, str(e), param=param) from None
