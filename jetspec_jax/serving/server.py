"""Running the OpenAI-compatible server: in the foreground (signals) or on a background thread.

serve(target, draft, config, host="127.0.0.1", port=8000)   # blocks; SIGINT/SIGTERM stop it
with BackgroundServer(target, draft, config) as server:     # tests, benchmarks
    server.url  # http://127.0.0.1:PORT (an ephemeral port by default)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading

from aiohttp import web

from jetspec_jax.decoding import warmup
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.request_checks import check_reserve
from jetspec_jax.default_model import served_model_name
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.serving.app import SHUTDOWN_ANSWER_SECONDS, create_app
from jetspec_jax.serving.metrics import ServerMetrics
from jetspec_jax.serving.openai_requests import ModelInfo
from jetspec_jax.serving.scheduler import Scheduler, check_sizes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How to serve.

    Attributes:
        model_name: the id clients send as `model` (None: the target directory's name, or
            "SmolLM2-135M-Instruct" for the default model; `default_model.served_model_name`).
        decoding: the method ("ar" or the draft's variant), its `Jj-Rr` refinement and foresight
            drafting (`DecodingOptions`).
        api_key: required as a bearer token on /v1/* when set.
        max_batch_size: requests decoded together at most.
        queue_size: requests waiting at most; one more is answered 503.
        chunk_steps: target forwards between token deliveries (streaming granularity).
        default_max_tokens: chat budget when a request sets none.
        max_model_len: prompt plus completion tokens a request may ask for at most (None: the
            model's context; more than the context is refused, by `check_fits`). A batch's
            caches are sized by its longest request, so one request asking for the whole
            context costs its batch-mates memory and a compile.
        pad_batch: always decode the power of two >= `max_batch_size` rows (batch shapes
            are bucketed to powers of two): one compiled batch shape, and room for waiting
            requests to join a running batch.
        continuous_batching: waiting requests join the running batch at chunk boundaries, in
            the rows finished requests left and its padding rows, when its shapes hold them
            (`Scheduler`); False: each batch keeps the requests it started with.
        reserve_prompt_tokens, reserve_new_tokens: every batch's shapes hold at least a prompt
            of this many tokens with this budget (>= 0, together within the context), so that
            such requests can join it whatever its first requests were; memory grows with them
            (`DecodeSession`).
        warmup: compile the programs of requests within the reserve (both sizes >= 1) before
            the first batch (`Scheduler`'s `warm_up`); /health answers 503 "warming_up" until
            done, and requests sent meanwhile wait in the queue.
        shutdown_timeout: seconds in-flight requests get to finish on SIGINT/SIGTERM; then their
            rows are cancelled and each is answered 503 (0: at once).
        keepalive_seconds: a streaming request with no text yet (waiting in the queue behind a
            long batch, or for its batch shape's first compile) gets its headers and an SSE
            comment (`: keep-alive`) after this many seconds, then the comment again each as many
            until its first text, so that reverse proxies (nginx: 60 s by default) and clients
            with read timeouts do not cut it (> 0). An error before the headers is an ordinary
            HTTP error response; after them, an error event.

    Raises:
        ValueError: on construction, naming the bad value: `max_batch_size`, `queue_size`,
            `chunk_steps` or `default_max_tokens` not an integer >= 1, a reserve size not an
            integer >= 0, `warmup` without both reserve sizes >= 1, `max_model_len` neither
            None nor an integer >= 2, `shutdown_timeout` not a finite number >= 0, or
            `keepalive_seconds` not a finite number > 0.
    """

    model_name: str | None = None
    decoding: DecodingOptions = DecodingOptions()
    api_key: str | None = None
    max_batch_size: int = 8
    queue_size: int = 64
    chunk_steps: int = 8
    default_max_tokens: int = 256
    max_model_len: int | None = None
    pad_batch: bool = False
    continuous_batching: bool = True
    reserve_prompt_tokens: int = 0
    reserve_new_tokens: int = 0
    warmup: bool = False
    shutdown_timeout: float = 30.0
    keepalive_seconds: float = 15.0

    def __post_init__(self):
        if self.model_name is not None and not (
            isinstance(self.model_name, str) and self.model_name.strip()
        ):
            raise ValueError(
                f"model_name must be None (the default name) or a non-empty string, got "
                f"{self.model_name!r}"
            )
        if self.api_key is not None and not (
            isinstance(self.api_key, str) and self.api_key.strip()
        ):
            # "" would serve without authentication: None says that, explicitly.
            raise ValueError(f"api_key must be None or a non-empty string, got {self.api_key!r}")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            # Header values lose their surrounding whitespace (and cannot carry a newline): no
            # request could send this key. The key itself stays out of the message.
            raise ValueError(
                "api_key begins or ends with whitespace, which no 'Authorization: Bearer' header "
                "carries (every request would get 401): strip it (a key file's final newline?)"
            )
        check_sizes(
            max_batch_size=self.max_batch_size,
            queue_size=self.queue_size,
            chunk_steps=self.chunk_steps,
            default_max_tokens=self.default_max_tokens,
        )
        for name in ("reserve_prompt_tokens", "reserve_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.warmup:
            warmup.check_warm_up_reserve(self.reserve_prompt_tokens, self.reserve_new_tokens)
        value = self.max_model_len
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 2
        ):
            raise ValueError(f"max_model_len must be None or an integer >= 2, got {value!r}")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ValueError(
                f"shutdown_timeout must be a finite number >= 0, got {self.shutdown_timeout!r}"
            )
        value = self.keepalive_seconds
        if isinstance(value, bool) or not (
            isinstance(value, int | float) and math.isfinite(value) and value > 0
        ):
            raise ValueError(f"keepalive_seconds must be a finite number > 0, got {value!r}")

    def check_fits(self, model: TransformerConfig) -> None:
        """Refuses settings `model` has no room for, from its config alone (so before any weight
        loads): a `max_model_len` beyond its context (it would be served as the context,
        silently), or a reserve beyond it.

        Raises:
            ValueError: naming the setting and the context.
        """
        context = model.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > context:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context of {context} "
                "tokens"
            )
        check_reserve(model, self.reserve_prompt_tokens, self.reserve_new_tokens)


