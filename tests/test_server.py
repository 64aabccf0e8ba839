"""The OpenAI-compatible server in-process on a tiny random model with a character tokenizer.

Every server here decodes padded batches of 4 rows with prompts of <= 16 tokens and <= 16 new
tokens, so all requests share one compiled bucket per method.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import errno
import io
import json
import logging
import math
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import jinja2
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import jetspec_jax
import serve as serve_py
from jetspec_jax import DecodingOptions
from jetspec_jax.adapter import init_adapter
from jetspec_jax.bench.load import markdown, run_load
from jetspec_jax.decoding import warmup
from jetspec_jax.decoding.results import GenerationResult, Timing, row_result
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.prompting import encode_prompt
from jetspec_jax.sampling import MAX_TOP_K, MIN_TEMPERATURE, SamplingParams
from jetspec_jax.serving import BackgroundServer, ServerConfig, openai_responses, serve
from jetspec_jax.serving import app as app_module
from jetspec_jax.serving import server as server_module
from jetspec_jax.serving.app import SCHEDULER
from jetspec_jax.serving.metrics import CONTENT_TYPE_LATEST
from jetspec_jax.serving.openai_requests import (
    ModelInfo,
    RequestError,
    parse_chat,
    parse_completion,
)
from jetspec_jax.serving.scheduler import Failed, Finished, Job, QueueFull, Scheduler, Tokens
from tests.oracles import OracleDraft
from tests.text_fixtures import metaspace_tokenizer, with_tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = "tiny"
KEY = "test-key"
BATCH = 4
CONFIG = ServerConfig(
    model_name=MODEL,
    api_key=KEY,
    max_batch_size=BATCH,
    queue_size=8,
    chunk_steps=3,
    pad_batch=True,
    shutdown_timeout=10,
    max_model_len=512,  # below the tiny model's 2048
)


@pytest.fixture(scope="module")
def target_dir(checkpoints, tmp_path_factory):
    return with_tokenizer(checkpoints.get("qwen3")[0], tmp_path_factory.mktemp("text") / "tiny")


@pytest.fixture(scope="module")
def target(target_dir):
    return jetspec_jax.load_target(target_dir)


@pytest.fixture(scope="module")
def server(target):
    with BackgroundServer(target, None, CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _library(target, prompt_ids, max_tokens, sampling=None):
    """The text and result of decoding alone with the library (greedy unless `sampling` says
    otherwise), in the server's bucket."""
    session = DecodeSession(
        target,
        [prompt_ids],
        max_new_tokens=max_tokens,
        sampling=[SamplingParams() if sampling is None else sampling],  # the seed as given
        pad_batch_to=BATCH,
    )
    session.start()
    session.advance()
    result = session.results()[0]
    return target.tokenizer.decode(result.tokens, skip_special_tokens=True), result


def _chat_ids(target, messages):
    rendered = target.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return target.tokenizer.encode(rendered, add_special_tokens=False)


def _complete(http, prompt="Hi", max_tokens=2, **kwargs):
    body = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs)
    return http.post("/v1/completions", json=body)


def _stream_with_usage(http, **kwargs):
    """A streamed completion whose last chunk carries the usage."""
    return _complete(http, stream=True, stream_options={"include_usage": True}, **kwargs)


def _wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_models_health_and_api_key(server, http, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # OpenAI's model objects, checked as sent (the SDK would take any "object" field).
    model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "jetspec_jax"}
    assert http.get("/v1/models").json() == {"object": "list", "data": [model]}
    assert http.get(f"/v1/models/{MODEL}").json() == model
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.body["code"] == "model_not_found"
    # Counted under the route's pattern: the ids clients send cannot grow the metrics.
    retrieved = _labelled(
        http, "jetspec_requests_total", endpoint="/v1/models/{model}", status="404"
    )
    assert retrieved >= 1 and "gpt-9" not in http.get("/metrics").text
    health = httpx.get(server.url + "/health")  # open without a key
    assert health.status_code == 200 and health.json()["status"] == "ok"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        answer = httpx.get(server.url + "/v1/models", headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    # Auth schemes are case-insensitive (RFC 9110), and spaces may run before the token.
    for value in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):
        answer = httpx.get(server.url + "/v1/models", headers={"Authorization": value})
        assert answer.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    # A key that is not UTF-8 (httpx refuses to send one, so a raw request) is wrong, not a 500.
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\n")
        raw.sendall(b"Connection: close\r\n\r\n")
        assert raw.makefile("rb").readline().split()[1] == b"401"


def test_completion_equals_the_library_and_its_stream(target, client, http):
    ids = target.tokenizer.encode("Hello")
    expected, result = _library(target, ids, 12)
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.text == expected
    assert choice.finish_reason == ("stop" if result.finish_reason == "stop" else "length")
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.usage.completion_tokens == len(result.tokens)
    assert answer.usage.total_tokens == len(ids) + len(result.tokens)
    assert answer.model_extra["jetspec"]["tau"] == pytest.approx(1.0)  # AR: one per forward

    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1  # really streamed in pieces
    assert "".join(texts) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(result.tokens)
    assert chunks[-1].usage.total_tokens == len(ids) + len(result.tokens)
    # As OpenAI's: with include_usage, the chunks before the usage chunk carry "usage": null.
    body = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stream=True)
    raw = http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    assert len(events) > 2 and all(e["usage"] is None for e in events[:-1])
    assert events[-1]["usage"]["completion_tokens"] == len(result.tokens)


def test_prompts_are_templated_and_tokenized_off_the_event_loop(http, monkeypatch):
    threads = []

    def recording(parse):
        def parse_and_record(body, model):
            threads.append(threading.current_thread().name)
            return parse(body, model)

        return parse_and_record

    monkeypatch.setattr(app_module, "parse_completion", recording(parse_completion))
    monkeypatch.setattr(app_module, "parse_chat", recording(parse_chat))
    assert _complete(http).status_code == 200
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert len(threads) == 2 and all(name.startswith("tokenize") for name in threads)


