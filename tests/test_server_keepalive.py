"""Streams that wait for their first text: headers and `: keep-alive` comments go out after
`keepalive_seconds`, so that proxies and clients with read timeouts keep the connection.

The servers decode a tiny random model with a character tokenizer, in padded batches of 4 rows
(one compiled bucket); `Scheduler.hold()` keeps a request waiting in the queue as long as needed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import socket
import time
import types

import httpx
import pytest

import jetspec_jax
from jetspec_jax.decoding.continuous import ContinuousBatch
from jetspec_jax.serving import BackgroundServer, ServerConfig
from jetspec_jax.serving.app import SCHEDULER, create_app
from tests.text_fixtures import with_tokenizer

MODEL = "tiny"
KEY = "test-key"
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
QUEUE_SIZE = 2
FAST, SLOW = 0.05, 60.0  # intervals: comments while a request waits; none within these tests
REQUESTS = {
    "/v1/completions": dict(model=MODEL, prompt="Hello", max_tokens=10, temperature=0),
    "/v1/chat/completions": dict(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0
    ),
}


def _config(keepalive_seconds: float) -> ServerConfig:
    return ServerConfig(
        model_name=MODEL,
        api_key=KEY,
        max_batch_size=4,
        queue_size=QUEUE_SIZE,
        chunk_steps=3,
        pad_batch=True,
        shutdown_timeout=10,
        max_model_len=512,
        keepalive_seconds=keepalive_seconds,
    )


@pytest.fixture(scope="module")
def target(checkpoints, tmp_path_factory):
    tiny = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path_factory.mktemp("text") / "tiny")
    return jetspec_jax.load_target(tiny)


@pytest.fixture(scope="module")
def fast(target):
    with BackgroundServer(target, None, _config(FAST)) as running:
        yield running


@pytest.fixture(scope="module")
def slow(target):
    with BackgroundServer(target, None, _config(SLOW)) as running:
        yield running


def _client(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def _frames(body: bytes) -> list[bytes]:
    """The SSE frames of `body`, which must be nothing else (each ends in a blank line)."""
    frames = body.split(b"\n\n")
    assert frames[-1] == b"", body[-200:]
    return frames[:-1]


def _events(body: bytes) -> list:
    """The `data:` events of a stream body, without the ids and times that differ per request,
    `[DONE]` last."""
    events = []
    for frame in _frames(body):
        if frame.startswith(b":"):
            continue
        assert frame.startswith(b"data: "), frame
        event = json.loads(frame[6:]) if frame != b"data: [DONE]" else "[DONE]"
        if isinstance(event, dict):
            event.pop("id", None), event.pop("created", None)
        events.append(event)
    return events


def _text(event) -> str:
    choice = event["choices"][0] if isinstance(event, dict) and event.get("choices") else {}
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _count(server, status: str) -> float:
    metrics = server.app[SCHEDULER].metrics
    labels = {"endpoint": "/v1/completions", "status": status}
    return metrics.registry.get_sample_value("jetspec_requests_total", labels) or 0.0


def _has_text(frame: bytes) -> bool:
    return frame.startswith(b"data: {") and bool(_text(json.loads(frame[6:])))


def _raw_request(url: httpx.URL, body: dict, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{extra}\r\n"
    )
    return head.encode() + data


@pytest.mark.parametrize("path", list(REQUESTS))
def test_a_waiting_stream_gets_headers_and_keepalives_then_the_same_events(fast, slow, path):
    body = dict(REQUESTS[path], stream=True)
    with _client(slow) as http:  # no comment within 60 s: the stream as it always was
        expected = http.post(path, json=body)
    assert expected.status_code == 200 and KEEPALIVE not in expected.content
    scheduler = fast.app[SCHEDULER]
    with _client(fast) as http, contextlib.ExitStack() as held:
        held.enter_context(scheduler.hold())
        with http.stream("POST", path, json=body) as answer:
            # The headers came while the request waits: no text can have been made.
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            assert answer.headers["cache-control"] == "no-cache"  # no cache replays a stream
            chunks = answer.iter_raw()
            head = b""
            while head.count(KEEPALIVE) < 2:
                head += next(chunks)
            assert scheduler.queue_depth == 1  # still waiting, comments flowing
            held.close()  # release: the batch runs
            streamed = head + b"".join(chunks)
    frames = _frames(streamed)
    texts = [i for i, f in enumerate(frames) if _has_text(f)]
    comments = [i for i, f in enumerate(frames) if f == KEEPALIVE[:-2]]
    assert len(comments) >= 2 and max(comments) < min(texts)  # comments only before the text
    if path == "/v1/completions":
        assert frames[0] == KEEPALIVE[:-2]  # nothing but comments before the first text
    else:  # chat: the role chunk goes out with the headers, as with the first text before
        assert json.loads(frames[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    assert streamed.endswith(DONE)
    assert _events(streamed) == _events(expected.content)  # same text, tokens and chunks
    assert "".join(map(_text, _events(streamed)))  # some text really came


def test_a_stream_whose_text_flows_sends_no_comment_between_chunks(fast, monkeypatch):
    """Pauses between chunks, each several intervals long, send no comment once the text has
    started: only a stream with no text yet needs keeping alive."""
    advance = ContinuousBatch.advance

    def slow_advance(self, max_steps):
        time.sleep(4 * FAST)
        advance(self, max_steps)

    monkeypatch.setattr(ContinuousBatch, "advance", slow_advance)
    body = dict(REQUESTS["/v1/completions"], stream=True)
    with _client(fast) as http:
        frames = _frames(http.post("/v1/completions", json=body).content)
    texts = [i for i, f in enumerate(frames) if _has_text(f)]
    assert len(texts) >= 3  # 10 tokens in chunks of 3 forwards
    assert KEEPALIVE[:-2] not in frames[texts[0] :]


def test_a_stream_answered_within_the_interval_sends_no_comment(slow):
    """With an interval longer than the wait, nothing is sent while the request waits, and the
    body is only the `data:` events, as before keep-alives."""
    scheduler = slow.app[SCHEDULER]
    url = httpx.URL(slow.url)
    request = _raw_request(
        url, dict(REQUESTS["/v1/completions"], stream=True), "Connection: close\r\n"
    )
    with socket.create_connection((url.host, url.port), timeout=30) as raw:
        with scheduler.hold():
            raw.sendall(request)
            _wait_for(lambda: scheduler.queue_depth == 1)
            raw.settimeout(0.3)
            with pytest.raises(TimeoutError):  # no headers, no comment
                raw.recv(1)
        raw.settimeout(30)
        answer = b"".join(iter(lambda: raw.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 200") and b": keep-alive" not in answer
    assert answer.rstrip().endswith(b"0")  # chunked, complete
    with _client(slow) as http:
        for path, request in REQUESTS.items():
            whole = http.post(path, json=request).json()["choices"][0]
            streamed = http.post(path, json=dict(request, stream=True)).content
            events = _events(streamed)
            # Nothing but `data: ...` frames: no comment, byte for byte the old format.
            assert all(f.startswith(b"data: ") for f in _frames(streamed))
            assert events[-1] == "[DONE]"
            text = whole.get("text") or whole["message"]["content"]
            assert "".join(map(_text, events)) == text


def test_a_stream_refused_when_the_queue_is_full_is_an_ordinary_503(fast):
    """Refused before anything was sent: an HTTP error response, even with a tiny interval."""
    scheduler = fast.app[SCHEDULER]
    request = dict(REQUESTS["/v1/completions"], max_tokens=2)
    with _client(fast) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        with scheduler.hold():
            waiting = [
                pool.submit(http.post, "/v1/completions", json=request) for _ in range(QUEUE_SIZE)
            ]
            _wait_for(lambda: scheduler.queue_depth == QUEUE_SIZE)
            refused = http.post("/v1/completions", json=dict(request, stream=True))
            time.sleep(0.2)  # several intervals: still no comment for the refused one
        assert refused.status_code == 503
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.json()["error"]["code"] == "overloaded"
        assert all(w.result().status_code == 200 for w in waiting)


def test_a_stream_refused_at_shutdown_before_the_interval_is_an_ordinary_503(target):
    running = BackgroundServer(target, None, _config(SLOW)).start()
    scheduler = running.app[SCHEDULER]
    body = dict(REQUESTS["/v1/completions"], stream=True)
    try:
        with _client(running) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
            with scheduler.hold():
                waiting = pool.submit(http.post, "/v1/completions", json=body)
                _wait_for(lambda: scheduler.queue_depth == 1)
                running.stop()  # as on SIGTERM
                answer = waiting.result()
    finally:
        running.stop()
    assert answer.status_code == 503
    assert answer.headers["content-type"].startswith("application/json")
    assert "shutting down" in answer.json()["error"]["message"]


def test_an_error_after_the_keepalive_headers_is_an_event_then_done(target):
    """Once a comment sent the headers, a failure (here: the shutdown refusing the waiting
    request) is an error event and `[DONE]`, counted with the error's status."""
    running = BackgroundServer(target, None, _config(FAST)).start()
    scheduler = running.app[SCHEDULER]
    path, body = "/v1/completions", dict(REQUESTS["/v1/completions"], stream=True)
    try:
        with _client(running) as http, scheduler.hold():
            with http.stream("POST", path, json=body) as answer:
                assert answer.status_code == 200
                chunks = answer.iter_raw()
                head = b""
                while KEEPALIVE not in head:
                    head += next(chunks)
                assert head.startswith(KEEPALIVE)
                running.stop()  # as on SIGTERM: the waiting request fails with 503
                streamed = head + b"".join(chunks)
    finally:
        running.stop()
    events = _events(streamed)
    assert events[-1] == "[DONE]" and len(events) == 2, streamed
    assert events[0]["error"]["type"] == "server_error"
    assert "shutting down" in events[0]["error"]["message"]
    assert _count(running, "503") == 1 and _count(running, "200") == 0


