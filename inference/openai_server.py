"""An OpenAI-compatible HTTP front of a running `GenerationEngine` (a Starlette ASGI app; scripts/serve.py runs it
under uvicorn): handlers on the event loop, tokens handed back from the engine's thread onto a per-request asyncio
queue. Routes, fields, errors and cancellation: docs/serving.md, "The API"."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from medusa_jax.text import TokenizerError, chat_prompt_ids, encode_prompt
from medusa_jax.inference.generation_engine import GenerationEngine
from medusa_jax.inference.engine_requests import EngineClosed, QueueFull, TokenEvent
from medusa_jax.inference.engine_requests import Request as EngineRequest
from medusa_jax.inference.openai_protocol import (ApiError, ParsedRequest, answer_body, chunk_body, parse_request,
                                                  usage)
from medusa_jax.inference.text_stream import TextStream

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413)
DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting handler checks that its client is still there
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}  # engine -> OpenAI
ENGINE_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k",
                 "stop token ids": "stop_token_ids"}  # words of `GenerationEngine.check`'s refusals -> the field


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_json(request: Request):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body has {declared} bytes; at most {MAX_BODY_BYTES} are accepted")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an integer too long to read, nesting too deep
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


class OpenAIServer:
    def __init__(self, engine: GenerationEngine, tokenizer, model_id: str):
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]

        async def http_error(request, exc: HTTPException):
            return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                           kind="not_found_error" if exc.status_code == 404 else
                                           "invalid_request_error"))

        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            await asyncio.to_thread(self.engine.close, True)  # uvicorn has finished every request: drain, stop
            print(f"medusa-serve: drained ({self.engine.metrics.generated_tokens} tokens generated), stopped",
                  file=sys.stderr, flush=True)

        return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model",
                                                         "created": self.created, "owned_by": "medusa-jax"}]})

    async def health(self, request: Request) -> Response:
        if self.engine.failure is not None:
            return JSONResponse({"status": "failed", "error": str(self.engine.failure)}, status_code=503)
        return JSONResponse({"status": "ok", "queue_depth": self.engine.queue_depth,
                             "rows_busy": self.engine.rows_busy})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.engine.prometheus_text(), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    def prompt_ids(self, parsed: ParsedRequest) -> list[int]:
        try:
            if parsed.chat:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions")
                return chat_prompt_ids(self.tokenizer, parsed.messages)
            if isinstance(parsed.prompt, list):
                return parsed.prompt
            return encode_prompt(self.tokenizer, parsed.prompt, chat=False)
        except ApiError:
            raise
        except TokenizerError as e:
            raise ApiError(400, str(e), "prompt") from None
        except Exception as e:  # a chat template that raises on these messages (jinja's TemplateError, ...)
            if parsed.chat:
                raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
            raise ApiError(400, f"the tokenizer refused the prompt: {e}", "prompt") from None

    async def generate(self, request: Request, chat: bool) -> Response:
        try:
            parsed = parse_request(await read_json(request), chat, self.model_id)
            prompt_ids = self.prompt_ids(parsed)
            params = parsed.params(len(prompt_ids), self.engine.config.context)
            loop, events = asyncio.get_running_loop(), asyncio.Queue()

            def on_event(event: TokenEvent) -> None:  # the engine's thread
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for it
                    loop.call_soon_threadsafe(events.put_nowait, event)

            try:
                job = self.engine.submit(prompt_ids, params, on_event)
            except ValueError as e:  # the engine's check names the field in its words
                param = next((field for words, field in ENGINE_FIELDS.items() if words in str(e)),
                             "messages" if chat else "prompt")
                raise ApiError(400, str(e), param) from None
            except QueueFull as e:
                raise ApiError(429, f"the server is busy: {e}", kind="rate_limit_error",
                               code="queue_full") from None
            except EngineClosed as e:
                raise ApiError(503, str(e), kind="server_error", code="unavailable") from None
        except ClientDisconnect:
            return Response(status_code=400)
        except ApiError as e:
            return error_response(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        text_stream = TextStream(self.tokenizer, parsed.stop)
        pieces = self.pieces(request, job, events, text_stream)
        if parsed.stream:
            return StreamingResponse(self.sse(chat, rid, job, parsed, pieces, text_stream),
                                     media_type="text/event-stream")
        text, reason = [], None
        async for piece, reason in pieces:
            text.append(piece)
        if reason is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if reason == "error":
            return error_response(ApiError(500, f"generation failed: {self.engine.failure}", kind="server_error"))
        return JSONResponse(answer_body(chat, rid, int(time.time()), self.model_id, "".join(text), reason,
                                        len(job.prompt_ids), text_stream.token_count))

    async def pieces(self, request: Request, job: EngineRequest, events: asyncio.Queue, stream: TextStream):
        """(text, None) per piece, then (text, finish reason) last; ends without a reason if the client left
        (the request is cancelled then, and whenever this generator is closed early)."""
        finished, checked = False, time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
                except TimeoutError:
                    event = None
                if time.monotonic() - checked >= DISCONNECT_POLL_SECONDS:  # also while tokens keep coming
                    if await request.is_disconnected():
                        return
                    checked = time.monotonic()
                if event is None:
                    continue
                text = stream.push(event.tokens)
                if stream.stopped:  # a stop string: the text ends before it
                    finished = event.finish_reason is not None
                    yield text, "stop"
                    return
                if event.finish_reason is not None:
                    finished = True
                    yield text + stream.finish(), FINISH_REASONS.get(event.finish_reason, event.finish_reason)
                    return
                if text:
                    yield text, None
        finally:
            if not finished:
                self.engine.cancel(job)

    async def sse(self, chat: bool, rid: str, job: EngineRequest, parsed: ParsedRequest, pieces,
                  text_stream: TextStream):
        created = int(time.time())

        def data(body) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        if chat:
            yield data(chunk_body(chat, rid, created, self.model_id, None, role=True))
        async for text, reason in pieces:
            if reason == "error":
                yield data(ApiError(500, f"generation failed: {self.engine.failure}", kind="server_error").body())
                break
            if text:
                yield data(chunk_body(chat, rid, created, self.model_id, text))
            if reason is not None:
                yield data(chunk_body(chat, rid, created, self.model_id, None, reason))
                if parsed.include_usage:
                    yield data(chunk_body(chat, rid, created, self.model_id, None,
                                          usage_counts=usage(len(job.prompt_ids), text_stream.token_count)))
        yield "data: [DONE]\n\n"