def test_chat_streaming_and_not(target, client):
    messages = [{"role": "system", "content": "Hm"}, {"role": "user", "content": "Hi"}]
    ids = _chat_ids(target, messages)
    assert len(ids) <= 16
    expected, _ = _library(target, ids, 10)
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == len(ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


REQUESTS = [
    dict(prompt="The sky", max_tokens=16, temperature=0),
    dict(prompt="Hello there", max_tokens=5, temperature=0),
    dict(prompt="Why", max_tokens=9, temperature=1.0, seed=11),
    dict(prompt="1, 2, 3,", max_tokens=12, temperature=0.7, top_p=0.9, seed=12),
    dict(prompt="abc", max_tokens=7, temperature=0),
    dict(prompt="Once upon", max_tokens=16, temperature=1.0, top_k=5, seed=13),
    dict(prompt="x", max_tokens=3, temperature=0),
    dict(prompt="Tell me", max_tokens=14, temperature=0),
]


def test_concurrent_requests_are_batched_and_equal_serving_each_alone(server, http):
    alone = [http.post("/v1/completions", json=dict(model=MODEL, **r)) for r in REQUESTS]
    scheduler = server.app[SCHEDULER]
    batches = _sample(http, "jetspec_batch_size_count"), _sample(http, "jetspec_batch_size_sum")
    joined = _sample(http, "jetspec_joined_requests_total")
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        with scheduler.hold():  # all 8 wait, then 4 start a batch and 4 join it
            futures = [
                pool.submit(http.post, "/v1/completions", json=dict(model=MODEL, **r))
                for r in REQUESTS
            ]
            _wait_for(lambda: scheduler.queue_depth == len(REQUESTS))
        together = [f.result() for f in futures]
    for a, t, r in zip(alone, together, REQUESTS, strict=True):
        assert a.status_code == t.status_code == 200, t.text
        assert t.json()["choices"][0]["text"] == a.json()["choices"][0]["text"]
        assert t.json()["usage"]["completion_tokens"] <= r["max_tokens"]
    # Each request above was a batch of its own. Of the 8 together, 4 started a batch and the
    # other 4 joined it as rows freed (every request fits its shapes: prompt and output buckets
    # of 16), before it ended.
    assert _sample(http, "jetspec_batch_size_count") - batches[0] == 1
    assert _sample(http, "jetspec_batch_size_sum") - batches[1] == 4
    assert _sample(http, "jetspec_joined_requests_total") - joined == 4


def test_full_queue_answers_503_and_then_serves_again(server, http):
    scheduler = server.app[SCHEDULER]
    with concurrent.futures.ThreadPoolExecutor(CONFIG.queue_size) as pool:
        with scheduler.hold():
            waiting = [pool.submit(_complete, http) for _ in range(CONFIG.queue_size)]
            _wait_for(lambda: scheduler.queue_depth == CONFIG.queue_size)
            refused = _complete(http)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "overloaded"
            assert "queue is full" in refused.json()["error"]["message"]
            health = http.get("/health").json()  # what waits, apart from what decodes
            assert (health["queue_depth"], health["running"]) == (CONFIG.queue_size, 0)
        assert all(w.result().status_code == 200 for w in waiting)
    assert _complete(http).status_code == 200


def test_a_client_that_disconnects_cancels_its_request(server, http):
    """A non-streaming client that goes away while its request waits: the job is cancelled (it
    leaves the queue count) and never decoded. The request goes over a raw socket, closed once
    the job is seen waiting: no timing involved."""
    scheduler = server.app[SCHEDULER]
    batches = _sample(http, "jetspec_batch_size_count")
    labels = dict(endpoint="/v1/completions", status="499")
    closed = _labelled(http, "jetspec_requests_total", **labels)
    body = json.dumps(dict(model=MODEL, prompt="Hi", max_tokens=16, temperature=0)).encode()
    url = httpx.URL(server.url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with scheduler.hold():
        with socket.create_connection((url.host, url.port), timeout=60) as impatient:
            impatient.sendall(head.encode() + body)
            _wait_for(lambda: scheduler.queue_depth == 1)
        # Held, the queue empties only by the job's cancellation.
        _wait_for(lambda: scheduler.queue_depth == 0)
        assert _sample(http, "jetspec_queue_depth") == 0  # the gauge too, before any batch
    assert _complete(http).status_code == 200
    assert _sample(http, "jetspec_batch_size_count") - batches == 1  # only the last request
    # Counted as closed by the client, not as a server error.
    assert _labelled(http, "jetspec_requests_total", **labels) - closed == 1


def test_a_stream_whose_client_hung_up_ends_quietly(http, monkeypatch, caplog):
    """A streaming client that hangs up (a chat UI's stop button): the next write finds the
    transport closing. That is counted as 499, not logged as a server error with a traceback.
    The write's failure is injected: a real hang-up races the handler's cancellation."""
    import aiohttp

    sse, writes = app_module._sse, []

    async def hung_up_after_two(response, payload):
        writes.append(payload)
        if len(writes) > 2:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await sse(response, payload)

    monkeypatch.setattr(app_module, "_sse", hung_up_after_two)
    labels = dict(endpoint="/v1/completions", status="499")
    closed = _labelled(http, "jetspec_requests_total", **labels)
    with caplog.at_level("ERROR"):
        try:
            _complete(http, max_tokens=16, stream=True)
        except httpx.HTTPError:
            pass  # the server ends the response early; the client may see it cut
        _wait_for(lambda: _labelled(http, "jetspec_requests_total", **labels) - closed == 1)
    assert len(writes) == 3
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    monkeypatch.undo()
    assert _complete(http).status_code == 200


def test_a_failure_mid_stream_is_an_error_event_then_done(http, monkeypatch, caplog):
    """Once the event stream's headers are out, an unexpected error cannot be a new HTTP response
    (it would be written into the body): the client gets an error event and `[DONE]`."""
    add = app_module._Output.add

    def fails_after_some_text(self, tokens):
        if self.tokens >= 3:
            raise KeyError("boom")
        return add(self, tokens)

    monkeypatch.setattr(app_module._Output, "add", fails_after_some_text)
    labels = dict(endpoint="/v1/completions", status="500")
    failed = _labelled(http, "jetspec_requests_total", **labels)
    with caplog.at_level("ERROR"):
        raw = _complete(http, max_tokens=16, stream=True)
    assert raw.status_code == 200
    data = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and "HTTP/1.1" not in raw.text
    assert json.loads(data[-2])["error"]["type"] == "server_error"
    assert "streaming /v1/completions failed" in caplog.text
    _wait_for(lambda: _labelled(http, "jetspec_requests_total", **labels) - failed == 1)
    # The next request on the same keep-alive connection is counted with its own status.
    monkeypatch.setattr(app_module._Output, "add", add)
    ok = dict(endpoint="/v1/completions", status="200")
    served = _labelled(http, "jetspec_requests_total", **ok)
    assert _complete(http).status_code == 200
    assert _labelled(http, "jetspec_requests_total", **ok) - served == 1
    assert _labelled(http, "jetspec_requests_total", **labels) - failed == 1


@pytest.mark.parametrize(
    "accepting, connected, status",
    [(True, True, "499"), (True, False, "499"), (False, False, "499"), (False, True, "503")],
)
def test_a_cancelled_request_is_the_clients_unless_the_server_shuts_down(
    accepting, connected, status
):
    """A handler cancelled while the server accepts requests lost its client (499), as did one
    whose connection closed during the shutdown's grace; one cancelled once the shutdown began,
    its connection open, was cancelled by the server, past its shutdown timeout (503)."""
    counted = []
    requests = types.SimpleNamespace(
        labels=lambda *labels: types.SimpleNamespace(inc=lambda: counted.append(labels))
    )
    scheduler = types.SimpleNamespace(
        accepting=accepting, metrics=types.SimpleNamespace(requests=requests)
    )
    route = types.SimpleNamespace(resource=types.SimpleNamespace(canonical="/v1/completions"))
    request = types.SimpleNamespace(
        match_info=types.SimpleNamespace(route=route),
        app={SCHEDULER: scheduler},
        transport=object() if connected else None,  # aiohttp's, None once the client is gone
    )

    async def cancelled(request):
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(app_module._count(request, cancelled))
    assert counted == [("/v1/completions", status)]


def test_a_body_over_the_limit_gets_413_naming_it(http):
    """The limit follows the context (64 bytes a token), 1 MiB at least: the tiny model's."""
    assert app_module.max_body_bytes(131072) == 8 * 2**20
    prompt = "x" * (2**20 + 1)
    answer = http.post("/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=1))
    assert answer.status_code == 413
    assert "Maximum request body size 1048576 exceeded" in answer.json()["error"]["message"]
    assert _complete(http).status_code == 200


def test_every_chunk_of_a_stream_carries_the_streams_created_time(http, monkeypatch):
    """OpenAI's chunks share one `created`; a clock read per chunk would give each its own."""
    from jetspec_jax.serving import app, openai_responses

    ticks = iter(range(1_000, 2_000))
    clock = types.SimpleNamespace(time=lambda: next(ticks), perf_counter=time.perf_counter)
    # The stream reads the clock in the app (the latency metrics read perf_counter there too).
    for module in (app, openai_responses):
        monkeypatch.setattr(module, "time", clock)
    body = dict(model=MODEL, max_tokens=12, temperature=0, stream=True)
    for path, extra in (
        ("/v1/completions", dict(prompt="Hello", stream_options={"include_usage": True})),
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hello"}])),
    ):
        raw = http.post(path, json={**body, **extra})
        events = [json.loads(x[6:]) for x in raw.text.splitlines() if x.startswith("data: {")]
        created = {e["created"] for e in events}
        assert len(events) > 2 and len(created) == 1, events
        assert created <= set(range(1_000, 2_000))  # the clock's, read once


def test_serve_cancels_the_handlers_of_disconnected_clients(target, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(server_module.web, "run_app", lambda app, **kw: calls.append(kw))
    with caplog.at_level(logging.INFO, logger=server_module.logger.name):
        serve(target, None, CONFIG, port=0)
    assert calls[0]["handler_cancellation"] is True
    # Port 0 is bound to a free port only in run_app, whose "Running on" line names the URL.
    assert caplog.messages == ["serving ar"]


def _job(events: queue.Queue | None = None) -> Job:
    deliver = events.put if events is not None else (lambda event: None)
    return Job([5, 6, 7], 4, SamplingParams(), deliver)


def _last_event(events: queue.Queue):
    while isinstance(event := events.get(timeout=120), Tokens):
        pass
    return event


def test_jobs_cancelled_while_waiting_leave_their_place_in_the_queue(target):
    scheduler = Scheduler(target, queue_size=1)  # not started: jobs only wait
    gone = _job()
    scheduler.submit(gone)
    gone.cancel()
    scheduler.submit(_job())  # takes the cancelled job's place
    assert scheduler.queue_depth == 1
    with pytest.raises(QueueFull):
        scheduler.submit(_job())


def test_a_row_that_ends_early_is_answered_while_its_batch_decodes(target):
    """A job's `Finished` comes at the chunk boundary where its row ends, not when its batch
    does: a 2-token request batched with a 40-token one is answered before the long one's last
    tokens are decoded, and both answers are what each gets alone."""
    log = []  # (job, event) in delivery order: one worker thread delivers them all
    budgets = {"short": 2, "long": 40}
    scheduler = Scheduler(target, max_batch_size=2, chunk_steps=2)
    scheduler.start()
    try:
        with scheduler.hold():  # one batch
            for name, budget in budgets.items():
                deliver = lambda event, name=name: log.append((name, event))  # noqa: E731
                scheduler.submit(Job([5, 6, 7], budget, SamplingParams(), deliver))
        _wait_for(lambda: sum(isinstance(event, Finished) for _, event in log) == 2, 120)
    finally:
        scheduler.stop()
    finished = {name: i for i, (name, event) in enumerate(log) if isinstance(event, Finished)}
    after = [e for name, e in log[finished["short"] :] if name == "long" and isinstance(e, Tokens)]
    assert after, "the short job's answer waited for the long one"
    for name, budget in budgets.items():
        result = log[finished[name]][1].result
        alone = jetspec_jax.generate(target, [5, 6, 7], max_new_tokens=budget)
        assert result.tokens == alone.tokens and result.finish_reason == alone.finish_reason
        streamed = [t for n, e in log if n == name and isinstance(e, Tokens) for t in e.tokens]
        assert streamed == result.tokens


def test_a_failure_after_decoding_fails_the_batch_and_the_worker_lives_on(target, monkeypatch):
    class Broken:
        def inc(self, amount=1):
            raise RuntimeError("metrics broke")

    scheduler = Scheduler(target, max_batch_size=BATCH, chunk_steps=3, pad_batch=True)
    scheduler.start()
    try:
        events = queue.Queue()
        with monkeypatch.context() as patch:
            patch.setattr(scheduler.metrics, "generated_tokens", Broken())
            scheduler.submit(_job(events))
            failed = _last_event(events)
        assert isinstance(failed, Failed) and failed.status == 500
        assert "see the server log" in failed.message  # not the exception's text
        scheduler.submit(_job(events))
        assert isinstance(_last_event(events), Finished)
    finally:
        scheduler.stop()


def test_a_prompt_the_scheduler_refuses_names_the_request_field(server, http, monkeypatch):
    def refuse(prompt_ids, max_new_tokens):
        raise ValueError("prompt holds token id 99, outside the vocabulary [0, 97)")

    monkeypatch.setattr(server.app[SCHEDULER], "check", refuse)
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=messages))
    assert (chat.status_code, chat.json()["error"]["param"]) == (400, "messages")
    completion = _complete(http)
    assert (completion.status_code, completion.json()["error"]["param"]) == (400, "prompt")


USER = [{"role": "user", "content": "x"}]
BAD = [
    # (path, body (dict) or raw bytes, status, what the message or param names)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", dict(prompt="Hi"), 400, "model"),
    ("/v1/completions", dict(model="gpt-9", prompt="Hi"), 404, "gpt-9"),
    ("/v1/completions", dict(model=MODEL), 400, "prompt"),
    ("/v1/chat/completions", dict(model=MODEL), 400, "messages"),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=[{"role": "bot", "content": "x"}]),
        400,
        "role",
    ),
    ("/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user"}]), 400, "content"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", temperature=-1), 400, "temperature"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", temperature=3), 400, "temperature"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", temperature=2.01), 400, "temperature"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", temperature=1e-39), 400, "temperature"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", top_p=1.5), 400, "top_p"),
    # Past float's range: OverflowError in the finiteness check answered 500.
    ("/v1/completions", dict(model=MODEL, prompt="Hi", temperature=10**400), 400, "temperature"),
    # JSON admits unpaired surrogates; the tokenizer's TypeError answered 500.
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', 400, "surrogate"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "Hi", "stop": "\\udfff"}', 400, "stop"),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}',
        400,
        "messages[0]",
    ),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", top_k="5"), 400, "top_k"),
    # Before the check, an int32 overflow on the device failed every request of the batch.
    ("/v1/completions", dict(model=MODEL, prompt="Hi", top_k=2**31), 400, "top_k"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff"}', 400, "malformed JSON"),
    ("/v1/completions", dict(model=MODEL, prompt=[]), 400, "non-empty"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", seed=2**64), 400, "seed"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", n=2), 400, "n"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", n=True), 400, "n"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", stream="yes"), 400, "stream"),
    (
        "/v1/completions",
        dict(model=MODEL, prompt="Hi", stream_options={"include_usage": True}),
        400,
        "only allowed when stream is true",
    ),
    (
        "/v1/completions",
        dict(model=MODEL, prompt="Hi", stream=True, stream_options={"include_usage": "false"}),
        400,
        "include_usage must be a boolean",
    ),
    (
        "/v1/completions",
        dict(model=MODEL, prompt="Hi", stream=True, stream_options=[]),
        400,
        "stream_options must be an object",
    ),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", logprobs=2), 400, "logprobs"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", logprobs=0), 400, "logprobs"),
    # No max_tokens sent: the message does not ask to lower it.
    ("/v1/completions", dict(model=MODEL, prompt="x" * 2100), 400, "no token is left for the"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", max_tokens=4000), 400, "context"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", max_tokens=600), 400, "512"),
    ("/v1/completions", dict(model=MODEL, prompt=[5, 500]), 400, "500"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", stop=[1]), 400, "stop"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", stop=list("abcde")), 400, "stop"),
    (
        "/v1/chat/completions",
        dict(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            max_completion_tokens=0,
        ),
        400,
        "max_completion_tokens",
    ),
    (  # the older budget field is checked though max_completion_tokens is the one used
        "/v1/chat/completions",
        dict(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens="lots",
            max_completion_tokens=4,
        ),
        400,
        "max_tokens must be an integer",
    ),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=[{"role": "user", "content": "x"}], best_of=3),
        400,
        "best_of",
    ),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=[{"role": "user", "content": "x"}], suffix="z"),
        400,
        "suffix",
    ),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    # vLLM's extensions away from their neutral values would change the output: refused.
    ("/v1/completions", dict(model=MODEL, prompt="Hi", min_p=0.1), 400, "min_p"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", repetition_penalty=1.2), 400, "1.2"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", ignore_eos=True), 400, "ignore_eos"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", min_tokens=4), 400, "min_tokens"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", truncate_prompt_tokens=1), 400, "truncate"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", presence_penalty=False), 400, "presence"),
    ("/v1/completions", dict(model=MODEL, prompt="Hi", add_special_tokens=False), 400, "add_s"),
    (
        "/v1/chat/completions",
        dict(
            model=MODEL,
            messages=[{"role": "assistant", "content": "The answer is"}],
            continue_final_message=True,
        ),
        400,
        "continue_final_message",
    ),
    (
        "/v1/chat/completions",
        dict(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            chat_template_kwargs={"documents": []},
        ),
        400,
        "chat_template_kwargs",
    ),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=[{"role": "user", "content": "x"}], guided_regex="a+"),
        400,
        "guided_regex",
    ),
    (
        "/v1/chat/completions",
        dict(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
        ),
        400,
        "response_format",
    ),
    ("/v1/completions", dict(model=None, prompt="Hi"), 400, "model must be a string"),
    # A forced tool call, even with no tools given, is not a text answer.
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=USER, tool_choice="required"),
        400,
        "tool_",
    ),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=USER, tool_choice={"type": "function", "function": {}}),
        400,
        "tool_choice",
    ),
    ("/v1/chat/completions", dict(model=MODEL, messages=USER, function_call={}), 400, "function_"),
    # A tool call in the history: the template would render it, and it was dropped.
    (
        "/v1/chat/completions",
        dict(
            model=MODEL,
            messages=[*USER, {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
        ),
        400,
        "messages[1].tool_calls",
    ),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=[{"role": "user", "content": "x", "name": 3}]),
        400,
        "messages[0].name",
    ),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=[{"role": "user", "content": []}]),
        400,
        "empty",
    ),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=USER, modalities=["text", "audio"]),
        400,
        "modal",
    ),
    ("/v1/chat/completions", dict(model=MODEL, messages=USER, audio={"voice": "x"}), 400, "audio"),
    (
        "/v1/chat/completions",
        dict(model=MODEL, messages=USER, documents=[{"t": "x"}]),
        400,
        "documents",
    ),
    (
        "/v1/completions",
        dict(
            model=MODEL, prompt="Hi", stream=True, stream_options={"continuous_usage_stats": True}
        ),
        400,
        "continuous_usage_stats",
    ),
]


