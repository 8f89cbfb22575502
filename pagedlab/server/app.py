"""The HTTP server: OpenAI's API in front of an AsyncLLM.

    app = build_app(AsyncLLM(LLM("smollm2")), model_name="smollm2")
    uvicorn.run(app, port=8000)               # or pagedlab.server.serve(...)

One request's path through it:

    POST /v1/chat/completions
      -> protocol.parse_chat: the JSON body -> token ids (chat template) + SamplingParams   (else 400)
      -> async_llm.check_request: fits the engine? (prompt length, vocabulary)              (else 400)
      -> admission.admit: room in the queue?                                    (else 503 + Retry-After)
      -> AsyncLLM.generate, one stream per sample (n), merged into one sequence of (choice, delta)
      -> stream: server-sent events, chunk by chunk, as tokens arrive  /  or: one JSON at the end

The engine core runs in a process of its own (AsyncLLM.from_model; or, for an LLM built in this
process, on a thread); here everything runs on the asyncio event loop -- HTTP, JSON, detokenizing,
server-sent events -- so thousands of open connections cost no threads and never hold up a step. A client that goes away is noticed (its connection's disconnect
message) and its streams are cancelled, which aborts their requests and frees their KV blocks at the
next engine step -- a server must not keep generating for nobody. Nothing a client sends reaches the
engine unchecked, and an error in one request (finish_reason "error") is that request's 500 alone.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..async_llm import CoreNotAnswering, CoreStopped
from ..config import DEFAULT_MAX_WAITING
from .admission import AdmissionGate
from .metrics import ServerMetrics
from .protocol import (OpenAIError, ParsedRequest, parse_chat, parse_completion, parse_detokenize, parse_tokenize,
                       read_body, receive_body)
from .responses import (SSE_DONE, SSE_KEEPALIVE, Envelope, chat_logprobs, chat_response, chunk, completion_logprobs,
                        completion_response, sse, usage_chunk)

NOT_ANSWERING_RETRY_S = 30            # Retry-After of a 503 while every engine core is taken for hung


# -- many streams as one ---------------------------------------------------------------------------

async def merged_streams(requests, metrics: ServerMetrics, arrival: float, stream: bool = True):
    """Follow every submitted request (AsyncLLM.Submitted, in choice order) and yield
    (index, delta) as deltas arrive from any of them. Closing this generator (the client went away)
    aborts every request not finished, whether or not its deltas were ever read."""
    if len(requests) == 1:             # (n=1, nearly every request: no pump task, no queue between)
        async for item in one_stream(requests[0], metrics, arrival, stream):
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done: set[int] = set()

    async def pump(index, request):
        try:
            first = True
            async for delta in request.deltas(keepalive=stream):
                if delta is None:                 # a keep-alive (AsyncLLM.keepalive_s)
                    queue.put_nowait((index, None, None))
                    continue
                if first and delta.token_ids:
                    metrics.on_first_token(time.perf_counter() - arrival if stream else delta.output.ttft_s)
                    first = False
                metrics.on_tokens(len(delta.token_ids))
                queue.put_nowait((index, delta, None))
        except Exception as e:        # noqa: BLE001 -- handed to the consumer
            queue.put_nowait((index, None, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        while len(done) < len(tasks):
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is not None and delta.finished:
                done.add(index)
                metrics.on_finish(delta.output)
            yield index, delta
    finally:
        for t in tasks:
            t.cancel()
        for index, request in enumerate(requests):
            if index not in done:
                request.abort()
                metrics.finished.labels("abort").inc()


async def one_stream(request, metrics: ServerMetrics, arrival: float, stream: bool):
    """merged_streams for one request: its deltas as (0, delta), read in place -- no pump task and
    queue between (the pump is there to interleave several choices; one choice needs none)."""
    first, finished = True, False
    try:
        async for delta in request.deltas(keepalive=stream):
            if delta is None:                     # a keep-alive: (0, None)
                yield 0, None
                continue
            if first and delta.token_ids:
                metrics.on_first_token(time.perf_counter() - arrival if stream else delta.output.ttft_s)
                first = False
            metrics.on_tokens(len(delta.token_ids))
            if delta.finished:
                finished = True
                metrics.on_finish(delta.output)
            yield 0, delta
    finally:
        if not finished:
            request.abort()
            metrics.finished.labels("abort").inc()


def engine_error(output) -> OpenAIError:
    if output.finish_reason == "abort":
        return OpenAIError("the request was aborted (the server is shutting down)", status=503,
                           type="server_error")
    return OpenAIError(f"the engine failed on this request: {output.error}", status=500, type="server_error")


# -- responses that stop their streams when the client goes ------------------------------------------

class EventStream(Response):
    """Server-sent events that end cleanly whatever happens: the client reading to the end, the
    client disconnecting (noticed at once, even while the request waits in the queue and nothing is
    being sent), or the server shutting down. In every case the event generator is closed (its
    engine streams are cancelled) and `on_close` runs (the admission ticket is given back).

    Plain ASGI on the request's own task, with ONE more task that waits for the disconnect and
    cancels the stream if it comes: per request, that is what a burst of hundreds pays. (Starlette's
    StreamingResponse in an anyio task group, with its cancel scopes, took ~16 % of the front end's
    CPU under a burst: py-spy, docs/serving.md session 17.)"""

    media_type = "text/event-stream"
    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, events, on_close):         # (no Response.__init__: no body, headers fixed)
        self.body_iterator, self.on_close = events, on_close
        self.status_code, self.background = 200, None
        self.raw_headers = list(self.HEADERS)

    async def __call__(self, scope, receive, send):
        me = asyncio.current_task()
        state = {"sending": True, "gone": False}

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            state["gone"] = True
            if state["sending"]:          # (not once the stream is closing: that must run to its end)
                me.cancel()
        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.body_iterator:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise                     # not the client: the server is stopping
            if hasattr(me, "uncancel"):   # (3.11+: this cancellation is handled here)
                me.uncancel()
        except OSError:                   # the client went away mid-send
            pass
        finally:
            state["sending"] = False
            watcher.cancel()
            self.on_close()
            await self.body_iterator.aclose()


async def until_disconnect(request: Request, work):
    """Await `work` (a coroutine) unless the client disconnects first: then cancel it, return None."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()                 # its streams are cancelled: their requests aborted
            await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()


