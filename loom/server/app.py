"""The OpenAI-compatible HTTP API over an AsyncLLMEngine (FastAPI).

The engine steps on a thread of its own; handlers only validate, queue and relay. A request
whose client goes away is aborted, streaming or not, so its blocks return to the pool. Errors
have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and name the field.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.engine.async_llm_engine import AsyncLLMEngine, RequestStream
from loom.outputs import CompletionOutput, Logprob, RequestOutput
from loom.server.metrics import Metrics
from loom.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingRequest,
                                  TokenizeRequest, conversation)

CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"  # streams from /v1/chat/completions
DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler checks that its client is still there


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queued_requests: int = 256      # beyond the engine's max_num_seqs running ones: then 429
    max_body_bytes: int = 8 << 20


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _param_of(loc: tuple) -> str | None:
    """A validation error's location as the request's field path ("messages.0.content"), without
    the body prefix and pydantic's names of the union member it tried ("str", "list[int]")."""
    parts = []
    for part in loc:
        if part == "body" and not parts:
            continue
        if isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def _field_of(error: ValueError) -> str | None:
    """Loom's errors start with the field they are about: "top_k: must be ..."."""
    head, sep, _ = str(error).partition(":")
    return head if sep and head.replace("_", "").isalnum() else None


class _BodyTooLarge(Exception):
    pass