def test_a_client_that_hangs_up_during_keepalives_cancels_its_request(fast, caplog):
    """A client gone while its request waits (after headers and comments): the job leaves the
    queue, is never decoded, and the request counts as 499 without an error logged."""
    scheduler = fast.app[SCHEDULER]
    url = httpx.URL(fast.url)
    closed = _count(fast, "499")
    batches = scheduler.metrics.registry.get_sample_value("jetspec_batch_size_count") or 0.0
    with caplog.at_level(logging.ERROR), scheduler.hold():
        with socket.create_connection((url.host, url.port), timeout=30) as impatient:
            impatient.sendall(_raw_request(url, dict(REQUESTS["/v1/completions"], stream=True)))
            received = b""
            while received.count(b": keep-alive") < 2:
                received += impatient.recv(4096)
            assert received.startswith(b"HTTP/1.1 200")
        _wait_for(lambda: scheduler.queue_depth == 0)  # held: only its cancellation empties it
        _wait_for(lambda: _count(fast, "499") - closed == 1)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    time.sleep(0.2)  # released: nothing to decode
    after = scheduler.metrics.registry.get_sample_value("jetspec_batch_size_count") or 0.0
    assert after == batches


def test_a_client_that_hangs_up_during_the_shutdown_grace_is_counted_as_499(target, monkeypatch):
    """A running request whose client leaves while the shutdown waits for it is the client's
    doing (499), as before the shutdown began, not the server's (503: handlers it cancels past
    its timeout)."""
    advance = ContinuousBatch.advance
    monkeypatch.setattr(  # slow decoding: the request still runs when its client leaves
        ContinuousBatch, "advance", lambda rows, steps: (time.sleep(0.05), advance(rows, steps))[1]
    )
    running = BackgroundServer(target, None, _config(SLOW)).start()
    scheduler = running.app[SCHEDULER]
    url = httpx.URL(running.url)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            with socket.create_connection((url.host, url.port), timeout=30) as leaving:
                body = dict(REQUESTS["/v1/completions"], stream=True, max_tokens=400)
                leaving.sendall(_raw_request(url, body))
                received = b""
                while b"data: {" not in received:  # decoding
                    received += leaving.recv(4096)
                stopped = pool.submit(running.stop)  # as on SIGTERM: the grace begins
                _wait_for(lambda: not scheduler.accepting)
            stopped.result(timeout=30)
        finally:
            running.stop()
    assert (_count(running, "499"), _count(running, "503")) == (1, 0)


