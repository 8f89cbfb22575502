"""An OpenAI-compatible HTTP server on pagedlab's engine.

    python -m pagedlab serve --model smollm2 --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}]}'

One concept per file:

    protocol.py    OpenAI request bodies -> token ids + SamplingParams; errors as OpenAI's error JSON
    responses.py   OpenAI response bodies and streamed chunks (server-sent events)
    admission.py   the bounded queue: at most slots + max_waiting streams, then 503 + Retry-After
    metrics.py     Prometheus metrics at /metrics
    app.py         the FastAPI app: endpoints, streaming, a client that goes away aborts its request
    run.py         serve(): uvicorn in the foreground or on a background thread
    frontends.py   serve(..., api_servers=N): N front-end processes on one port, in front of the same cores
"""
from .app import build_app
from .run import RunningServer, serve

__all__ = ["build_app", "serve", "RunningServer"]
