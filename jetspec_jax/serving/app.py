"""The OpenAI-compatible HTTP application (aiohttp).

Why aiohttp: one dependency gives a production HTTP/1.1 server, streaming responses for
server-sent events, graceful shutdown on SIGINT/SIGTERM (stop listening → `on_shutdown` → wait for
in-flight handlers up to a timeout → cancel them → `on_cleanup`; the app cancels the running rows
at its own, shorter, timeout, so that their handlers answer 503) and a client, with no ASGI layer
and no second server package (starlette + uvicorn would be two, plus their own dependencies).
Decoding runs on the scheduler's worker thread; handlers only parse, wait for events and write.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming or not), GET /v1/models,
GET /v1/models/{model}, GET /health, GET /metrics. With an API key set, /v1/* needs
`Authorization: Bearer KEY` (401 otherwise); /health and /metrics stay open for probes and
scrapers. Every error is an OpenAI error object (`{"error": {"message", "type", "param",
"code"}}`).

A stream's headers (200, text/event-stream) go out with its first text, or, when no text has come
after `keepalive_seconds` (a request waiting in the queue behind a long batch, or for a batch
shape's first compile), with an SSE comment line (`: keep-alive`, which clients ignore), repeated
each `keepalive_seconds` until the first text, so that reverse proxies and clients with read
timeouts keep the connection. An error before the headers (queue full, shutdown, a failed job) is
an ordinary HTTP error response; after them it is an error event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hmac
import json
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from jetspec_jax.serving import openai_responses as responses
from jetspec_jax.serving.detokenize import IncrementalDetokenizer, StopStrings
from jetspec_jax.serving.metrics import CONTENT_TYPE_LATEST
from jetspec_jax.serving.openai_requests import (
    GenerationRequest,
    ModelInfo,
    RequestError,
    model_not_found,
    parse_chat,
    parse_completion,
)
from jetspec_jax.serving.scheduler import (
    Failed,
    Finished,
    Job,
    QueueFull,
    Scheduler,
    ShuttingDown,
    Tokens,
)

logger = logging.getLogger(__name__)

SCHEDULER = web.AppKey("scheduler", Scheduler)
MODEL = web.AppKey("model", ModelInfo)
API_KEY = web.AppKey("api_key", str)
TOKENIZING = web.AppKey("tokenizing", concurrent.futures.ThreadPoolExecutor)
KEEPALIVE = web.AppKey("keepalive_seconds", float)
_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/models/{model}",
    "/health",
    "/metrics",
)
# The status a stream ended with after its 200 headers (an error event's, or 499 when its client
# hung up), for `_count` (a context variable: the handler runs in the middleware's task, and
# aiohttp runs each request of a keep-alive connection in a task of its own, so no request sees
# another's value).
_STREAM_ERROR_STATUS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "jetspec_stream_error_status", default=None
)


# What `_decoded` yields when a keep-alive comment is due, and the comment `_stream` then writes.
_KEEPALIVE = object()
KEEPALIVE_COMMENT = b": keep-alive\n\n"

# A request body may carry a whole context: as token ids (up to ~8 bytes each in JSON) or as text
# escaped character by character (`\uXXXX`, several characters a token). aiohttp's default, 1 MiB,
# stays the floor; a 128k-token context allows 8 MiB.
BODY_BYTES_PER_CONTEXT_TOKEN = 64

# Seconds past the app's shutdown timeout that aiohttp's own gives the handlers of cancelled rows
# to answer 503 (a row stops at its next chunk boundary) before it cancels them.
SHUTDOWN_ANSWER_SECONDS = 10.0


def max_body_bytes(context_length: int) -> int:
    """The largest request body the server reads (larger ones get 413, naming the limit)."""
    return max(2**20, BODY_BYTES_PER_CONTEXT_TOKEN * context_length)


def create_app(
    scheduler: Scheduler,
    model: ModelInfo,
    *,
    api_key: str | None = None,
    keepalive_seconds: float = 15.0,
    shutdown_timeout: float = 30.0,
):
    """The application; starting it starts the scheduler, shutting it down drains and stops it.

    Args:
        scheduler: serves the generation jobs (not started yet).
        model: the served model's name, tokenizer and limits.
        api_key: when set, required as a bearer token on /v1/*.
        keepalive_seconds: a stream with no text yet sends its headers and a `: keep-alive`
            comment after this many seconds, and the comment again each as many until its first
            text (finite, > 0).
        shutdown_timeout: seconds the running requests get to finish once the shutdown begins;
            then their rows are cancelled, and each is answered 503 (a stream: an error event,
            then `data: [DONE]`). Run the app with a longer aiohttp `shutdown_timeout`
            (`SHUTDOWN_ANSWER_SECONDS` longer), which cancels the handlers themselves: their
            clients would get a cut connection.
    """
    if not (math.isfinite(keepalive_seconds) and keepalive_seconds > 0):
        raise ValueError(
            f"keepalive_seconds must be a finite number > 0, got {keepalive_seconds!r}"
        )
    if not (math.isfinite(shutdown_timeout) and shutdown_timeout >= 0):
        raise ValueError(f"shutdown_timeout must be a finite number >= 0, got {shutdown_timeout!r}")
    app = web.Application(
        middlewares=[_count, _errors, _auth],
        client_max_size=max_body_bytes(model.context_length),
    )
    app[SCHEDULER] = scheduler
    app[MODEL] = model
    app[API_KEY] = api_key or ""
    app[KEEPALIVE] = float(keepalive_seconds)
    # One thread, so that requests are encoded one at a time: a fast tokenizer that changes its
    # truncation/padding settings during an encode fails other threads' calls ("Already
    # borrowed"). Decoding (on the loop) and plain encodes only read it.
    app[TOKENIZING] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    # Any path after /v1/models/: served names may hold slashes (`--model-name org/model`),
    # which clients send unescaped (curl, older SDKs).
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)

    async def start(app):
        app[SCHEDULER].start()

    deadline: list[asyncio.TimerHandle] = []

    def cancel_running():
        if app[SCHEDULER].running:
            logger.warning(
                "shutdown timeout (%g s): cancelling %d running requests",
                shutdown_timeout,
                app[SCHEDULER].running,
            )
        app[SCHEDULER].cancel_running()

    async def drain(app):
        logger.info("shutting down: refusing new requests, finishing the running batch")
        app[SCHEDULER].begin_shutdown()
        # The rows are cancelled here, not by aiohttp's timeout: that one cancels the handlers
        # (cut connections, no 503), and only after waiting twice as long (0: never), the rows
        # decoding meanwhile.
        loop = asyncio.get_running_loop()
        deadline.append(loop.call_later(shutdown_timeout, cancel_running))

    async def stop(app):
        for timer in deadline:
            timer.cancel()
        await asyncio.get_running_loop().run_in_executor(None, app[SCHEDULER].stop)
        app[TOKENIZING].shutdown(wait=False)

    app.on_startup.append(start)
    app.on_shutdown.append(drain)
    app.on_cleanup.append(stop)
    return app


# -- middlewares ----------------------------------------------------------------------------


@web.middleware
async def _count(request: web.Request, handler):
    """Counts every answer by route and status (`jetspec_requests_total`): a request whose client
    went away (its handler cancelled, its connection closed) as 499, nginx's "client closed
    request" (503 when the server's shutdown cancelled it, its connection still open), and a
    stream that ended in an error event as that error's status, not the 200 its headers went
    out with. A route with a parameter counts under its pattern, and a path no route matched (a
    wrong method's included) under "other" unless it is a route's: what clients send cannot
    grow the metrics."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else request.path
    endpoint = endpoint if endpoint in _ROUTES else "other"
    status = 500
    try:
        response = await handler(request)
        status = _STREAM_ERROR_STATUS.get() or response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        # The client's hang-up closes the connection before its handler is cancelled; the
        # server, past its shutdown timeout, cancels handlers whose connections are still open.
        client_gone = request.app[SCHEDULER].accepting or request.transport is None
        status = 499 if client_gone else 503
        raise
    finally:
        request.app[SCHEDULER].metrics.requests.labels(endpoint, str(status)).inc()


@web.middleware
async def _errors(request: web.Request, handler):
    """Turns every error into an OpenAI error object with its status."""
    try:
        return await handler(request)
    except RequestError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:  # unknown route, wrong method, body too large
        if e.status < 400:
            raise
        message = e.text if e.status == 413 and e.text else e.reason  # 413: names the limit
        error = RequestError(e.status, message or "error", code=str(e.status))
        allow = e.headers.get("Allow")  # a 405 names the methods the route takes
        return web.json_response(
            error.body(), status=e.status, headers={"Allow": allow} if allow else None
        )
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error in %s", request.path)
        error = RequestError(500, "internal server error", type="server_error")
        return web.json_response(error.body(), status=500)


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[API_KEY]
    if key and request.path.startswith("/v1/"):
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else ""  # schemes ignore case
        # aiohttp keeps undecodable header bytes as surrogates: encode them back, not fail (500).
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode()):
            raise RequestError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
    return await handler(request)


# -- simple routes --------------------------------------------------------------------------


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "jetspec_jax"}


async def _models(request: web.Request) -> web.Response:
    data = [_model_object(request.app[MODEL].name)]
    return web.json_response({"object": "list", "data": data})


async def _model(request: web.Request) -> web.Response:
    """OpenAI's "retrieve model": the served model's object, else 404 `model_not_found`."""
    name, asked = request.app[MODEL].name, request.match_info["model"]
    if asked != name:
        raise model_not_found(asked, name)
    return web.json_response(_model_object(name))


async def _health(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    ready = scheduler.accepting and not scheduler.warming_up
    status = "ok" if ready else "warming_up" if scheduler.accepting else "shutting_down"
    body = {
        "status": status,
        "model": request.app[MODEL].name,
        "method": scheduler.options.method,
        "queue_depth": scheduler.queue_depth,
        "running": scheduler.running,
    }
    return web.json_response(body, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[SCHEDULER].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- generation -----------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


async def _parsed(request: web.Request, parse) -> GenerationRequest:
    """The body `parse`d on the tokenizing thread: templating and tokenizing a long prompt would
    otherwise hold up every other request's stream on the event loop."""
    body = await _json(request)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[TOKENIZING], parse, body, request.app[MODEL])


async def _json(request: web.Request) -> Any:
    body = await request.read()
    try:
        return json.loads(body)  # bytes: JSON's own encodings, whatever the charset header says
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError(400, f"malformed JSON body: {e}") from None
    except RecursionError:  # nesting deeper than the parser's recursion limit
        raise RequestError(400, "malformed JSON body: nested too deeply") from None


class _Output:
    """One request's text so far: incremental detokenization, stop strings, finish reason, and
    the completion's token count. `context`: the prompt a completion continues (its text is what
    the tokens add to the prompt's); a chat answer is a message of its own, decoded alone."""

    def __init__(self, tokenizer, stop: tuple[str, ...], context: Sequence[int] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, context=context)
        self.stops = StopStrings(stop)
        self.tokens = 0  # fed so far, up to the one that completes a stop string
        self.result = None  # the `GenerationResult`, once `_decoded` has seen it finish

    @classmethod
    def of(cls, req: GenerationRequest, tokenizer) -> _Output:
        """`req`'s output: a completion continues its prompt; a chat answer starts afresh."""
        return cls(tokenizer, req.stop, () if req.chat else req.prompt_ids)

    def add(self, tokens: list[int]) -> str:
        """The text `tokens` add; fed one by one so that the count stops at a stop string (the
        rows decode a few tokens past it before their cancellation lands)."""
        text = []
        for token in tokens:
            if self.stops.hit:
                break
            self.tokens += 1
            text.append(self.stops.feed(self.detokenizer.push([token])))
        return "".join(text)

    def finish(self) -> str:
        """The text held back until the end (an incomplete character, a stop string's start)."""
        return self.stops.feed(self.detokenizer.flush()) + self.stops.flush()

    def finish_reason(self, result) -> str:
        return "stop" if self.stops.hit or result.finish_reason == "stop" else "length"

    def completion_tokens(self, result) -> int:
        """usage's count: the tokens up to the stop string that ended the text, else all."""
        return self.tokens if self.stops.hit else len(result.tokens)


async def _generate(request: web.Request, parse) -> web.StreamResponse:
    """Answers the request whose body `parse` validates. Its latency metrics count from before
    the body is read, so that they include the wait for the tokenizing thread."""
    arrived = time.perf_counter()
    req = await _parsed(request, parse)
    scheduler, model = request.app[SCHEDULER], request.app[MODEL]
    try:  # the token ids against the vocabulary (the budget was checked by the parser)
        prompt_ids = scheduler.check(req.prompt_ids, req.max_tokens)
    except ValueError as e:
        raise RequestError(400, str(e), param="messages" if req.chat else "prompt") from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def deliver(event) -> None:  # on the scheduler's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening
            pass

    job = Job(prompt_ids, req.max_tokens, req.sampling, deliver)
    try:
        scheduler.submit(job)
    except (QueueFull, ShuttingDown) as e:
        raise RequestError(503, str(e), code="overloaded", type="server_error") from None
    metrics = scheduler.metrics
    try:
        if req.stream:
            response = await _stream(request, req, job, events, len(prompt_ids), arrived)
        else:
            response = await _collect(req, job, events, model, metrics, len(prompt_ids), arrived)
        metrics.phase_seconds.labels("request").observe(time.perf_counter() - arrived)
        return response
    finally:
        job.cancel()  # a no-op once finished; stops the row when the client went away


async def _collect(req, job, events, model: ModelInfo, metrics, prompt_tokens: int, arrived):
    """The non-streamed answer, once the job is done."""
    output = _Output.of(req, model.tokenizer)
    text = "".join([piece async for piece in _decoded(job, events, output, metrics, arrived)])
    body = responses.full_response(
        chat=req.chat,
        request_id=responses.new_id(req.chat),
        model=model.name,
        text=text,
        finish_reason=output.finish_reason(output.result),
        prompt_tokens=prompt_tokens,
        completion_tokens=output.completion_tokens(output.result),
        result=output.result,
    )
    return web.json_response(body)


async def _stream(request, req, job, events, prompt_tokens: int, arrived: float):
    """Streams the request's chunks as server-sent events. The response (its headers, and for
    chat the role chunk) is prepared at the first write: the first text, or the first keep-alive
    comment, due once `keepalive_seconds` pass without text (then again each as many until the
    first text). Until then an error is raised as an ordinary HTTP error; after, it is an error
    event. Every write happens here, on the handler's task: no second writer to race."""
    model: ModelInfo = request.app[MODEL]
    metrics = request.app[SCHEDULER].metrics
    output = _Output.of(req, model.tokenizer)
    # What every chunk of the stream repeats.
    fields = dict(
        chat=req.chat,
        request_id=responses.new_id(req.chat),
        model=model.name,
        created=int(time.time()),
    )
    chunk_fields = dict(fields, include_usage=req.include_usage)
    response: web.StreamResponse | None = None

    async def prepared() -> web.StreamResponse:
        nonlocal response
        if response is None:
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            if req.chat:  # the first chat chunk announces the role
                await _sse(response, responses.chunk(**chunk_fields, text="", role=True))
        return response

    async def send(payload: dict | str) -> None:
        await _sse(await prepared(), payload)

    keepalive = request.app[KEEPALIVE]
    try:
        try:
            async for piece in _decoded(job, events, output, metrics, arrived, keepalive):
                if piece is _KEEPALIVE:
                    await _keep_alive(await prepared())
                else:
                    await send(responses.chunk(**chunk_fields, text=piece))
        except RequestError as error:
            if response is None:  # nothing sent yet: an ordinary error answer
                raise
            _STREAM_ERROR_STATUS.set(error.status)
            await send(error.body())
        except ConnectionResetError:
            raise
        except Exception:
            # Headers are out: a new (500) response would be written into the event stream's
            # body and corrupt it, so the error is an event like the others.
            if response is None:
                raise
            logger.exception("streaming %s failed", request.path)
            _STREAM_ERROR_STATUS.set(500)
            await send(RequestError(500, "internal server error", type="server_error").body())
        else:
            result = output.result
            await send(responses.chunk(**chunk_fields, finish_reason=output.finish_reason(result)))
            if req.include_usage:
                await send(
                    responses.usage_chunk(
                        **fields,
                        prompt_tokens=prompt_tokens,
                        completion_tokens=output.completion_tokens(result),
                        result=result,
                    )
                )
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError:
        # The client hung up (a chat UI's stop button): an ordinary end, not a server error.
        # Returning the prepared response lets aiohttp close the connection quietly; the
        # handler's `finally` cancels the row.
        if response is None:
            raise
        _STREAM_ERROR_STATUS.set(499)
    return response


async def _decoded(
    job,
    events: asyncio.Queue,
    output: _Output,
    metrics,
    arrived: float,
    keepalive: float | None = None,
):
    """The request's text as its tokens arrive, in non-empty pieces (stop strings applied; the
    job is cancelled at the first hit), the detokenizer's tail last; `output.result` then holds
    the `GenerationResult` (None when the job's batch failed after its stop string ended the
    text). Observes the time to the first token. With `keepalive` (seconds),
    `_KEEPALIVE` is yielded each time that long passes before the first piece of text.

    Raises:
        RequestError: the job failed, or the server shut down before it finished (503).
    """
    first = True
    loop = asyncio.get_running_loop()
    due = None if keepalive is None else loop.time() + keepalive
    while True:
        if due is None or not events.empty():
            event = await events.get()
        else:
            try:
                # No task of its own: a cancelled `get` leaves the event in the queue.
                async with asyncio.timeout_at(due):
                    event = await events.get()
            except TimeoutError:
                due = loop.time() + keepalive
                yield _KEEPALIVE
                continue
        if isinstance(event, Tokens):
            if first:
                metrics.time_to_first_token.observe(time.perf_counter() - arrived)
                first = False
            if output.stops.hit:
                continue
            text = output.add(event.tokens)
            if output.stops.hit:
                job.cancel()
            if text:
                due = None  # the stream is flowing: no more keep-alives
                yield text
        elif isinstance(event, Failed):
            if not output.stops.hit:
                raise RequestError(event.status, event.message, type="server_error")
            # The text ended at its stop string before the batch failed (the row decodes on
            # until its cancellation lands): the answer stands, without the row's result. Nothing
            # is held back: the hit released the text before the stop string, and drops the rest.
            return
        elif isinstance(event, Finished):
            if event.result.finish_reason == "cancelled" and not output.stops.hit:
                raise RequestError(
                    503, "the server shut down before the request finished", type="server_error"
                )
            tail = output.finish()
            if tail:
                due = None
                yield tail
            output.result = event.result
            return


async def _keep_alive(response: web.StreamResponse) -> None:
    """An SSE comment: it keeps proxies' and clients' read timeouts from cutting a stream that has
    no text yet; clients skip it."""
    await response.write(KEEPALIVE_COMMENT)


async def _sse(response: web.StreamResponse, payload: dict | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    await response.write(f"data: {data}\n\n".encode())