# -- the app -------------------------------------------------------------------------------------

class ServingApp(FastAPI):
    """The FastAPI app, with its two generation routes (POST /v1/completions, /v1/chat/completions)
    taken straight to their handlers: a burst's hundreds of requests, and each streamed chunk's
    send, skip FastAPI's and Starlette's layers (error, exception, body-limit and exit-stack
    middleware, routing, dependency solving; ~18 % of the front end's CPU under a burst by py-spy,
    docs/serving.md session 17). Same handlers, same errors (hot_errors: the app's own handlers);
    every other path, method and scope (lifespan) goes through FastAPI as before."""

    hot_routes: dict = {}
    hot_errors: tuple = ()

    async def __call__(self, scope, receive, send):
        handler = self.hot_routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await super().__call__(scope, receive, send)
        request = Request(scope, receive)
        try:
            response = await handler(request)
            if not isinstance(response, Response):         # a whole answer: as FastAPI sends a dict
                response = JSONResponse(response)
        except ClientDisconnect:                            # gone while sending its body: nobody to answer
            return
        except Exception as e:                              # noqa: BLE001 -- the app's handler answers
            kind, on_error = next((k, h) for k, h in self.hot_errors if isinstance(e, k))
            if kind is Exception:                           # a bug: logged, as FastAPI's path logs it
                logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
            response = await on_error(request, e)
        await response(scope, receive, send)