def build_app(target, draft, config: ServerConfig) -> web.Application:
    """The aiohttp application serving `target` (with `draft` for speculative methods).

    Run it with aiohttp's `handler_cancellation=True` (as `serve` and `BackgroundServer` do):
    without it a client that disconnects does not cancel its handler, and its request decodes to
    its max_tokens for nobody, holding a batch row.

    Raises:
        ValueError: `target` has no tokenizer; `config.decoding` does not pair with `draft`
            (`DecodeSession`: a speculative method without a draft of its variant, "ar" with
            one, a draft that does not fit `target`); or `max_model_len` or the reserve exceeds
            the model's context (`ServerConfig.check_fits`).
    """
    if target.tokenizer is None:
        raise ValueError(
            f"{target.path} has no tokenizer; the server needs one to read and write text"
        )
    config.check_fits(target.config)
    name = config.model_name or served_model_name(target.path)
    scheduler = Scheduler(
        target,
        draft=draft,
        options=config.decoding,
        max_batch_size=config.max_batch_size,
        queue_size=config.queue_size,
        chunk_steps=config.chunk_steps,
        pad_batch=config.pad_batch,
        continuous=config.continuous_batching,
        reserve=(config.reserve_prompt_tokens, config.reserve_new_tokens),
        warm_up=config.warmup,
        metrics=ServerMetrics(),
    )
    context = target.config.max_position_embeddings
    model = ModelInfo(
        name=name,
        tokenizer=target.tokenizer,
        context_length=config.max_model_len or context,
        default_max_tokens=config.default_max_tokens,
    )
    return create_app(
        scheduler,
        model,
        api_key=config.api_key,
        keepalive_seconds=config.keepalive_seconds,
        shutdown_timeout=config.shutdown_timeout,
    )


def serve(target, draft, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000):
    """Serves until SIGINT/SIGTERM, then shuts down gracefully: stops listening, fails waiting
    requests with 503, lets running ones finish for `config.shutdown_timeout` seconds, cancels the
    rest (answered 503).

    Args:
        target: a loaded `Target` with a tokenizer.
        draft: the draft head of `config.decoding`'s speculative method; None for "ar".
        config: how to serve (`ServerConfig`).
        host: the address to bind.
        port: the TCP port to bind; 0: any free port.

    Raises:
        ValueError: as `build_app`, before anything is bound.
        OSError: `host` and `port` cannot be bound (e.g. the port is in use).
    """
    app = build_app(target, draft, config)
    # The address is aiohttp's line ("Running on ..."): the bound port (port 0 picks one), with
    # an IPv6 host in brackets.
    logger.info("serving %s", config.decoding.method)
    web.run_app(
        app,
        host=host,
        port=port,
        shutdown_timeout=config.shutdown_timeout + SHUTDOWN_ANSWER_SECONDS,  # see create_app
        print=lambda msg: logger.warning("%s", msg),
        access_log=None,
        # A client that disconnects cancels its handler, whose `finally` cancels the job (else a
        # non-streaming request would decode to its max_tokens for nobody, holding a batch row).
        handler_cancellation=True,
    )


class BackgroundServer:
    """The server on its own thread and event loop, bound to `host` (port 0: any free port).

    A context manager: entering starts it (and its scheduler), leaving shuts it down as a signal
    would. `app` is the aiohttp application (its scheduler: `app[SCHEDULER]`).
    """

    def __init__(
        self,
        target,
        draft=None,
        config: ServerConfig = ServerConfig(),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        """Builds the application (`build_app`); nothing runs until `start` (or `with`).

        Args:
            target, draft, config: as `build_app`'s.
            host: the address to bind.
            port: the TCP port to bind; 0 (the default): any free port, which `url` names
                once started.

        Raises:
            ValueError: as `build_app`.
        """
        self.app = build_app(target, draft, config)
        self._host, self._port, self._config = host, port, config
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def start(self) -> BackgroundServer:
        """Starts the loop thread, the scheduler and the listener; a failed start (e.g. the port
        is taken) shuts down whatever had started before re-raising."""
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(
            self.app,
            shutdown_timeout=self._config.shutdown_timeout + SHUTDOWN_ANSWER_SECONDS,  # see serve()
            access_log=None,
            handler_cancellation=True,  # see serve()
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def stop(self) -> None:
        """Graceful shutdown (as on SIGTERM), then the loop and thread end."""
        if self._runner is not None:
            future = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            # aiohttp waits its timeout twice for a handler that does not end (say, writing to a
            # client that stopped reading) before cancelling it.
            limit = self._config.shutdown_timeout + SHUTDOWN_ANSWER_SECONDS
            future.result(timeout=2 * limit + 60)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