class _LimitBody:
    """ASGI middleware: a body over the limit gets 413 before the app reads it all."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def counting_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        await error_response(413, f"request body: larger than {self.limit} bytes")(scope, receive, send)


class _Authorize:
    """ASGI middleware: /v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY`. (Pure
    ASGI: Starlette's BaseHTTPMiddleware would hide a client's disconnect from the handlers.)"""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")) \
                and dict(scope.get("headers", [])).get(b"authorization") != self.expected:
            response = error_response(401, "authorization: a valid API key is required (Authorization: Bearer KEY)")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(config: ServerConfig, engine: Callable[[], AsyncLLMEngine | None], metrics: Metrics) -> FastAPI:
    """The app; `engine()` is the engine once it can serve, None while it is starting;
    `metrics` is what the engine's step observer records into."""
    app = FastAPI(title="Loom", description="An OpenAI-compatible server for Loom's engine")
    app.add_middleware(_LimitBody, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(_Authorize, key=config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(_ClientGone)
    async def _gone(_: Request, e: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"body: not valid JSON ({first.get('ctx', {}).get('error', 'malformed')})")
        param = _param_of(first.get("loc", ()))
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    def ready() -> AsyncLLMEngine:
        e = engine()
        if e is None:
            raise APIError(503, "the model is still loading; /health says when it is ready",
                           headers={"Retry-After": "5"})
        return e

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(404, f"model: {name!r} is not served here (this server has {config.model_name!r})",
                           "model")

    def admit(e: AsyncLLMEngine, count: int) -> None:
        limit = e.engine.config.scheduler.max_num_seqs + config.max_queued_requests
        if e.num_requests + count > limit:
            raise APIError(429, f"too many requests: {e.num_requests} in flight, at most {limit}",
                           headers={"Retry-After": "1"})

    @app.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(CHAT_PAGE.read_text())

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine() is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        e = ready()
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "loom", "max_model_len": e.engine.config.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        e = ready()
        check_model(body.model)
        tokenizer = _tokenizer(e)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give either prompt or messages", "prompt")
        if body.messages is not None:
            ids = _chat_ids(tokenizer, conversation(body.messages), body.add_generation_prompt is not False)
        else:
            try:
                ids = tokenizer.encode(body.prompt, add_special_tokens=bool(body.add_special_tokens))
            except (ValueError, TypeError) as error:
                raise APIError(400, f"prompt: cannot be tokenized ({error})", "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": e.engine.config.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """What a client needs to tokenize on its side: the tokenizer's special tokens and
        configuration, and the chat templates by name."""
        e = ready()
        tokenizer = _tokenizer(e)
        return {**{k: v for k, v in tokenizer.config.items() if k != "chat_template"},
                **tokenizer.special_tokens, "vocab_size": tokenizer.vocab_size,
                "model_max_length": e.engine.config.max_model_len, "chat_templates": tokenizer.chat_templates,
                "chat_template": tokenizer.chat_template() if tokenizer.chat_templates else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        e = ready()
        check_model(body.model)
        vocab = e.engine.config.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": _tokenizer(e).decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        e = ready()
        check_model(body.model)
        prompts = _prompts(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        if body.echo and body.stream:
            raise APIError(400, "echo: not supported with stream", "echo")
        if max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: must be >= 1 (0 only with echo)", "max_tokens")
        # echo: the prompt's own tokens and logprobs come first (what lm-evaluation-harness
        # scores loglikelihoods from); max_tokens 0 generates one token and shows none.
        prompt_logprobs = body.logprobs if body.echo else None
        params = _params(body, 1 if max_tokens == 0 else max_tokens, body.logprobs, prompt_logprobs)
        choice = functools.partial(_completion_choice, echo=bool(body.echo), show_generated=max_tokens > 0,
                                   token_ids=bool(body.return_token_ids))
        return await _serve(e, raw, body, prompts, params, "cmpl", choice, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        e = ready()
        check_model(body.model)
        ids = _chat_ids(_tokenizer(e), body.conversation(), body.add_generation_prompt is not False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # as vLLM: what the context leaves
            max_tokens = max(e.engine.config.max_model_len - len(ids), 1)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(body, max_tokens, top)
        return await _serve(e, raw, body, [{"prompt_token_ids": ids}], params, "chatcmpl", _chat_choice,
                            "chat.completion")

    async def _serve(e: AsyncLLMEngine, raw: Request, body: SamplingRequest, prompts: list, params: Any,
                     prefix: str, choice: Callable, kind: str) -> Any:
        prompts = [_fit_context(e, _tokenized(e, p, i if len(prompts) > 1 else None), params.max_tokens)
                   for i, p in enumerate(prompts)]
        admit(e, len(prompts))
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(e.add_request(prompt, params, f"{request_id}-{i}"))
        except ValueError as error:
            for s in streams:
                s.close()
            param = _field_of(error)
            raise APIError(400, str(error) if len(prompts) == 1 else f"prompt {i}: {error}", param) from None
        header = {"id": request_id, "created": int(time.time()), "model": config.model_name}
        render = functools.partial(choice, top_n=params.logprobs or 0, token_text=_TokenTexts(e))
        if body.stream:
            return StreamingResponse(_stream(streams, header, params.n, render, kind, body.include_usage),
                                     media_type="text/event-stream")
        finals = await _until_disconnected(raw, _collect(streams))
        if any(o.finish_reason == "error" for out in finals for o in out.outputs):
            raise APIError(500, "the engine failed while running this request; the server goes on")
        choices = [render(i * params.n + o.index, o, out, stream=False, first=True)
                   for i, out in enumerate(finals) for o in out.outputs]
        return {**header, "object": kind, "choices": choices, "usage": _usage(finals)}

    return app


# ---- request to engine --------------------------------------------------------------------------
def _tokenizer(e: AsyncLLMEngine) -> Any:
    if e.engine.tokenizer is None:
        raise APIError(400, "model: this model has no tokenizer; send token ids")
    return e.engine.tokenizer


def _chat_ids(tokenizer: Any, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation through the model's chat template, tokenized; a model without a
    template, or messages it refuses, get a 400."""
    try:
        return tokenizer.encode_chat(conversation, add_generation_prompt=add_generation_prompt)
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error) if _field_of(error) else f"messages: {error}", "messages") from None


def _prompts(prompt: str | list) -> list:
    """A completions prompt, batch or not, as the engine's prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _tokenized(e: AsyncLLMEngine, prompt: str | dict, index: int | None) -> dict:
    """A text prompt with its token ids (the engine then keeps both)."""
    if not isinstance(prompt, str):
        return prompt
    where = "prompt" if index is None else f"prompt {index}"
    if not prompt:
        raise APIError(400, f"{where}: empty", "prompt")
    try:
        return {"prompt": prompt, "prompt_token_ids": _tokenizer(e).encode(prompt)}
    except Exception as error:  # the tokenizers library raises TypeError for a lone surrogate, say
        raise APIError(400, f"{where}: cannot be tokenized ({type(error).__name__}: {error})", "prompt") from None


def _fit_context(e: AsyncLLMEngine, prompt: dict, max_tokens: int) -> dict:
    """As OpenAI's API does: a prompt and max_tokens that together exceed the context are refused
    (the offline engine would stop at the context's end instead)."""
    limit, size = e.engine.config.max_model_len, len(prompt["prompt_token_ids"])
    if size >= limit:
        raise APIError(400, f"prompt: {size} tokens, and the context holds {limit}", "prompt")
    if size + max_tokens > limit:
        raise APIError(400, f"max_tokens: the context holds {limit} tokens; this request asks for {size} in the "
                            f"prompt and {max_tokens} to generate", "max_tokens")
    return prompt


def _params(body: SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> Any:
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as error:
        raise APIError(400, str(error), _field_of(error)) from None


# ---- engine to response -------------------------------------------------------------------------
async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    async def last(stream: RequestStream) -> RequestOutput:
        with stream:
            output = None
            async for output in stream:
                pass
            return output

    return list(await asyncio.gather(*(last(s) for s in streams)))


class _ClientGone(Exception):
    pass


async def _until_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; if the client leaves first, `work` is cancelled (which aborts its
    requests) and _ClientGone raised."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise _ClientGone
    finally:
        task.cancel()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's index."""
    if len(streams) == 1:  # the common case, read directly: no task and queue between it and the client
        with streams[0] as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            with stream:
                async for output in stream:
                    await queue.put((i, output))
        except BaseException as error:  # relayed, so that the response ends with it
            await queue.put((i, error))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _stream(streams: list[RequestStream], header: dict, n: int, choice: Callable, kind: str,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per engine output with news, a usage chunk if asked, then
    [DONE]. A failure mid-stream (the status line is long sent) becomes an error event."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
    finals: dict[int, RequestOutput] = {}
    generated = 0
    first = [True] * (len(streams) * n)
    try:
        async for i, out in _merged(streams):
            choices = []
            for o in out.outputs:
                index = i * n + o.index
                generated += len(o.token_ids)
                if o.finish_reason == "error":
                    raise RuntimeError("the engine failed while running this request; the server goes on")
                if o.text or o.token_ids or o.finish_reason or first[index]:  # a chunk per step with news
                    choices.append(choice(index, o, out, stream=True, first=first[index]))
                    first[index] = False
            if choices:
                yield _sse({**header, "object": chunk_kind, "choices": choices})
            if out.finished:
                finals[i] = out
    except Exception as error:
        yield _sse({"error": {"message": str(error), "type": "server_error", "param": None, "code": 500}})
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        prompt = sum(len(out.prompt_token_ids) for out in finals.values())
        yield _sse({**header, "object": chunk_kind, "choices": [],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": generated,
                              "total_tokens": prompt + generated}})
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(o.token_ids) for out in finals for o in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _TokenTexts:
    """Token text as logprobs show it: each token decoded alone (a token holding part of a UTF-8
    character shows U+FFFD), `token_id:N` for a model without a tokenizer."""

    def __init__(self, e: AsyncLLMEngine) -> None:
        self.tokenizer = e.engine.tokenizer

    def one(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt(self, token_ids: list[int]) -> str:
        """A prompt given as ids, as text (special tokens left out, as a text prompt has them)."""
        if self.tokenizer is None:
            return "".join(self.one(t) for t in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _top(candidates: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    """The `top_n` most likely of a token's candidates (which also hold the chosen token)."""
    return [(t, lp) for t, lp in candidates.items() if lp.rank <= top_n]


def _completion_choice(index: int, o: CompletionOutput, request: RequestOutput, stream: bool, first: bool,
                       top_n: int, token_text: _TokenTexts, echo: bool = False,
                       show_generated: bool = True, token_ids: bool = False) -> dict:
    """A completions choice; with `echo`, the prompt's text (and its tokens' logprobs, the
    first being None as it has no context) before what was generated."""
    ids = list(o.token_ids) if show_generated else []
    logprobs = list(o.logprobs or []) if show_generated else []
    text = o.text if show_generated else ""
    if echo:
        prompt_ids = request.prompt_token_ids
        prompt = request.prompt if request.prompt is not None else token_text.prompt(prompt_ids)
        text, ids = prompt + text, prompt_ids + ids
        logprobs = list(request.prompt_logprobs or [None] * len(prompt_ids)) + logprobs
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": o.finish_reason,
              "stop_reason": o.stop_reason}
    if token_ids:
        choice["token_ids"] = ids
    if o.logprobs is not None or (echo and request.prompt_logprobs is not None):
        tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
        for token_id, candidates in zip(ids, logprobs):
            piece = token_text.one(token_id)
            tokens.append(piece)
            token_logprobs.append(None if candidates is None else candidates[token_id].logprob)
            top.append(None if candidates is None else
                       {token_text.one(t): lp.logprob for t, lp in _top(candidates, top_n)})
            offsets.append(offset)
            offset += len(piece)
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                              "text_offset": offsets}
    return choice


def _chat_choice(index: int, o: CompletionOutput, request: RequestOutput, stream: bool, first: bool, top_n: int,
                 token_text: _TokenTexts) -> dict:
    logprobs = None
    if o.logprobs is not None:
        def entry(token_id: int, lp: Logprob) -> dict:
            text = token_text.one(token_id)
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

        logprobs = {"content": [{**entry(token_id, candidates[token_id]),
                                 "top_logprobs": [entry(t, lp) for t, lp in _top(candidates, top_n)]}
                                for token_id, candidates in zip(o.token_ids, o.logprobs)]}
    message = {"role": "assistant", "content": o.text} if first or not stream else {"content": o.text}
    return {"index": index, ("delta" if stream else "message"): message, "logprobs": logprobs,
            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