@pytest.mark.parametrize("path, body, status, names", BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_requests_get_4xx_and_the_next_request_works(http, path, body, status, names):
    if isinstance(body, bytes):
        answer = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        answer = http.post(path, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert names in error["message"] or names == error["param"], error
    assert error["type"] == "invalid_request_error"
    assert _complete(http).status_code == 200


def test_extensions_at_their_neutral_values_are_accepted(http):
    neutral = dict(
        min_p=0.0,
        repetition_penalty=1,
        ignore_eos=False,
        stop_token_ids=[],
        skip_special_tokens=True,
        response_format={"type": "text"},
        guided_json=None,
        presence_penalty=0.0,
        top_logprobs=0,
        logit_bias={"5": 0},
        stream=None,  # null: the default, not streamed
    )
    plain = _complete(http, prompt="The sky", max_tokens=4).json()
    same = _complete(http, prompt="The sky", max_tokens=4, add_special_tokens=True, **neutral)
    assert same.status_code == 200, same.text
    assert same.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    unset = dict(stream=True, stream_options={"include_usage": None})  # null: the default, false
    assert _complete(http, prompt="The sky", max_tokens=4, **unset).status_code == 200
    chat = dict(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    chat_neutral = dict(
        echo=False,
        add_generation_prompt=True,
        continue_final_message=False,
        add_special_tokens=False,
        chat_template_kwargs={"enable_thinking": False},
        tool_choice="auto",
        function_call="none",
        modalities=["text"],
        documents=[],
        **neutral,
    )
    plain = http.post("/v1/chat/completions", json=chat).json()
    same = http.post("/v1/chat/completions", json={**chat, **chat_neutral})
    assert same.status_code == 200, same.text
    assert same.json()["choices"][0]["message"] == plain["choices"][0]["message"]


def test_the_bounds_of_the_sampling_and_stop_fields_are_accepted(http):
    """OpenAI's limits are inclusive: temperature 2 and four stop strings are served; vLLM's
    `top_k=-1` means no top-k, as an unset one."""
    hot = dict(model=MODEL, prompt="Hi", max_tokens=2, temperature=2.0)
    assert http.post("/v1/completions", json=hot).status_code == 200
    assert _complete(http, prompt="Hi", max_tokens=2, stop=list("@#$%")).status_code == 200
    sampled = dict(model=MODEL, prompt="The sky", max_tokens=6, temperature=0.7, seed=3)
    plain = http.post("/v1/completions", json=sampled).json()
    minus_one = http.post("/v1/completions", json={**sampled, "top_k": -1})
    assert minus_one.status_code == 200, minus_one.text
    assert minus_one.json()["choices"][0]["text"] == plain["choices"][0]["text"]


def test_max_completion_tokens_takes_precedence_over_max_tokens(http):
    """OpenAI's chat budget is `max_completion_tokens`; the older `max_tokens` applies only when
    it is unset."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0)
    both = http.post(
        "/v1/chat/completions", json={**chat, "max_tokens": 16, "max_completion_tokens": 2}
    )
    assert both.status_code == 200, both.text
    answer = both.json()
    assert answer["usage"]["completion_tokens"] == 2
    assert answer["choices"][0]["finish_reason"] == "length"
    alone = http.post("/v1/chat/completions", json={**chat, "max_tokens": 3}).json()
    assert alone["usage"]["completion_tokens"] == 3


def test_chat_text_parts_are_joined_by_newlines(http):
    def reply(content):
        body = dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6)
        answer = http.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert reply(parts) == reply("Hello\nthere")
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    body = dict(model=MODEL, messages=[{"role": "user", "content": image}])
    refused = http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and "only text parts" in refused.json()["error"]["message"]


def test_answers_carry_openais_ids_and_a_chat_choice_its_fields(http):
    """A chat answer's id begins "chatcmpl-", a completion's "cmpl-", streamed or not (every
    chunk carries its stream's id), and a chat choice has OpenAI's fields, `logprobs` null."""

    def stream_ids(path, body):
        streamed = http.post(path, json={**body, "stream": True})
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return {json.loads(e)["id"] for e in events[:-1]}

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    answer = http.post("/v1/chat/completions", json={**chat, "temperature": 0}).json()
    assert answer["id"].startswith("chatcmpl-")
    choice = answer["choices"][0]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": choice["message"]["content"]},
        "logprobs": None,
        "finish_reason": "length",
    }
    (chat_stream,) = stream_ids("/v1/chat/completions", chat)
    assert chat_stream.startswith("chatcmpl-") and chat_stream != answer["id"]
    assert _complete(http).json()["id"].startswith("cmpl-")
    (completion_stream,) = stream_ids(
        "/v1/completions", dict(model=MODEL, prompt="Hi", max_tokens=2)
    )
    assert completion_stream.startswith("cmpl-")


class _RecordingTokenizer:
    """A chat tokenizer that records what each template rendering gets: the messages and
    `enable_thinking`."""

    chat_template = "{{ messages }}"

    def __init__(self):
        self.messages, self.thinking = [], []

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt, **kwargs):
        self.messages.append(messages)
        self.thinking.append(kwargs["enable_thinking"])
        return "Hi"

    def encode(self, text, add_special_tokens):
        return [1, 2]


def test_chat_template_kwargs_pass_enable_thinking_to_the_template():
    model = ModelInfo(name=MODEL, tokenizer=_RecordingTokenizer(), context_length=64)
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}, {}):
        parse_chat({**body, "chat_template_kwargs": kwargs}, model)
    assert model.tokenizer.thinking == [False, True, False, False]
    with pytest.raises(RequestError, match="only enable_thinking"):
        parse_chat({**body, "chat_template_kwargs": {"enable_thinking": "yes"}}, model)


def test_a_rendered_chat_is_encoded_without_a_second_bos():
    """The rendered template already holds its special tokens (a Llama template its BOS): only
    a raw prompt has them added."""

    class WithBos(_RecordingTokenizer):
        def encode(self, text, add_special_tokens):
            return [0] * add_special_tokens + [1, 2]  # 0: the BOS

    assert encode_prompt(WithBos(), "Hi", chat=True) == [1, 2]
    assert encode_prompt(WithBos(), "Hi", chat=False) == [0, 1, 2]


def test_a_prompt_encoding_passes_each_switch_on():
    """`PromptEncoding.encode` (evaluation prompts, encoded as the training data was) renders
    with its own system message and thinking switch."""
    from jetspec_jax.prompting import PromptEncoding

    tokenizer = _RecordingTokenizer()
    PromptEncoding(system="Be brief.", thinking=True).encode(tokenizer, "Hi")
    assert tokenizer.thinking == [True]
    assert tokenizer.messages[0][0] == {"role": "system", "content": "Be brief."}


def test_a_messages_name_reaches_the_template():
    model = ModelInfo(name=MODEL, tokenizer=_RecordingTokenizer(), context_length=64)
    named = [{"role": "user", "content": "Hi", "name": "ada"}, {"role": "user", "content": "Yo"}]
    parse_chat(dict(model=MODEL, messages=named), model)
    assert model.tokenizer.messages == [named]


def test_a_developer_message_reaches_the_template_as_a_system_message():
    """OpenAI's "developer" role is the newer name of "system": chat templates know only the
    latter, so the turn is renamed before rendering."""

    model = ModelInfo(name=MODEL, tokenizer=_RecordingTokenizer(), context_length=64)
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    parse_chat(dict(model=MODEL, messages=turns), model)
    assert model.tokenizer.messages == [[{"role": "system", "content": "Be brief."}, turns[1]]]


def test_the_jetspec_statistics_read_the_results_rounds_and_phases():
    """`target_forwards` counts verification rounds (the prefill's included), not tokens, and
    each phase's seconds are its own: a speculative result tells them apart."""
    timing = Timing(prefill_seconds=0.25, decode_seconds=1.5, compile_seconds=3.0)
    result = GenerationResult(
        tokens=[5, 6, 7, 8, 9, 10],
        acceptance_lengths=[1, 3, 2],
        finish_reason="length",
        prompt_length=4,
        timing=timing,
    )
    assert openai_responses.stats(result) == {
        "jetspec": {
            "tau": 2.5,
            "target_forwards": 3,
            "prefill_seconds": 0.25,
            "decode_seconds": 1.5,
            "compile_seconds": 3.0,
        }
    }
    assert openai_responses.stats(None) == {}


def test_a_result_with_no_token_after_the_first_decodes_at_zero_tokens_per_second():
    """Decode speed counts the tokens after the first: a row that has none (cancelled or read
    before its prefill, or done at its first token) reads 0, never a negative speed."""
    timing = Timing(prefill_seconds=0.5, decode_seconds=2.0, compile_seconds=0.0)
    for tokens, speed in (([], 0.0), ([5], 0.0), ([5, 6, 7], 1.0)):
        result = GenerationResult(
            tokens=tokens,
            acceptance_lengths=[1] * len(tokens),
            finish_reason=None,
            prompt_length=4,
            timing=timing,
        )
        assert result.decode_tokens_per_second == speed


def test_top_p_zero_is_greedy_and_a_seed_is_any_64_bit_integer(http):
    greedy = _complete(http, prompt="The sky", max_tokens=6).json()["choices"][0]["text"]
    sampled = dict(model=MODEL, prompt="The sky", max_tokens=6, temperature=1.0, top_p=0)
    for seed in (-1, 2**63 - 1):
        answer = http.post("/v1/completions", json={**sampled, "seed": seed})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == greedy


def test_a_requests_sampling_settings_reach_decoding(target, http):
    """A sampled request decodes with its own temperature, top-k and seed: its tokens are the
    library's with those settings, in the server's bucket. Its seed is folded to 32 bits (2**32 +
    13 draws as 13), and another seed draws other text: 16 tokens among 5 at temperature 1.5."""
    ids = target.tokenizer.encode("Once upon")
    sampled = dict(model=MODEL, prompt="Once upon", max_tokens=16, temperature=1.5, top_k=5)
    sampling = SamplingParams(temperature=1.5, top_k=5, seed=13)
    expected, result = _library(target, ids, 16, sampling)

    def completion(seed):  # (text, tokens)
        answer = http.post("/v1/completions", json={**sampled, "seed": seed})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"], answer.json()["usage"]["completion_tokens"]

    assert completion(13) == completion(2**32 + 13) == (expected, len(result.tokens))
    assert completion(14)[0] != expected


@pytest.mark.parametrize(
    "seed, folded",
    [
        (2**32 - 1, 2**32 - 1),
        (2**31 + 5, 2**31 + 5),
        (-1, 2**32 - 1),
        (2**64 - 1, 2**32 - 1),
        (-(2**63), 0),  # int64's least
    ],
)
def test_a_seed_folds_modulo_2_to_the_32(seed, folded):
    """A seed folds to its 32 low bits, the top one included: a 32-bit seed is used as given and
    -1 wraps to 2**32 - 1. (A fold into fewer bits would draw two seeds' text alike; the
    served test above checks 2**32 + 13, which any fold of 32 bits or fewer maps to 13.)"""
    body = dict(model=MODEL, prompt=[1, 2], max_tokens=2, temperature=1.0, seed=seed)
    assert parse_completion(body, ModelInfo(MODEL, None, 64)).sampling.seed == folded


def test_a_request_its_stop_string_ended_is_answered_though_its_batch_fails_after(
    target, http, monkeypatch
):
    """The row decodes on until the stop string's cancellation lands; its batch failing in that
    window (a joiner's admission out of memory, say) must not turn the finished answer into a
    500. The answer has no `jetspec` statistics: the row's result was lost with the batch."""
    ids = target.tokenizer.encode("The sky")
    full, result = _library(target, ids, 16)
    stop = full[4:6]
    expected = full[: full.index(stop)]

    def decode_then_fail(self, batch, tokens, finish, joined):
        (job,) = batch
        tokens(job, result.tokens)
        _wait_for(lambda: job.cancelled)  # the handler saw the stop string
        raise RuntimeError("out of memory")

    monkeypatch.setattr(Scheduler, "_decode", decode_then_fail)
    answer = _complete(http, prompt="The sky", max_tokens=16, stop=stop)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "jetspec" not in body
    streamed = _stream_with_usage(http, prompt="The sky", max_tokens=16, stop=stop)
    assert _sse_text(streamed.text) == expected
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:7] == "{"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == body["usage"] and "jetspec" not in chunks[-1]


def test_a_model_name_with_a_slash_is_retrieved_escaped_or_not(target):
    """`--model-name org/model` (as vLLM's names go): curl and older SDKs send the slash as is."""
    config = dataclasses.replace(CONFIG, model_name="org/tiny", api_key=None)
    with BackgroundServer(target, None, config) as running:
        for path in ("/v1/models/org/tiny", "/v1/models/org%2Ftiny"):
            answer = httpx.get(running.url + path)
            assert (answer.status_code, answer.json().get("id")) == (200, "org/tiny"), answer.text
        answer = httpx.get(running.url + "/v1/models/org/other")
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "model_not_found"


def test_unknown_routes_and_methods_answer_json_errors(http):
    # Counted under one label, whatever the path: a scanner's paths cannot grow the metrics.
    labels = dict(endpoint="other", status="404")
    unknown = _labelled(http, "jetspec_requests_total", **labels)
    missing = http.get("/v1/nothing")
    assert missing.status_code == 404
    # An OpenAI error object whose code is the status, as a string (clients branch on it).
    assert missing.json() == {
        "error": {
            "message": "Not Found",
            "type": "invalid_request_error",
            "param": None,
            "code": "404",
        }
    }
    assert http.get("/wp-admin").status_code == 404
    assert _labelled(http, "jetspec_requests_total", **labels) - unknown == 2
    assert "/wp-admin" not in http.get("/metrics").text
    labels = dict(endpoint="/v1/completions", status="405")
    wrongly = _labelled(http, "jetspec_requests_total", **labels)
    wrong = http.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "405"
    assert "POST" in wrong.headers["Allow"]
    assert _labelled(http, "jetspec_requests_total", **labels) - wrongly == 1


def test_stop_strings_cut_the_output(target, server, http):
    full = _complete(http, prompt="The sky", max_tokens=16).json()["choices"][0]["text"]
    assert len(full) >= 8
    stop = full[4:6]
    expected = full[: full.index(stop)]
    answer = _complete(http, prompt="The sky", max_tokens=16, stop=[stop, "@@@@"]).json()
    assert answer["choices"][0] == {
        "index": 0,
        "text": expected,
        "logprobs": None,
        "finish_reason": "stop",
    }
    second = _complete(http, prompt="The sky", max_tokens=16, stop=["@@@@", stop]).json()
    assert second["choices"][0] == answer["choices"][0]  # every stop string is looked for
    streamed = _complete(http, prompt="The sky", max_tokens=16, stop=stop, stream=True)
    assert _sse_text(streamed.text) == expected
    # The text held back while it could begin the stop string sends no empty chunk.
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:7] == "{"]
    assert all(e["choices"][0]["text"] for e in events if not e["choices"][0]["finish_reason"])
    # usage counts the tokens up to the one completing the stop string, not those the row
    # decoded before its cancellation landed.
    _, result = _library(target, target.tokenizer.encode("The sky"), 16)
    decode = target.tokenizer.decode
    upto = next(
        n for n in range(1, 17) if stop in decode(result.tokens[:n], skip_special_tokens=True)
    )
    assert answer["usage"]["completion_tokens"] == upto
    # The stop string cancels the row. It decodes on until the cancellation lands: the chunks
    # the worker decodes before the handler reads the hit, a few (more on a busy machine, so
    # the bound is loose), never the ~130 chunks of its budget.
    generated = _sample(http, "jetspec_generated_tokens_total")
    long = _complete(http, prompt="The sky", max_tokens=400, stop=stop).json()
    _wait_for(lambda: server.app[SCHEDULER].running == 0)
    decoded = _sample(http, "jetspec_generated_tokens_total") - generated
    assert long["choices"][0]["text"] == expected and long["usage"]["completion_tokens"] == upto
    assert upto <= decoded < 100
    usage = _stream_with_usage(http, prompt="The sky", max_tokens=16, stop=stop)
    chunks = [json.loads(line[6:]) for line in usage.text.splitlines() if line[6:7] == "{"]
    assert chunks[-1]["usage"]["completion_tokens"] == upto


def test_speculative_server_rows_finish_apart_and_equal_the_autoregressive_server(
    target, http, caplog
):
    """A speculative server whose draft is right for some rows of its batch and wrong for the
    others: batched rows with ragged acceptance (all drafts accepted vs none) and budgets
    (finishing at different rounds) answer exactly as the autoregressive server does."""
    greedy = [r for r in REQUESTS if r["temperature"] == 0][:BATCH]
    expected = [http.post("/v1/completions", json=dict(model=MODEL, **r)) for r in greedy]
    # The oracle drafts each row's greedy continuation by position (rows in submission order);
    # rows 1 and 3 get every token shifted by one, so all their drafts are rejected.
    right = [True, False, True, False]
    continuation = np.zeros((BATCH, 64), np.int32)
    for row, r in enumerate(greedy):
        ids = target.tokenizer.encode(r["prompt"])
        sequence = np.asarray(ids + _library(target, ids, r["max_tokens"])[1].tokens)
        if not right[row]:
            sequence = (sequence + 1) % target.config.vocab_size
        continuation[row, : len(sequence)] = sequence
    draft = OracleDraft(continuation, 4, target.config.vocab_size)
    config = ServerConfig(
        model_name=MODEL,
        decoding=DecodingOptions("jetspec"),
        max_batch_size=BATCH,
        chunk_steps=2,
        pad_batch=True,
    )
    with (
        caplog.at_level("ERROR"),
        BackgroundServer(target, draft, config) as spec,
        httpx.Client(base_url=spec.url, timeout=120) as spec_http,
    ):
        scheduler = spec.app[SCHEDULER]
        with concurrent.futures.ThreadPoolExecutor(len(greedy)) as pool:
            with scheduler.hold():  # one batch, its rows in the order submitted
                futures = []
                for n, r in enumerate(greedy, 1):
                    body = dict(model=MODEL, **r)
                    futures.append(pool.submit(spec_http.post, "/v1/completions", json=body))
                    _wait_for(lambda n=n: scheduler.queue_depth == n)
            answers = [f.result().json() for f in futures]
        streamed = spec_http.post(
            "/v1/completions", json=dict(model=MODEL, stream=True, **greedy[0])
        )
    for a, e, ok in zip(answers, expected, right, strict=True):
        assert a["choices"][0]["text"] == e.json()["choices"][0]["text"]
        n = a["usage"]["completion_tokens"]
        assert n >= 3, a  # two rounds or more after the prefill's token
        if ok:  # every round accepts the whole block (the last one: what the budget leaves)
            assert a["jetspec"]["tau"] == pytest.approx((n - 1) / math.ceil((n - 1) / 4)), a
        else:
            assert a["jetspec"]["tau"] == pytest.approx(1.0), a
    assert _sse_text(streamed.text) == expected[0].json()["choices"][0]["text"]
    assert len({a["usage"]["completion_tokens"] for a in answers}) > 1  # different lengths
    # Served by the batches themselves: a failed one retried alone would answer the same.
    assert "failed" not in caplog.text, caplog.text


def test_load_tool_measures_the_server(server):
    for clients in (1, 4):
        result = run_load(
            server.url, MODEL, ["Hi", "Sky"], concurrency=clients, requests=6, max_tokens=4,
            api_key=KEY,
        )  # fmt: skip
        assert (result.requests, result.errors) == (6, 0)
        assert 0 < result.ttft_p50 <= result.latency_p50 <= result.latency_p99
        assert result.requests_per_second > 0 and result.tokens_per_second > 0
    assert "| 4 | 6 | 0 |" in markdown([result])


def test_max_tokens_that_fill_the_context_exactly_are_accepted_and_one_more_refused():
    """The check that backs the server's `max_model_len` (the scheduler checks only the model's
    own, larger context): an off-by-one here would serve requests past the advertised limit."""
    model = ModelInfo("tiny", tokenizer=None, context_length=20)  # token-id prompts
    prompt = [5, 6, 7, 8]
    assert (
        parse_completion(dict(model="tiny", prompt=prompt, max_tokens=16), model).max_tokens == 16
    )
    with pytest.raises(RequestError) as refused:
        parse_completion(dict(model="tiny", prompt=prompt, max_tokens=17), model)
    assert refused.value.status == 400
    assert refused.value.body()["error"]["code"] == "context_length_exceeded"


def test_the_server_serves_max_model_len_not_the_models_context(http):
    """CONFIG's `max_model_len` (512, below the tiny model's 2048) is the context a request is
    checked against."""
    refused = _complete(http, prompt=[1, 2, 3], max_tokens=510)
    error = refused.json()["error"]
    assert (refused.status_code, error["code"]) == (400, "context_length_exceeded")
    assert "this model's context is 512 tokens" in error["message"]


def _finished_row(tokens):
    """`row_outputs` of a finished row whose output buffer is exactly its budget."""
    return {
        "output": np.asarray(tokens, np.int32),
        "num_generated": len(tokens),
        "round_lengths": np.ones(len(tokens), np.int32),
        "num_rounds": len(tokens),
        "done": True,
    }


class _LetterTokenizer:
    """Token i is a letter; 9 is the stop token (skipped as special)."""

    added_tokens_decoder = {}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if i != 9)

    def convert_ids_to_tokens(self, i):
        return chr(97 + i % 26)


def test_a_stop_token_that_spends_the_budget_finishes_with_stop():
    """OpenAI's "stop": the model stopped, here on the last token its budget allowed, which
    "length" would misreport (the library's and the server's answers both)."""
    timing = Timing(0.0, 0.0, 0.0)
    assert row_result(_finished_row([4, 5, 9]), 3, (9,), timing, False).finish_reason == "stop"
    assert row_result(_finished_row([4, 5, 6]), 3, (9,), timing, False).finish_reason == "length"
    assert row_result(_finished_row([4, 9]), 3, (9,), timing, True).finish_reason == "stop"
    result = row_result(_finished_row([4, 5, 9]), 3, (9,), timing, False)
    output = app_module._Output(_LetterTokenizer(), ())
    output.add(result.tokens)
    assert output.finish_reason(result) == "stop"
    assert output.completion_tokens(result) == 3  # the stop token counted, as OpenAI counts it


def test_text_held_back_as_a_possible_stop_string_is_emitted_when_none_comes():
    """A response that ends on the start of a stop string ("c" of "cz") ends with that text:
    held back while the stop string could still complete, not lost when it did not."""
    output = app_module._Output(_LetterTokenizer(), ("cz",))
    assert output.add([0, 1, 2]) == "ab"
    assert output.finish() == "c"
    result = row_result(_finished_row([0, 1, 2]), 3, (9,), Timing(0.0, 0.0, 0.0), False)
    assert output.finish_reason(result) == "length"


def test_a_completion_continues_its_prompts_text():
    """/v1/completions' text is what the tokens add to the prompt's: a SentencePiece completion
    " blue" of "The sky is" keeps its leading space (decoded alone it is "blue")."""
    tokenizer = metaspace_tokenizer()
    model = ModelInfo(MODEL, tokenizer, 64)
    req = parse_completion(dict(model=MODEL, prompt="The sky is", max_tokens=5), model)
    tokens = tokenizer.encode(" blue")
    events = asyncio.Queue()
    events.put_nowait(Tokens(tokens))
    result = row_result(_finished_row(tokens), 5, (), Timing(0.0, 0.0, 0.0), False)
    events.put_nowait(Finished(result))
    metrics = types.SimpleNamespace(
        time_to_first_token=types.SimpleNamespace(observe=lambda _: None)
    )
    job = types.SimpleNamespace(cancel=lambda: None)
    collect = app_module._collect(req, job, events, model, metrics, len(req.prompt_ids), 0.0)
    answer = json.loads(asyncio.run(collect).text)
    assert answer["choices"][0]["text"] == " blue"


def test_metrics_parse(server, http):
    """The exposition parses, and the request counters count this test's own requests (before
    vs after: other tests share the server)."""

    def scrape():
        answer = httpx.get(server.url + "/metrics")
        assert answer.headers["Content-Type"] == CONTENT_TYPE_LATEST  # the version it renders
        families = {f.name: f for f in text_string_to_metric_families(answer.text)}
        requests = {
            (s.labels["endpoint"], s.labels["status"]): s.value
            for s in families["jetspec_requests"].samples
            if s.name == "jetspec_requests_total"
        }
        return families, requests

    before, before_requests = scrape()
    answer = _complete(http)
    assert answer.status_code == 200
    assert http.post("/v1/completions", json=dict(model="nope", prompt="x")).status_code == 404
    assert httpx.get(server.url + "/v1/models").status_code == 401  # no key
    families, requests = scrape()
    for key in (("/v1/completions", "200"), ("/v1/completions", "404"), ("/v1/models", "401")):
        assert requests.get(key, 0) - before_requests.get(key, 0) == 1, key
    generated = (
        families["jetspec_generated_tokens"].samples[0].value
        - before["jetspec_generated_tokens"].samples[0].value
    )
    assert generated == answer.json()["usage"]["completion_tokens"] > 0
    prompted = (
        families["jetspec_prompt_tokens"].samples[0].value
        - before["jetspec_prompt_tokens"].samples[0].value
    )
    assert prompted == answer.json()["usage"]["prompt_tokens"] > 0

    def observations(families, name):
        return next(s.value for s in families[name].samples if s.name == name + "_count")

    first_token = "jetspec_time_to_first_token_seconds"  # once per request, not per chunk
    assert observations(families, first_token) - observations(before, first_token) == 1
    assert families["jetspec_tau"].type == "histogram"
    phases = {s.labels["phase"] for s in families["jetspec_phase_seconds"].samples}
    assert phases == {"queue", "compile", "prefill", "decode", "request"}
    assert families["jetspec_queue_depth"].samples[0].value == 0

    # A stream whose batch fails after its first tokens went out (200 headers, then an error
    # event) is counted with the error's status.
    class Broken:
        def inc(self, amount=1):
            raise RuntimeError("metrics broke")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server.app[SCHEDULER].metrics, "generated_tokens", Broken())
        body = dict(model=MODEL, prompt="Hi", max_tokens=8, temperature=0, stream=True)
        streamed = http.post("/v1/completions", json=body)
    assert streamed.status_code == 200 and "see the server log" in streamed.text
    _, after = scrape()
    failed = ("/v1/completions", "500")
    assert after.get(failed, 0) - requests.get(failed, 0) == 1  # that one stream, once
    assert after[("/v1/completions", "200")] == requests[("/v1/completions", "200")]