def _until_closed(connection: socket.socket) -> bytes:
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def test_past_the_shutdown_timeout_running_requests_are_cancelled_and_answered_503(
    target, monkeypatch
):
    """Past `shutdown_timeout` (0: at once) the running rows are cancelled, at their next chunk
    boundary: a stream ends in an error event and `[DONE]`, a plain request gets a 503. Left to
    aiohttp's timeout, they decoded on (twice the timeout, or, with 0, to their budgets) and
    their clients got a cut connection."""
    advance = ContinuousBatch.advance
    monkeypatch.setattr(  # slow decoding: 400 tokens would take seconds
        ContinuousBatch, "advance", lambda rows, steps: (time.sleep(0.05), advance(rows, steps))[1]
    )
    running = BackgroundServer(
        target, None, dataclasses.replace(_config(SLOW), shutdown_timeout=0)
    ).start()
    scheduler = running.app[SCHEDULER]
    url = httpx.URL(running.url)
    body = dict(REQUESTS["/v1/completions"], max_tokens=400)
    try:
        with (
            socket.create_connection((url.host, url.port), timeout=30) as streaming,
            socket.create_connection((url.host, url.port), timeout=30) as plain,
        ):
            streaming.sendall(_raw_request(url, dict(body, stream=True)))
            plain.sendall(_raw_request(url, body))
            streamed = b""
            while b"data: {" not in streamed:  # decoding
                streamed += streaming.recv(4096)
            _wait_for(lambda: scheduler.running == 2)
            running.stop()  # as on SIGTERM
            streamed += _until_closed(streaming)
            answered = _until_closed(plain)
    finally:
        running.stop()
    shut_down = b"the server shut down before the request finished"
    assert answered.startswith(b"HTTP/1.1 503") and shut_down in answered, answered[-300:]
    assert streamed.startswith(b"HTTP/1.1 200") and shut_down in streamed, streamed[-300:]
    # `[DONE]`, then the chunked body's last chunk: a whole answer, not a cut connection.
    assert streamed.endswith(DONE + b"\r\n0\r\n\r\n"), streamed[-300:]
    assert _count(running, "503") == 2 and _count(running, "200") == 0


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf"), True, "15"])
def test_keepalive_seconds_must_be_a_finite_positive_number(seconds):
    with pytest.raises(ValueError, match="keepalive_seconds"):
        ServerConfig(keepalive_seconds=seconds)
    if not isinstance(seconds, bool | str):
        with pytest.raises(ValueError, match="keepalive_seconds"):
            create_app(None, None, keepalive_seconds=seconds)


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_shutdown_timeout_must_be_a_finite_number_at_least_zero(seconds):
    with pytest.raises(ValueError, match="shutdown_timeout"):
        create_app(None, None, shutdown_timeout=seconds)
    # 0 is allowed: the running rows are cancelled as soon as the shutdown begins.
    model = types.SimpleNamespace(context_length=16)
    assert create_app(None, model, shutdown_timeout=0.0) is not None
