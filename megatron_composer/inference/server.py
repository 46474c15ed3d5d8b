"""OpenAI-compatible HTTP server over the rollout `Engine` (FastAPI + uvicorn).

    python -m megatron_composer.inference.server --load runs/tiny/cpt_32k --port 8000

The tokenizer is `--tokenizer-model`, else the one the checkpoint carries
(`checkpoint.checkpoint_tokenizer`: training saves it with the checkpoint).

Endpoints:

    POST /v1/completions        prompt as text or token ids, or a list of either; n; stream
    POST /v1/chat/completions   our chat template (`data.sft.render_chat`) and tool-call format
                                (`data.tool_calls`); stream; tools -> tool_calls
    GET  /v1/models, /health
    GET  /v1/weights            {"version": current weights version}
    POST /v1/weights            application/octet-stream: a published `WeightUpdate` (full or a
                                delta on the last one, `weight_sync.encode_update`'s bytes; a
                                delta on another version is a 409: send a snapshot), or JSON
                                {"path": CHECKPOINT, "version": optional}; returns {"version": new}
    GET  /openapi.json, /docs

Every choice also carries `token_ids` (generated ids), `prompt_token_ids`,
`policy_versions` (the weights version behind each generated token), with
logprobs `sampling_logprobs` (`Completion.sampling_logprobs`) and, when the
request sets `return_routed_experts`, `routed_experts`: a nested list
[prompt + generated tokens][MoE layer][top-k] (`Completion.routed_experts`).
`protocol.py` has the request fields and how they map to `SamplingParams`.

How requests run: `create_app` starts the engine's background loop. Every
choice of every HTTP request is one `Engine.add_request` whose `on_token`
callback (on the engine thread) hands each `GenerationEvent` to the request's
asyncio queue with `loop.call_soon_threadsafe`, so concurrent HTTP requests
decode in the same engine batch. A streaming client that disconnects
cancels its requests. A malformed request gets a 4xx with OpenAI's error
body naming the bad value; weight updates run in a worker thread and land
between two engine steps. A weight update is checked whole before anything
changes: its framing, then every name, shape and dtype against the model
(before any payload is inflated), then the rebuilt values (finite). The
server keeps the last update's weights (in the published dtype) as the base
of the next delta, as an async RL inference worker does.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import threading
import time
import uuid

import torch
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..checkpoint.state import global_param_names, model_state_dict
from ..data.sft import render_chat
from ..data.tool_calls import (
    CALL_OPEN,
    ToolFormatError,
    messages_for_template,
    parse_tool_calls,
)
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    TextStream,
    WeightsRequest,
    chat_logprobs,
    chat_message,
    choice_extensions,
    choice_params,
    completion_logprobs,
    error_body,
    sampling_params,
    tool_calls_json,
    validation_message,
)
from .weight_sync import CONTENT_TYPE, StaleBaseError, WeightSubscriber, decode_update
from .weights import check_layout

OWNED_BY = "megatron-composer"
DEFAULT_MAX_CHOICES = 128
_WATCH_SECONDS = 1.0
_log = logging.getLogger(__name__)
_ERROR_RESPONSES = {400: {"description": "a malformed request; OpenAI's error body names the bad value"}}
_WEIGHTS_BODY = {"requestBody": {"required": True, "content": {
    CONTENT_TYPE: {"schema": {"type": "string", "format": "binary",
                              "description": "a WeightUpdate: inference.weight_sync.encode_update's bytes"}},
    "application/json": {"schema": WeightsRequest.model_json_schema()}}}}
_WEIGHTS_RESPONSES = {**_ERROR_RESPONSES, 409: {"description": "a delta on another weights version; send a full one"}}


class _Choices:
    """The engine requests behind one HTTP request, their events bridged onto the event loop."""

    def __init__(self, engine, specs: list[tuple[list[int], object]]):
        self.engine, self.specs = engine, specs
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list = []

    def _push(self, index: int, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
        except RuntimeError:  # the loop closed (server shutting down): nobody is waiting
            pass

    def submit(self) -> _Choices:
        try:
            for i, (prompt, params) in enumerate(self.specs):
                on_token = functools.partial(self._push, i)
                self.handles.append(self.engine.add_request(prompt, params, on_token=on_token))
        except ValueError as exc:
            self.cancel()
            raise RequestError(str(exc)) from None
        return self

    async def events(self):
        """(choice index, GenerationEvent) until every choice has finished.

        A failed engine step finishes its requests with an error and no event,
        so a quiet queue is a cue to look at the handles.
        """
        remaining = len(self.handles)
        while remaining:
            try:
                index, event = await asyncio.wait_for(self.queue.get(), _WATCH_SECONDS)
            except asyncio.TimeoutError:  # noqa: UP041 - not the builtin one on Python 3.10
                for handle in self.handles:
                    if handle.done():
                        handle.result(timeout=0)  # raises the engine's error, if any
                continue
            remaining -= event.finished
            yield index, event

    async def completions(self) -> list:
        results = [None] * len(self.handles)
        try:
            async for index, event in self.events():
                if event.finished:
                    results[index] = event.completion
        finally:
            self.cancel()
        return results

    def cancel(self) -> None:
        for handle in self.handles:
            if not handle.done():
                handle.cancel()


def _stream_extensions(choice: dict, event, sent: list, prompt, return_routed_experts: bool) -> None:
    """The extension fields a streamed chunk carries: the prompt ids with the first tokens
    (`sent` is every id streamed so far), the routed experts with the last chunk."""
    if len(sent) == len(event.token_ids) and event.token_ids:
        choice["prompt_token_ids"] = list(prompt)
    if event.finished and return_routed_experts:
        choice["routed_experts"] = choice_extensions(event.completion, True)["routed_experts"]


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompts: list[list[int]], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Server:
    """The route handlers, sharing one engine."""

    def __init__(self, engine, model_name: str, max_choices: int):
        self.engine, self.model_name, self.max_choices = engine, model_name, max_choices
        self.tokenizer = engine.tokenizer
        self.subscriber = WeightSubscriber()  # the last WeightUpdate's weights: the base of the next delta
        self._weights_lock = threading.Lock()  # one update at a time (they run in worker threads)

    # -------------------------------------------------------------- shared
    def _check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise RequestError(f"model {requested!r} is not served here; use {self.model_name!r}", "model")

    def _end_ids(self, chat: bool) -> tuple[int, ...]:
        if self.tokenizer is None:
            return ()
        return (self.tokenizer.eod, self.tokenizer.chat["end"]) if chat else (self.tokenizer.eod,)

    def _specs(self, prompts: list[list[int]], params, n: int) -> list[tuple[list[int], object]]:
        if len(prompts) * n > self.max_choices:
            raise RequestError(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} completions; this server "
                               f"takes at most {self.max_choices} per request", "n")
        per_choice = choice_params(params, n)
        return [(prompt, p) for prompt in prompts for p in per_choice]

    def _stream(self, body) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -------------------------------------------------------------- completions
    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer; send token ids or start the server with "
                                   "--tokenizer-model", "prompt")
            texts = [prompt] if isinstance(prompt, str) else prompt
            return [self.tokenizer.encode(t) for t in texts]
        if not prompt or isinstance(prompt[0], int):
            return [list(prompt)]
        return [list(p) for p in prompt]

    async def completions(self, req: CompletionRequest):
        self._check_model(req.model)
        if req.echo:
            raise RequestError("echo is not supported; the prompt is in prompt_token_ids", "echo")
        prompts = self._completion_prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = sampling_params(req, max_tokens=max_tokens, top_logprobs=req.logprobs,
                                 stop_ids=self._end_ids(chat=False))
        choices = _Choices(self.engine, self._specs(prompts, params, req.n)).submit()
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        text = functools.partial(TextStream, self.tokenizer, params.stop, params.stop_token_ids)
        if req.stream:
            return self._stream(self._stream_completions(req, meta, choices, text))
        results = await choices.completions()
        out = []
        for i, c in enumerate(results):
            logprobs = None
            if params.logprobs:
                logprobs = completion_logprobs(self.tokenizer, c.token_ids, c.logprobs, c.top_logprobs,
                                               req.return_tokens_as_token_ids)
            out.append({"index": i, "text": text().full_text(c.token_ids, c.finish_reason), "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        **choice_extensions(c, req.return_routed_experts)})
        return {**meta, "choices": out, "usage": _usage(prompts, sum(len(c.token_ids) for c in results))}

    async def _stream_completions(self, req, meta, choices: _Choices, text):
        streams = [text() for _ in choices.handles]
        ids = [[] for _ in choices.handles]
        offsets = [0] * len(choices.handles)
        try:
            async for i, event in choices.events():
                ids[i] += event.token_ids
                finish = event.completion.finish_reason if event.finished else None
                choice = {"index": i, "text": streams[i].delta(ids[i], finish), "logprobs": None,
                          "finish_reason": finish, "token_ids": event.token_ids,
                          "policy_versions": event.policy_versions}
                if event.token_ids and req.logprobs is not None:
                    logprobs = completion_logprobs(self.tokenizer, event.token_ids, event.logprobs,
                                                   event.top_logprobs, req.return_tokens_as_token_ids, offsets[i])
                    offsets[i] += sum(len(t) for t in logprobs["tokens"])
                    choice["logprobs"] = logprobs
                    choice["sampling_logprobs"] = event.sampling_logprobs
                _stream_extensions(choice, event, ids[i], choices.specs[i][0], req.return_routed_experts)
                yield _sse({**meta, "choices": [choice]})
            if (req.stream_options or {}).get("include_usage"):
                prompts = [p for p, _ in choices.specs[::req.n]]
                yield _sse({**meta, "choices": [], "usage": _usage(prompts, sum(map(len, ids)))})
            yield "data: [DONE]\n\n"
        finally:
            choices.cancel()

    # -------------------------------------------------------------- chat
    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], bool]:
        """(prompt ids, whether tool calls are parsed from the reply)."""
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer; start the server with --tokenizer-model", "messages")
        if req.tool_choice not in (None, "auto", "none"):
            raise RequestError(f"tool_choice {req.tool_choice!r} is not supported; use \"auto\" or \"none\"",
                               "tool_choice")
        if not req.messages:
            raise RequestError("messages is empty; send at least one message", "messages")
        tools = req.tools if req.tool_choice != "none" else None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            rendered = messages_for_template(messages, tools)
        except ToolFormatError as exc:
            raise RequestError(str(exc), "tools" if str(exc).startswith("tools") else "messages") from None
        ids, _ = render_chat(rendered, self.tokenizer, add_generation_prompt=True)
        return ids, bool(tools)

    def _chat_params(self, req: ChatCompletionRequest, prompt: list[int]):
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(prompt))
        top = (req.top_logprobs or 0) if req.logprobs else None
        return sampling_params(req, max_tokens=max_tokens, top_logprobs=top, stop_ids=self._end_ids(chat=True))

    async def chat(self, req: ChatCompletionRequest):
        self._check_model(req.model)
        prompt, with_tools = self._chat_prompt(req)
        params = self._chat_params(req, prompt)
        choices = _Choices(self.engine, self._specs([prompt], params, req.n)).submit()
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name}
        text = functools.partial(TextStream, self.tokenizer, params.stop, params.stop_token_ids)
        if req.stream:
            meta["object"] = "chat.completion.chunk"
            # what is shown while streaming stops at a tool call; the calls go out parsed at the end
            shown = functools.partial(TextStream, self.tokenizer, params.stop + (CALL_OPEN,) * with_tools,
                                      params.stop_token_ids)
            return self._stream(self._stream_chat(req, meta, choices, text, shown, with_tools))
        out = []
        results = await choices.completions()
        for i, c in enumerate(results):
            message, calls = chat_message(text().full_text(c.token_ids, c.finish_reason), with_tools)
            logprobs = None
            if params.logprobs:
                logprobs = chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, c.top_logprobs,
                                         req.return_tokens_as_token_ids)
            out.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": "tool_calls" if calls else c.finish_reason,
                        **choice_extensions(c, req.return_routed_experts)})
        return {**meta, "choices": out, "usage": _usage([prompt], sum(len(c.token_ids) for c in results))}

    def _final_chat_delta(self, text, ids, finish, with_tools, shown: str) -> tuple[dict, str]:
        """The last delta of a streamed choice: the content after what was shown and any tool calls."""
        full = text().full_text(ids, finish)
        if not with_tools:
            return {}, finish
        rest, calls, _ = parse_tool_calls(full[len(shown):])
        delta = {"content": rest} if rest else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls_json(calls))]
            finish = "tool_calls"
        return delta, finish

    async def _stream_chat(self, req, meta, choices: _Choices, text, shown, with_tools: bool):
        streams = [shown() for _ in choices.handles]
        ids = [[] for _ in choices.handles]
        try:
            for i in range(len(choices.handles)):
                delta = {"role": "assistant", "content": ""}
                yield _sse({**meta, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]})
            async for i, event in choices.events():
                ids[i] += event.token_ids
                finish = event.completion.finish_reason if event.finished else None
                piece = streams[i].delta(ids[i], finish)
                delta = {"content": piece} if piece else {}
                if finish is not None:
                    extra, finish = self._final_chat_delta(text, ids[i], finish, with_tools, streams[i].sent)
                    delta.update(extra)
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish,
                          "token_ids": event.token_ids, "policy_versions": event.policy_versions}
                if event.token_ids and req.logprobs:
                    choice["logprobs"] = chat_logprobs(self.tokenizer, event.token_ids, event.logprobs,
                                                       event.top_logprobs, req.return_tokens_as_token_ids)
                    choice["sampling_logprobs"] = event.sampling_logprobs
                _stream_extensions(choice, event, ids[i], choices.specs[i][0], req.return_routed_experts)
                yield _sse({**meta, "choices": [choice]})
            if (req.stream_options or {}).get("include_usage"):
                yield _sse({**meta, "choices": [], "usage": _usage([choices.specs[0][0]], sum(map(len, ids)))})
            yield "data: [DONE]\n\n"
        finally:
            choices.cancel()

    # -------------------------------------------------------------- weights
    async def update_weights(self, request: Request) -> dict:
        """POST /v1/weights: binary `WeightUpdate` bytes, or JSON {"path", "version"} (module docstring)."""
        body = await request.body()
        if request.headers.get("content-type", "").split(";")[0].strip() == CONTENT_TYPE:
            version = await run_in_threadpool(self._apply_update, body)
        else:
            try:
                req = WeightsRequest.model_validate_json(body)
            except pydantic.ValidationError as exc:
                raise RequestValidationError(exc.errors()) from None
            version = await run_in_threadpool(self._reload, req.path, req.version)
        return {"version": version}

    def _apply_update(self, data: bytes) -> int:
        with self._weights_lock:
            try:
                update = decode_update(data)
                model = self.engine.model
                check_layout(model_state_dict(model), {n: (p.shape, p.dtype) for n, p in update.tensors.items()},
                             global_param_names(model))
                state = self.subscriber.rebuild(update)
                version = self.engine.update_weights(state, update.version)
            except StaleBaseError as exc:
                raise RequestError(str(exc), "base_version", status=409) from None
            except ValueError as exc:
                raise RequestError(str(exc), "weights") from None
            self.subscriber.commit(update, state)
            return version

    def _reload(self, path: str, version: int | None) -> int:
        with self._weights_lock:
            try:
                version = self.engine.update_weights(path, version)
            except ValueError as exc:
                raise RequestError(str(exc), "path") from None
            self.subscriber.reset()  # the next binary update must be a full one
            return version

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": OWNED_BY,
                "max_model_len": self.engine.max_model_len}
        return {"object": "list", "data": [card]}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_, exc: RequestError):
        return JSONResponse(error_body(str(exc), exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_, exc: Exception):
        _log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", kind="server_error"),
                            status_code=500)


def create_app(engine, *, model_name: str = "megatron-composer",
               max_choices: int = DEFAULT_MAX_CHOICES) -> FastAPI:
    """The FastAPI app serving `engine` (an `Engine`); starts its background loop.

    The caller owns the engine and stops it (`engine.stop()`) when done.
    `max_choices`: most completions (prompts x n) one request may ask for.
    """
    server = _Server(engine, model_name, max_choices)
    app = FastAPI(title="megatron-composer inference", version="1",
                  description="OpenAI-compatible completions over the rollout engine")
    _install_error_handlers(app)
    app.state.server = server

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(req: CompletionRequest):
        return await server.completions(req)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest):
        return await server.chat(req)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": engine.version}

    @app.get("/v1/weights")
    async def weights_version():
        return {"version": engine.version}

    @app.post("/v1/weights", responses=_WEIGHTS_RESPONSES, openapi_extra=_WEIGHTS_BODY)
    async def update_weights(request: Request):
        return await server.update_weights(request)

    engine.start()
    return app


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="checkpoint root or iter_XXXXXXX directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokenizer-model", default=None,
                        help="SentencePiece .model or Kimi's tiktoken.model (text prompts, chat, stop); "
                             "default: the checkpoint's own")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests decoding at once")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --load)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    import uvicorn

    from ..checkpoint import checkpoint_tokenizer
    from .engine import Engine

    args = parse_args(argv)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    tokenizer = args.tokenizer_model or checkpoint_tokenizer(args.load)
    engine = Engine.from_checkpoint(args.load, device=args.device, dtype=dtype, tokenizer=tokenizer,
                                    max_batch_size=args.max_batch_size, max_model_len=args.max_model_len)
    app = create_app(engine, model_name=args.served_model_name or args.load)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