def test_a_server_that_cannot_bind_its_port_leaves_no_thread_behind(target, server):
    """The scheduler starts before the listener: a taken port must shut it down again."""
    before = set(threading.enumerate())
    taken = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(OSError) as refused:
        BackgroundServer(target, None, CONFIG, port=taken).start()
    assert refused.value.errno == errno.EADDRINUSE  # the bind's own failure, not another OSError
    assert _wait_for(lambda: set(threading.enumerate()) <= before) is None
    BackgroundServer(target, None, CONFIG).stop()  # never started: nothing to stop, no error


def test_a_server_on_an_ipv6_address_gives_a_url_that_reaches_it(target):
    with BackgroundServer(target, None, CONFIG, host="::1") as running:
        assert running.url.startswith("http://[::1]:")
        assert httpx.get(running.url + "/health", timeout=60).status_code == 200


def test_health_is_503_while_warming_up_and_once_shutting_down(target, monkeypatch):
    """Load balancers route to a server only while /health answers 200: not before the warm-up's
    programs are compiled, and not once shutdown has begun."""
    compiled = threading.Event()

    def warm_up(*args, **kwargs):
        compiled.wait(60)
        return 0.0

    monkeypatch.setattr(warmup, "warm_up", warm_up)
    reserve = dict(reserve_prompt_tokens=8, reserve_new_tokens=8)
    with BackgroundServer(
        target, None, dataclasses.replace(CONFIG, warmup=True, **reserve)
    ) as running:

        def health():
            answer = httpx.get(running.url + "/health", timeout=30)
            return answer.status_code, answer.json()["status"]

        assert health() == (503, "warming_up")
        compiled.set()
        _wait_for(lambda: health() == (200, "ok"))
        running.app[SCHEDULER].begin_shutdown()
        assert health() == (503, "shutting_down")