def build_app(async_llm, model_name: str, max_waiting: int = DEFAULT_MAX_WAITING, admitted=None) -> FastAPI:
    """A FastAPI app serving `async_llm` as `model_name`. It does not own the AsyncLLM: whoever
    made it shuts it down (pagedlab.server.serve does). admitted: the front ends' shared admission
    counts (serve --api-servers N: AdmissionGate)."""
    tokenizer, max_model_len = async_llm.tokenizer, async_llm.max_model_len
    @contextlib.asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.create_task(async_llm.watch())    # the cores' messages, and their health
        try:
            yield
        finally:
            watcher.cancel()

    app = ServingApp(title="pagedlab", description="OpenAI-compatible server on pagedlab's engine",
                     lifespan=lifespan)
    frontend = dict(index=getattr(async_llm, "frontend", 0), of=getattr(async_llm, "frontends", 1), pid=os.getpid())
    metrics = ServerMetrics(async_llm.stats, frontend, async_llm.core_silence)
    gate = AdmissionGate(async_llm.max_num_seqs, max_waiting, admitted, frontend["index"])
    app.state.async_llm, app.state.metrics, app.state.admission = async_llm, metrics, gate
    app.state.model_name = model_name

    @app.exception_handler(OpenAIError)
    async def openai_error(request, e: OpenAIError):
        if e.status == 503:
            metrics.rejected.inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):           # 404 / 405 in OpenAI's shape too
        return JSONResponse(OpenAIError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request, e):           # a bug: this request's 500, the server goes on
        return JSONResponse(OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500,
                                        type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        """200 while every engine core runs and answers; 503 once one died (status "engine stopped")
        or has been silent past its threshold (status "engine core not answering": stopped, or stuck
        in a step; 200 again by itself once it answers). reason: one line naming the core; each
        core's silent_s and answering are in engine_cores (AsyncLLM's liveness)."""
        healthy, reason = async_llm.health()
        status = ("ok" if healthy else "engine stopped" if not async_llm.is_alive()
                  else "engine core not answering")
        return JSONResponse({"status": status, **({} if healthy else {"reason": reason}),
                             "engine_cores": async_llm.core_status(), "frontend": frontend},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "pagedlab", "max_model_len": max_model_len}]}

    # -- vLLM's utility endpoints: the server's own tokenizer, and its version ----------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        ids = parse_tokenize(read_body(await receive_body(request)), model_name, tokenizer)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        ids = parse_detokenize(read_body(await receive_body(request)), model_name, getattr(tokenizer, "vocab_size", None))
        return {"prompt": tokenizer.decode(ids)}

    @app.get("/version")
    async def version():
        from ..version import __version__
        return {"version": __version__}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = read_body(await receive_body(request))
        return await answer(request, parse_completion(body, model_name, tokenizer, max_model_len))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = read_body(await receive_body(request))
        return await answer(request, parse_chat(body, model_name, tokenizer, max_model_len))

    async def answer(request: Request, req: ParsedRequest):
        arrival = time.perf_counter()
        checked = []
        samples = req.params.samples()            # n samples: n requests (seeds seed, seed + 1, ...)
        vocab = getattr(async_llm, "vocab_size", None)
        outside = [t for t in req.params.stop_token_ids if vocab is not None and not 0 <= t < vocab]
        if outside:                               # (the engine's check would blame the prompt)
            raise OpenAIError(f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab}) of this "
                              "model", param="stop_token_ids")
        for p, ids in enumerate(req.prompts):
            try:                                  # read-only: fits this engine? (length, vocabulary)
                checked.append(async_llm.check_request(ids, samples[0]))
            except (ValueError, TypeError) as e:
                param = "messages" if req.kind == "chat" else "prompt"
                where = f"{param}[{p}]" if len(req.prompts) > 1 else param
                raise OpenAIError(f"{where}: {e}", param=param) from None
        ticket = gate.admit(len(checked) * req.n, prompts=len(checked))
        # sent to the engine now, in this handler's first turn (AsyncLLM.submit says why); the n
        # samples of a prompt differ only in their seeds (SamplingParams.samples), the prompt was
        # checked once
        requests = []
        try:
            for c in checked:
                for s in samples:
                    requests.append(async_llm.submit(c._replace(params=s), stream=req.stream))
        except BaseException as e:
            for r in requests:
                r.abort()
            ticket.release()
            if isinstance(e, CoreNotAnswering):   # every core taken for hung (AsyncLLM's give_up_s)
                raise OpenAIError(str(e), status=503, type="server_error",
                                  headers={"Retry-After": str(NOT_ANSWERING_RETRY_S)}) from None
            if isinstance(e, CoreStopped):        # the engine is gone (the CLI server exits for a restart)
                raise OpenAIError(str(e), status=503, type="server_error") from None
            raise

        def close():                  # whatever happened: the ticket back, nothing left running
            ticket.release()
            for r in requests:
                r.abort()             # a no-op on finished ones (also when a stream never began)
        env = Envelope(req.kind, model_name)
        if req.logprobs is None:
            def logprobs_of(o, offset=0):
                return None
        elif req.kind == "chat":
            def logprobs_of(o, offset=0):
                return chat_logprobs(getattr(o, "logprobs", None) or [], tokenizer)
        else:
            def logprobs_of(o, offset=0):
                return completion_logprobs(getattr(o, "logprobs", None) or [], tokenizer, offset)
        prompt_lengths = [len(ids) for ids in req.prompts]
        streams = merged_streams(requests, metrics, arrival, req.stream)
        if req.stream:
            return EventStream(events(req, env, streams, prompt_lengths, logprobs_of, len(requests)),
                               on_close=close)
        try:
            outputs = await until_disconnect(request, collect(streams, len(requests)))
        finally:
            await streams.aclose()
            close()
        if outputs is None:                       # the client is gone: nobody to answer
            return Response(status_code=499)
        for o in outputs:
            if o.finish_reason in ("error", "abort"):
                raise engine_error(o)
        make = chat_response if req.kind == "chat" else completion_response
        return make(env, outputs, prompt_lengths, logprobs_of)

    app.hot_routes = {"/v1/completions": completions, "/v1/chat/completions": chat_completions}
    app.hot_errors = ((OpenAIError, openai_error), (Exception, unexpected))
    return app


