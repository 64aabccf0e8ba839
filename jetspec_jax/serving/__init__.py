"""The OpenAI-compatible HTTP server: request schemas, batching scheduler, metrics, app.

Modules:
    openai_requests   OpenAI bodies → validated requests; OpenAI error objects
    openai_responses  OpenAI answers and streamed chunks
    detokenize        streamed text across chunk boundaries; stop strings
    scheduler         bounded queue; batches decoded on a worker thread through `DecodeSession`
    metrics           Prometheus metrics
    app               aiohttp routes and middlewares
    server            running it: in the foreground (signals) or on a background thread
"""

from jetspec_jax.serving.server import BackgroundServer, ServerConfig, build_app, serve

__all__ = ["BackgroundServer", "ServerConfig", "build_app", "serve"]