def test_shutdown_fails_waiting_requests_with_503_and_stops_listening(target):
    running = BackgroundServer(target, None, CONFIG).start()
    scheduler = running.app[SCHEDULER]
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=running.url, headers=headers, timeout=60) as http:
        with concurrent.futures.ThreadPoolExecutor(2) as pool, scheduler.hold():
            waiting = [pool.submit(_complete, http) for _ in range(2)]
            _wait_for(lambda: scheduler.queue_depth == 2)
            running.stop()  # as on SIGTERM
            answers = [w.result() for w in waiting]
    for answer in answers:
        assert answer.status_code == 503
        assert "shutting down" in answer.json()["error"]["message"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(running.url + "/health")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_serve_py(target_dir, attempts: int = 2):
    """`serve.py` on a free port, answering /health: `(process, url)`. The port is only found
    free, then released for serve.py, so another process may take it meanwhile: a start that
    fails to bind is retried on a new port."""
    for attempt in range(1, attempts + 1):
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "serve.py", "--port", str(port), "--target", str(target_dir)],
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        try:
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the server did not come up"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        return proc, url
                except httpx.TransportError:
                    time.sleep(0.2)
            output = proc.stdout.read()
            assert "address already in use" in output.lower() and attempt < attempts, output
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
    raise AssertionError("unreachable")