async def collect(streams, count: int) -> list:
    outputs = [None] * count
    async for index, delta in streams:
        if delta is not None and delta.finished:
            outputs[index] = delta.output
    return outputs


async def events(req: ParsedRequest, env: Envelope, streams, prompt_lengths, logprobs_of, count: int):
    """The server-sent events of one request: chunks as deltas arrive, then usage, then [DONE]."""
    usage = req.include_usage
    outputs = [None] * count
    offsets = [0] * count                     # text streamed so far per choice (completion logprobs)
    try:
        if req.kind == "chat":
            for i in range(count):
                yield sse(chunk(env, i, None, first=True, include_usage=usage))
        async for i, delta in streams:
            if delta is None:                 # nothing new for a while: a comment keeps the line open
                yield SSE_KEEPALIVE
                continue
            new_logprobs = getattr(delta, "logprobs", None) if req.logprobs is not None else None
            if new_logprobs:
                lp = logprobs_of(_Piece(new_logprobs), offsets[i])
                yield sse(chunk(env, i, delta.text, logprobs=lp, include_usage=usage))
                offsets[i] += len(delta.text)
            elif delta.text or (delta.token_ids and not delta.finished):
                # (the common event: a template, the text encoded alone.) New tokens whose text is
                # held back -- half a character, a possible stop string -- still make an event, with
                # text "" (as vLLM sends them): a client sees each step's tokens arrive, and the
                # first event is the first token, whatever its text.
                yield env.text_event(i, delta.text, usage)
                offsets[i] += len(delta.text)
            if delta.finished:
                outputs[i] = out = delta.output
                if out.finish_reason in ("error", "abort"):
                    yield sse(engine_error(out).body())
                    yield SSE_DONE
                    return
                yield sse(chunk(env, i, None, finish_reason=out.finish_reason, include_usage=usage))
        if usage:
            yield sse(usage_chunk(env, prompt_lengths, outputs, req.timing))
        yield SSE_DONE
    except RuntimeError as e:                 # the engine thread stopped under us
        yield sse(OpenAIError(str(e), status=500, type="server_error").body())
        yield SSE_DONE
    finally:
        await streams.aclose()


class _Piece:
    """A stream delta's logprobs, in the shape logprobs_of reads (an output with .logprobs)."""

    def __init__(self, logprobs):
        self.logprobs = logprobs


def uvicorn_config(app, log_level: str, **kw) -> "uvicorn.Config":
    """The HTTP server's settings, every front end's: uvicorn's per-request extras off where they
    buy nothing here -- X-Forwarded-* rewriting (proxy_headers: a middleware on every request; a
    server behind a proxy that needs the client's address turns it back on) and the access log's
    call per request above log level "info"."""
    import uvicorn
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, proxy_headers=False,
                          access_log=log_level in ("trace", "debug", "info"), **kw)