def test_serve_py_server_answers_and_stops_on_sigterm(target_dir):
    proc, url = _start_serve_py(target_dir)
    try:
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == target_dir.name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flag", ["--target", "--draft", "--host"])
def test_serve_py_refuses_an_empty_path_or_host(flag, capsys):
    """An unset shell variable (`--draft "$DRAFT"`) would otherwise decode without the draft,
    and an empty host bind every interface."""
    argv = [flag, " "] if flag == "--host" else ["generate", "P", flag, ""]
    with pytest.raises(SystemExit) as exited:
        serve_py._parser().parse_args(argv)
    assert exited.value.code == 2
    assert f"argument {flag}: must not be empty" in capsys.readouterr().err


def test_serve_py_generate_refuses_text_that_is_not_utf8_before_loading(monkeypatch, capsys):
    """Bytes that are not UTF-8 in the prompt (argument or stdin) or `--system` reach Python as
    surrogates, which the tokenizer refused with a bare TypeError, after the load."""
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    for argv, named in (
        (["generate", "Hi \udcff"], "the prompt"),
        (["generate", "-"], "the prompt read from stdin"),
        (["generate", "Hi", "--system", "\udcfe"], "--system"),
    ):
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hi \udcff"))
        assert serve_py.main(argv) == 2
        assert f"error: {named} holds an unpaired UTF-16 surrogate" in capsys.readouterr().err


def test_serve_py_generate_refuses_a_blank_prompt_before_loading(monkeypatch, capsys):
    """An empty or whitespace-only prompt (argument or stdin) is named, not decoded from
    nothing after the load."""
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    for argv, stdin in (
        (["generate", ""], ""),
        (["generate", " \n"], ""),
        (["generate", "-"], "\t\n"),
    ):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        assert serve_py.main(argv) == 2
        assert "error: the prompt is empty" in capsys.readouterr().err


def test_serve_py_generate_refuses_the_flags_of_the_server(capsys):
    """`serve.py --port 9000 generate P` would otherwise run, its --port ignored."""
    with pytest.raises(SystemExit) as exited:
        serve_py.main(["--port", "9000", "--pad-batch", "generate", "P"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--port, --pad-batch: flags of the server, which `generate` does not use" in err
    # After `generate`, where its parser does not know them, they are named alike.
    with pytest.raises(SystemExit):
        serve_py.main(["generate", "P", "--port", "9000", "--keepalive-seconds=5"])
    err = capsys.readouterr().err
    assert "--port, --keepalive-seconds: flags of the server, which `generate` does not" in err
    with pytest.raises(SystemExit):
        serve_py.main(["generate", "P", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    # SERVER_FLAGS are exactly the top-level flags that are not model or decoding flags.
    model_flags = argparse.ArgumentParser()
    serve_py._add_model_args(model_flags)
    top_level = set(vars(serve_py._parser().parse_args([]))) - {"command"}
    assert top_level - set(vars(model_flags.parse_args([]))) == set(serve_py.SERVER_FLAGS)


def test_serve_py_names_the_flags_of_generate_given_before_it(capsys):
    """argparse took the flag's value for the command: "invalid choice: '4'"."""
    for argv, named in (
        (["--max-new-tokens", "4", "generate", "P"], "--max-new-tokens: give it after"),
        (["--temperature=1", "--no-chat", "-v"], "--temperature, --no-chat: give them after"),
    ):
        with pytest.raises(SystemExit) as exited:
            serve_py.main(argv)
        assert exited.value.code == 2 and f"error: {named} `generate`" in capsys.readouterr().err
    # GENERATE_FLAGS are exactly the flags of `generate` that the top level does not have.
    top_level = set(vars(serve_py._parser().parse_args([])))
    generate = set(vars(serve_py._parser().parse_args(["generate"])))
    assert generate - top_level - {"prompt"} == set(serve_py.GENERATE_FLAGS)


def test_serve_py_defaults():
    import serve

    args = serve._parser().parse_args(["generate", "P"])
    assert (args.host, args.port, args.max_new_tokens) == ("127.0.0.1", 8000, 128)
    assert (args.refine_passes, args.foresight) == (0, 0)


@pytest.mark.parametrize("command", [[], ["generate", "P"]], ids=["server", "generate"])
def test_serve_py_checks_the_draft_path_before_loading(monkeypatch, tmp_path, capsys, command):
    import serve

    def no_load(args):
        raise AssertionError("the models were loaded before the paths were checked")

    monkeypatch.setattr(serve, "_load_models", no_load)
    missing = tmp_path / "nowhere"
    argv = [*command, "--target", str(tmp_path), "--draft", str(missing)]
    assert serve.main(argv + ([] if command else ["--port", "0"])) == 2
    assert f"--draft {missing}: no such directory" in capsys.readouterr().err


def test_serve_py_checks_the_address_before_loading(monkeypatch, capsys):
    """A port in use or a host that does not resolve fails at once, not after the model load."""

    def no_load(args):
        raise AssertionError("the models were loaded")

    monkeypatch.setattr(serve_py, "_load_models", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_py.main(["--method", "ar", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: cannot bind 127.0.0.1: Address already in use" in err

    def unresolvable(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    assert serve_py.main(["--method", "ar", "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err
    assert "--host 'no-such-host.invalid' cannot be resolved: Name or service not known" in err


def test_serve_py_checks_what_the_target_config_decides_before_its_weights_load(
    checkpoints, monkeypatch, tmp_path, capsys
):
    """The draft's kind and fit, and the server's context settings, need only the target's
    config.json: a mistake there fails before the (minutes-long, for a large model) load."""
    target_dir = checkpoints.get("qwen3")[0]  # a context of 2048
    other_draft = jetspec_jax.init_draft(
        jetspec_jax.load_target(target_dir), variant="jetspec", block_size=4
    ).save(tmp_path / "other")
    config = json.loads((other_draft / "config.json").read_text())
    (other_draft / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))

    def no_load(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(jetspec_jax, "load_target", no_load)
    named = f"--draft {target_dir} is a target model checkpoint"
    cases = [
        (["generate", "P", "--draft", str(target_dir)], named),
        (
            ["generate", "P", "--draft", str(other_draft)],
            f"--draft {other_draft}: draft hidden_size 32",
        ),
        (["--draft", str(target_dir), "--port", "0"], named),
        (
            ["--method", "ar", "--port", "0", "--max-model-len", "4096"],
            "max_model_len=4096 exceeds",
        ),
        (["--method", "ar", "--port", "0", "--reserve-new-tokens", "4000"], "exceeds", "2048"),
    ]
    for argv, *messages in cases:
        assert serve_py.main([*argv, "--target", str(target_dir)]) == 2, argv
        err = capsys.readouterr().err
        assert all(m in err for m in messages), (argv, err)


def test_serve_py_refuses_a_target_without_a_tokenizer_before_its_weights_load(
    checkpoints, monkeypatch, capsys
):
    """Both commands read text; a checkpoint that ships no tokenizer says so from its files."""
    target_dir = checkpoints.get("qwen3")[0]  # no tokenizer
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    for argv in (["generate", "P"], ["--port", "0"]):
        assert serve_py.main([*argv, "--target", str(target_dir)]) == 2, argv
        message = f"error: --target {target_dir} has no tokenizer (none of tokenizer.json"
        assert message in capsys.readouterr().err


def test_serve_py_refuses_flags_without_a_use_before_loading(monkeypatch, tmp_path, capsys):
    """An empty --api-key (an unset `$KEY`) would serve without authentication; a pipeline
    without two devices, or a file as a checkpoint directory, would fail after the load."""
    from jetspec_jax.decoding import pipeline

    monkeypatch.setattr(serve_py, "_load_models", lambda *a, **k: pytest.fail("models loaded"))
    with pytest.raises(SystemExit):
        serve_py.main(["--api-key", "", "--port", "0"])
    assert "argument --api-key: must not be empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="api_key must be None or a non-empty string"):
        ServerConfig(api_key=" ")
    # An empty --model-name would serve the model as "" (clients would have to send that).
    with pytest.raises(SystemExit):
        serve_py.main(["--model-name", " ", "--port", "0"])
    assert "argument --model-name: must not be empty" in capsys.readouterr().err
    for name in ("", " ", 3):
        with pytest.raises(ValueError, match="model_name must be None .* or a non-empty string"):
            ServerConfig(model_name=name)

    def one_device():
        raise ValueError("a pipeline needs >= 2 devices")

    monkeypatch.setattr(pipeline, "pipeline_devices", one_device)
    argv = ["generate", "P", "--method", "jetspec++", "--foresight", "2", "--pipeline", "spmd"]
    assert serve_py.main(argv) == 2
    assert "a pipeline needs >= 2 devices" in capsys.readouterr().err
    afile = tmp_path / "weights.bin"
    afile.write_text("")
    assert serve_py.main(["generate", "P", "--target", str(afile)]) == 2
    assert f"--target {afile} is a file, not a directory" in capsys.readouterr().err
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_text("")
    assert serve_py.main(["generate", "P", "--target", str(gguf_file)]) == 2
    assert "is a file, not a directory (a GGUF file: convert it with convert_gguf_to_hf)" in (
        capsys.readouterr().err
    )
    # The flag's 0 (one forward each) is no keyword value: its own message says so.
    assert serve_py.main(["generate", "P", "--prefill-chunk", "-1"]) == 2
    assert "--prefill-chunk must be >= 0 (0: each prompt in one forward), got -1" in (
        capsys.readouterr().err
    )
    # Sampling values are named by their flags, not SamplingParams' fields.
    for flag, value in (("--top-p", "2"), ("--top-k", "-1"), ("--temperature", "-1")):
        assert serve_py.main(["generate", "P", flag, value]) == 2
        assert f"error: {flag} must be" in capsys.readouterr().err


def test_serve_py_reports_an_interrupt_in_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_py, "_generate", interrupted)
    assert serve_py.main(["generate", "P"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_serve_py_generate_into_a_closed_pipe_ends_quietly(target_dir, monkeypatch, capsys):
    """`serve.py generate ... | head -c 1`: the reader gone, it stops without a traceback, with
    a SIGPIPE death's status."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        argv = ["generate", "P", "--target", str(target_dir), "--max-new-tokens", "2"]
        assert serve_py.main(argv) == 141
        assert capsys.readouterr().err == ""


def test_serve_py_generate_into_an_ascii_stdout_escapes_what_it_cannot_encode(
    target_dir, monkeypatch, capsys
):
    """`PYTHONIOENCODING=ascii serve.py generate ...` (or a latin-1 locale): text the stream
    cannot encode comes out escaped, as on stderr, not as a UnicodeEncodeError mid-completion."""
    from jetspec_jax.serving.detokenize import IncrementalDetokenizer

    push = IncrementalDetokenizer.push
    monkeypatch.setattr(IncrementalDetokenizer, "push", lambda self, t: push(self, t) + "é—")
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stdout)
    argv = ["generate", "P", "--target", str(target_dir), "--max-new-tokens", "2"]
    assert serve_py.main(argv) == 0
    stdout.flush()
    assert b"\\xe9\\u2014" in stdout.buffer.getvalue()


def test_serve_py_generate_names_the_flag_of_a_budget_past_the_context(target, target_dir, capsys):
    """A prompt plus `--max-new-tokens` (given, or its default 128) past the context is refused
    by the flag, not by the library's keyword, with the prompt's true token count."""
    context = target.config.max_position_embeddings
    argv = ["generate", "P", "--target", str(target_dir), "--no-chat"]
    prompt = len(encode_prompt(target.tokenizer, "P", chat=False))
    assert serve_py.main([*argv, "--max-new-tokens", str(context)]) == 2
    message = f"the prompt of {prompt} tokens + --max-new-tokens {context} exceeds the model's "
    assert message + f"context of {context} tokens" in capsys.readouterr().err


def test_serve_py_generate_decodes_a_raw_prompts_completion_after_it(
    target, target_dir, monkeypatch, capsys
):
    """`--no-chat`: the completion continues the prompt's text, so the detokenizer gets the
    prompt as context (a SentencePiece word keeps its leading space); a chat answer gets none."""
    from jetspec_jax.serving.detokenize import IncrementalDetokenizer

    contexts = []
    init = IncrementalDetokenizer.__init__

    def recording(self, tokenizer, *, context=(), **kwargs):
        contexts.append(list(context))
        init(self, tokenizer, context=context, **kwargs)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", recording)
    argv = ["generate", "P", "--target", str(target_dir), "--max-new-tokens", "2"]
    assert serve_py.main([*argv, "--no-chat"]) == 0
    assert serve_py.main([*argv, "--chat"]) == 0
    capsys.readouterr()
    assert contexts == [encode_prompt(target.tokenizer, "P", chat=False), []]


def test_serve_py_generate_names_a_closed_or_undecodable_stdin(monkeypatch, capsys):
    """`serve.py generate - <&-`: Python has no stdin at all; an error naming it, no traceback,
    before the model loads. The same for `>&-`, which leaves nowhere to write the completion."""
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    with monkeypatch.context() as closed:
        closed.setattr(sys, "stdout", None)
        assert serve_py.main(["generate", "hi"]) == 2
    assert "error: stdout is closed: generate writes the completion there" in (
        capsys.readouterr().err
    )
    monkeypatch.setattr(sys, "stdin", None)
    assert serve_py.main(["generate", "-"]) == 2
    assert "error: '-' reads the prompt from stdin, which is closed" in capsys.readouterr().err
    # A UTF-8 locale's stdin decodes strictly: bytes that are not UTF-8 are named as stdin's.
    monkeypatch.setattr(
        sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait"), encoding="utf-8")
    )
    assert serve_py.main(["generate", "-"]) == 2
    message = "error: the prompt read from stdin is not UTF-8 text (invalid continuation byte at"
    assert message in capsys.readouterr().err


def test_serve_py_takes_the_model_flags_before_or_after_generate():
    def parse(*argv):
        return vars(serve_py._parser().parse_args(argv))

    before = parse("--method", "ar", "--chunk-steps", "3", "-v", "generate", "P")
    assert (before["method"], before["chunk_steps"], before["verbose"]) == ("ar", 3, True)
    assert parse("generate", "P", "--method", "ar", "--chunk-steps", "3", "-v") == before
    assert parse("--method", "jetspec", "generate", "--method", "ar")["method"] == "ar"
    defaults = parse() | {"command": "generate"}  # the server's defaults, without a subcommand
    generate = parse("generate")
    assert {name: generate[name] for name in defaults} == defaults


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    class Refusing:  # HF templates refuse e.g. non-alternating roles with raise_exception
        chat_template = "..."

        def apply_chat_template(self, *args, **kwargs):
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    body = dict(model=MODEL, messages=[{"role": "user", "content": "a"}] * 2)
    with pytest.raises(RequestError) as refused:
        parse_chat(body, ModelInfo(MODEL, Refusing(), context_length=64))
    assert (refused.value.status, refused.value.param) == (400, "messages")
    assert "roles must alternate" in refused.value.message


@pytest.mark.parametrize(
    "extra, param",
    [
        (dict(functions=[{"name": "f"}]), "functions"),  # was named "tools", not sent
        (dict(top_logprobs=2), "top_logprobs"),  # was named "logprobs", not sent
        (dict(messages=[{"role": "user"}]), "messages[0].content"),
        (dict(messages=[{"role": "user", "content": None}]), "messages[0].content"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content",
        ),
    ],
)
def test_a_refused_field_is_the_errors_param(extra, param):
    """The error's `param` is the field the request sent (OpenAI's clients show it)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], **extra}
    with pytest.raises(RequestError) as refused:
        parse_chat(body, ModelInfo(MODEL, None, context_length=64))
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message


def test_the_closed_ends_of_temperature_and_top_k_are_accepted():
    """The smallest non-zero temperature and the largest top_k are served, one past them not."""
    body = dict(model=MODEL, prompt=[1, 2], max_tokens=2, seed=0)
    model = ModelInfo(MODEL, None, 64)
    coldest = parse_completion({**body, "temperature": MIN_TEMPERATURE}, model)
    assert coldest.sampling.temperature == MIN_TEMPERATURE
    assert parse_completion({**body, "top_k": MAX_TOP_K}, model).sampling.top_k == MAX_TOP_K
    for name, value in [("temperature", MIN_TEMPERATURE / 2), ("top_k", MAX_TOP_K + 1)]:
        with pytest.raises(RequestError, match=name):
            parse_completion({**body, name: value}, model)


def test_an_unset_completion_budget_fits_the_context():
    class Tokenizer:
        def encode(self, text, add_special_tokens):
            return [1] * len(text)

    model = ModelInfo(MODEL, Tokenizer(), context_length=20)
    assert parse_completion(dict(model=MODEL, prompt="x" * 15), model).max_tokens == 5
    assert parse_completion(dict(model=MODEL, prompt="x" * 2), model).max_tokens == 16


@pytest.mark.parametrize(
    "prompt, names",
    [
        (["a", "b"], "one prompt per request"),
        ([[1], [2]], "one prompt per request"),
        # One prompt nested a level too deep is malformed, not a batch to split.
        ([["a"]], "invalid token id 'a'"),
        ([[[1, 2]]], "invalid token id [1, 2]"),
    ],
)
def test_a_batch_of_prompts_is_refused_as_such_and_a_nested_prompt_as_malformed(prompt, names):
    with pytest.raises(RequestError) as refused:
        parse_completion(dict(model=MODEL, prompt=prompt), ModelInfo(MODEL, None, 64))
    assert refused.value.param == "prompt" and names in refused.value.message


def test_server_config_refuses_bad_values():
    with pytest.raises(ValueError, match="default_max_tokens"):
        ServerConfig(default_max_tokens=0)
    with pytest.raises(ValueError, match="shutdown_timeout"):
        ServerConfig(shutdown_timeout=-1.0)
    with pytest.raises(ValueError, match="max_model_len"):
        ServerConfig(max_model_len=1)
    with pytest.raises(ValueError, match="reserve_prompt_tokens must be an integer >= 0"):
        ServerConfig(reserve_prompt_tokens=-1)
    with pytest.raises(ValueError, match="reserve_new_tokens must be an integer >= 0"):
        ServerConfig(reserve_new_tokens=True)
    with pytest.raises(ValueError, match="shutdown_timeout must be a finite number >= 0"):
        ServerConfig(shutdown_timeout=math.inf)
    with pytest.raises(ValueError, match="keepalive_seconds must be a finite number > 0"):
        ServerConfig(keepalive_seconds=0)
    with pytest.raises(ValueError, match="keepalive_seconds must be a finite number > 0"):
        ServerConfig(keepalive_seconds=True)
    with pytest.raises(ValueError, match="api_key must be None or a non-empty string"):
        ServerConfig(api_key="")  # would serve without authentication
    with pytest.raises(ValueError, match="model_name must be None"):
        ServerConfig(model_name=" ")
    # The bounds themselves are accepted: 0 s (cancel at once), a 2-token context.
    assert ServerConfig(shutdown_timeout=0, max_model_len=2).shutdown_timeout == 0
    for key in ("secret\n", " secret"):  # no header carries it: every request got 401
        with pytest.raises(ValueError, match="api_key begins or ends with whitespace"):
            ServerConfig(api_key=key)


def test_server_config_fits_a_context_to_the_token():
    """`max_model_len` and the reserve may take the whole context, and no token more."""
    model = types.SimpleNamespace(max_position_embeddings=64)
    ServerConfig(max_model_len=64, reserve_prompt_tokens=60, reserve_new_tokens=4).check_fits(model)
    with pytest.raises(ValueError, match="max_model_len=65 exceeds the model's context of 64"):
        ServerConfig(max_model_len=65).check_fits(model)


def test_build_app_refuses_a_target_without_a_tokenizer_or_room():
    from jetspec_jax.serving.server import build_app

    target = types.SimpleNamespace(tokenizer=None, path="/ckpt")
    with pytest.raises(ValueError, match="/ckpt has no tokenizer; the server needs one"):
        build_app(target, None, ServerConfig())
    model = types.SimpleNamespace(max_position_embeddings=64)
    target = types.SimpleNamespace(tokenizer=object(), path="/ckpt", config=model)
    with pytest.raises(ValueError, match="max_model_len=65 exceeds"):  # before any scheduler
        build_app(target, None, ServerConfig(max_model_len=65))


def test_every_server_setting_has_a_flag_that_reaches_it(monkeypatch):
    """A `ServerConfig` field without a `serve.py` flag, or a flag `_server_config` does not pass
    on, would leave the setting at its default whatever the command line says."""
    monkeypatch.delenv("JETSPEC_API_KEY", raising=False)
    given = dict(
        model_name="m",
        api_key="k",
        max_batch_size=3,
        queue_size=5,
        chunk_steps=2,
        default_max_tokens=9,
        max_model_len=64,
        pad_batch=True,
        continuous_batching=False,
        reserve_prompt_tokens=128,
        reserve_new_tokens=96,
        warmup=True,
        shutdown_timeout=7.0,
        keepalive_seconds=2.5,
    )
    fields = {f.name for f in dataclasses.fields(ServerConfig)} - {"decoding"}
    assert fields == set(given)  # a new setting: add it here, with its flag
    argv = ["--method", "ar", "--pad-batch", "--static-batching", "--warmup"]
    for name, value in given.items():
        if not isinstance(value, bool):
            argv += ["--" + name.replace("_", "-"), str(value)]
    config = serve_py._server_config(serve_py._parser().parse_args(argv), None)
    assert {name: getattr(config, name) for name in given} == given


@pytest.mark.parametrize("reserve", [[], ["--reserve-prompt-tokens", "64"]])
def test_serve_py_warmup_without_a_reserve_names_the_flags(reserve, monkeypatch, capsys):
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    assert serve_py.main(["--method", "ar", "--warmup", *reserve]) == 2
    message = "give --reserve-prompt-tokens and --reserve-new-tokens"
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_serve_py_refuses_a_port_out_of_range(port, capsys):
    with pytest.raises(SystemExit) as exited:
        serve_py._parser().parse_args(["--port", port])
    assert exited.value.code == 2
    assert "is not a TCP port" in capsys.readouterr().err


def test_serve_py_generate_streams_the_autoregressive_completion_with_a_draft(
    target, target_dir, tmp_path, capsys, monkeypatch
):
    """`serve.py generate --draft D --method jetspec`: AR's greedy text on stdout, the
    statistics on stderr. (The default model and draft: test_default_draft.py.)"""
    draft_dir = jetspec_jax.init_draft(target, variant="jetspec", block_size=4).save(tmp_path / "d")
    prompt = "What is 2 + 2?"
    ids = encode_prompt(target.tokenizer, prompt, chat=True)
    expected = target.tokenizer.decode(
        jetspec_jax.generate(target, ids, max_new_tokens=12).tokens, skip_special_tokens=True
    )
    argv = ["generate", prompt, "--target", str(target_dir), "--draft", str(draft_dir)]
    assert serve_py.main([*argv, "--method", "jetspec", "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert expected.strip() and out.strip() == expected.strip()
    assert "[jetspec]" in err and "tokens/s decode" in err
    # '-' reads the prompt from stdin.
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    argv[1] = "-"
    assert serve_py.main([*argv, "--method", "jetspec", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()
    # A system message without the chat template is refused in the CLI's words, before loading.
    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    assert serve_py.main(["generate", "P", "--no-chat", "--system", "Be brief."]) == 2
    assert "--system is a chat message" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, refused",
    [(["--system", "Be brief."], "--system"), (["--chat"], "--chat")],
)
def test_chat_flags_for_a_tokenizer_without_a_template_are_refused_by_name(
    checkpoints, tmp_path, capsys, flags, refused
):
    plain = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "plain", chat=False)
    argv = ["generate", "P", "--target", str(plain), "--max-new-tokens", "2"]
    assert serve_py.main([*argv, *flags]) == 2
    assert f"the tokenizer of {plain} has no chat template: drop {refused}" in (
        capsys.readouterr().err
    )
    assert serve_py.main(argv) == 0  # a raw prompt


def test_compare_ar_measures_the_speedup_and_checks_the_tokens(
    target, target_dir, tmp_path, capsys, monkeypatch
):
    """`serve.py generate --compare-ar` runs AR on the same prompt and says whether the tokens
    agree; a result that differs from AR's is called out."""
    draft = jetspec_jax.init_draft(target, variant="jetspec", block_size=4)
    prompt = "What is 2 + 2?"
    argv = ["generate", prompt, "--target", str(target_dir), "--max-new-tokens", "8"]
    argv += ["--draft", str(draft.save(tmp_path / "d")), "--compare-ar"]
    assert serve_py.main(argv) == 0
    err = capsys.readouterr().err
    assert "speedup " in err and "x measured:" in err and "AR output identical" in err
    # The AR run prefills as the speculative one did.
    calls = []
    stream = jetspec_jax.stream
    monkeypatch.setattr(
        jetspec_jax,
        "stream",
        lambda *a, **k: calls.append(k.get("prefill_chunk")) or stream(*a, **k),
    )
    assert serve_py.main([*argv, "--prefill-chunk", "3"]) == 0
    assert calls == [3, 3]

    args = serve_py._parser().parse_args(argv)
    options = serve_py._decoding_options(args, draft)
    ids = encode_prompt(target.tokenizer, prompt, chat=True)
    request = dict(max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    decoding = dataclasses.asdict(options)
    result = jetspec_jax.generate(target, ids, draft=draft, **decoding, **request)
    vocab = target.config.vocab_size
    wrong = dataclasses.replace(result, tokens=[(result.tokens[0] + 1) % vocab, *result.tokens[1:]])
    line = serve_py._speedup_line(args, options, target, ids, request, wrong)
    assert line.endswith("AR output DIFFERENT)")


@pytest.mark.parametrize(
    "variant, parts, flags, message",
    [
        ("jetspec", "plain", ["--method", "jetspec++"], "is a 'jetspec' draft; pass --method"),
        ("jetspec++", "plain", ["--refine-passes", "1", "--refreshes", "1"], "--refreshes needs a"),
        ("jetspec++", "plain", ["--foresight", "4"], "--foresight needs a draft with an adapter"),
        ("jetspec++", "adapter", ["--foresight", "4"], "pass --foresight-rule uncalibrated"),
        (None, None, ["--method", "jetspec"], "--method jetspec needs a draft of that variant"),
        ("jetspec", "plain", ["--block-size", "8"], "--block-size must be at most 4"),
        ("jetspec++", "plain", ["--refine-passes", "4"], "--refine-passes must be at most 3"),
        (
            "jetspec++",
            "plain",
            ["--block-size", "3", "--refine-passes", "3"],
            "--refine-passes must be at most 2",
        ),
        ("dflash", "plain", ["--block-size", "2"], "drafts only the 4 positions it was trained"),
        ("jetspec", "plain", ["--method", "ar"], "--method ar decodes without a draft: drop"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "server"])
def test_serve_py_names_its_flags_when_the_draft_cannot_serve_them(
    target, target_dir, tmp_path, capsys, monkeypatch, command, variant, parts, flags, message
):
    """A flag the loaded draft cannot serve is refused in the command line's terms, not the
    Python API's (`Draft.with_adapter`, `load_draft`), for `generate` and the server alike."""
    argv = ["--target", str(target_dir), *flags]
    if variant is not None:
        draft = jetspec_jax.init_draft(target, variant=variant, block_size=4)
        if parts == "adapter":  # a JetSpec++ checkpoint before `train.py calibrate`
            draft = draft.with_adapter(init_adapter(draft))
        argv += ["--draft", str(draft.save(tmp_path / "draft"))]
    argv = ["generate", "P", *argv] if command == "generate" else ["--port", "0", *argv]
    # Everything here is known from the draft and the target's config.json: no weights load.
    monkeypatch.setattr(jetspec_jax, "load_target", _no_weight_load)
    assert serve_py.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Draft." not in err and "load_draft" not in err and "=" not in err


def _no_weight_load(*args, **kwargs):
    raise AssertionError("the target's weights were loaded before the flags were checked")


@pytest.mark.parametrize("command", ["generate", "server"])
def test_serve_py_refuses_refinement_for_a_drafts_own_method_before_the_load(
    target, target_dir, tmp_path, capsys, monkeypatch, command
):
    """With no --method, a dflash draft decodes as dflash: a refinement pass, which only
    jetspec++ takes, is refused from the draft's config, before the target's weights load."""
    draft = jetspec_jax.init_draft(target, variant="dflash", block_size=4)
    argv = ["--target", str(target_dir), "--draft", str(draft.save(tmp_path / "d"))]
    argv += ["--refine-passes", "20"]
    argv = ["generate", "P", *argv] if command == "generate" else ["--port", "0", *argv]
    monkeypatch.setattr(jetspec_jax, "load_target", _no_weight_load)
    assert serve_py.main(argv) == 2
    assert "refine_passes apply to method 'jetspec++' only" in capsys.readouterr().err


@pytest.mark.parametrize("parts", ["plain", "adapter"])
@pytest.mark.parametrize("command", ["generate", "server"])
def test_serve_py_says_to_pass_a_draft_as_draft(target, tmp_path, capsys, command, parts):
    """A draft given as --target (a plain draft or a JetSpec++ checkpoint) is refused in the
    command line's terms, before any load."""
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4)
    if parts == "adapter":
        draft = draft.with_adapter(init_adapter(draft))
    path = draft.save(tmp_path / "draft")
    argv = ["--target", str(path)]
    argv = ["generate", "P", *argv] if command == "generate" else ["--port", "0", *argv]
    assert serve_py.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--target {path} is a draft checkpoint: pass it as --draft" in err
    assert "load_draft" not in err


def test_serve_py_generate_reports_an_unreadable_checkpoint(monkeypatch, tmp_path, capsys):
    def unreadable(path, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(jetspec_jax.target, "load_target_config", unreadable)  # read first
    locked = tmp_path / "locked"
    locked.mkdir()
    assert serve_py.main(["generate", "--target", str(locked)]) == 2
    err = capsys.readouterr().err
    assert f"error: [Errno 13] Permission denied: '{locked}'" in err
    assert "Traceback" not in err


def _sample(http, name: str) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


def _labelled(http, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def _sse_text(body: str) -> str:
    """The text of a streamed completion: its `data:` events up to `[DONE]`."""
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(
        json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]
    )
