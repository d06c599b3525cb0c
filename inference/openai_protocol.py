"""The OpenAI wire format of /v1/completions and /v1/chat/completions: request bodies checked and read into engine
requests, and the JSON of answers, stream chunks and errors (as OpenAI's API and vLLM's server write them). Every
refusal is an `ApiError` naming the field and the fix; the fields read and refused: docs/serving.md, "The API"."""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any

from medusa_jax.inference.engine_requests import RequestParams
from medusa_jax.inference.sampling import SamplingConfig

MAX_STOP_STRINGS = 4
ROLES = ("system", "user", "assistant", "developer")
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "tool_choice",
               "functions", "response_format", "presence_penalty", "frequency_penalty")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat: [{"role", "content": str}]
    max_tokens: int | None  # None: the rest of the context (chat) / 16 (completions), set by `params`
    sampling: SamplingConfig
    seed: int
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...]
    stream: bool
    include_usage: bool

    def params(self, prompt_tokens: int, context: int) -> RequestParams:
        default = max(context - prompt_tokens, 1) if self.chat else 16
        return RequestParams(self.max_tokens or default, self.sampling, self.seed, self.stop_ids)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number, got {value!r}", name)
    if not (low < value if low_open else low <= value) or value > high:
        raise ApiError(400, f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", name)
    if value < low:
        raise ApiError(400, f"'{name}' must be >= {low}, got {value}", name)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"'{name}' must be a list of integer token ids", name)
    return value


def _unicode(text: str, where: str, param: str) -> str:
    """`text` if it is valid Unicode; JSON's \\u escapes can carry a lone UTF-16 surrogate, which no tokenizer
    encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{where} is not valid Unicode text: a lone surrogate (\\u{ord(text[e.start]):04x}) at "
                            f"character {e.start}; send the character whole (a surrogate pair)", param) from None
    return text


def _content(message: Any, i: int) -> dict:
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ApiError(400, f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", "messages")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}} (text only)",
                           "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string, got {type(content).__name__}", "messages")
    return {"role": role, "content": _unicode(content, f"messages[{i}].content", "messages")}


def parse_request(body: Any, chat: bool, model_id: str) -> ParsedRequest:
    """A decoded JSON body -> ParsedRequest, or ApiError (400; 404 for a model this server does not serve)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_id!r}", "model",
                       code="model_not_found")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, 0.0, {}, []):
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out", name)
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {body.get('n')!r}", "n")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
        messages = [_content(m, i) for i, m in enumerate(messages)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if prompt and all(isinstance(p, (str, list)) for p in prompt):
                raise ApiError(400, "one prompt per request: send several requests", "prompt")
            prompt = _token_ids(prompt, "prompt")
        elif not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")
        else:
            _unicode(prompt, "'prompt'", "prompt")
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
    max_tokens = _integer(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                          else "max_tokens", 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", -1)
    seed = _integer(body, "seed", -2**63)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) \
            or len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                       "stop")
    for s in stop:
        _unicode(s, "'stop'", "stop")
    stop_ids = tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {'include_usage': true}", "stream_options")
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    return ParsedRequest(chat, prompt, messages, max_tokens,
                         SamplingConfig(temperature, top_p, 0 if top_k in (None, -1) else top_k),
                         secrets.randbits(31) if seed is None else seed, tuple(stop), stop_ids, stream,
                         bool(options.get("include_usage", False)))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def answer_body(chat: bool, rid: str, created: int, model: str, text: str, finish_reason: str,
                prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole answer of a request without `stream`."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(chat: bool, rid: str, created: int, model: str, text: str | None, finish_reason: str | None = None,
               role: bool = False, usage_counts: dict | None = None) -> dict:
    """One SSE chunk: a piece of text (chat: a delta; role=True: the first, announcing the assistant), the last
    one with finish_reason, or (usage_counts given) the usage chunk, whose choices are empty."""
    if usage_counts is not None:
        choices = []
    elif chat:
        delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if usage_counts is not None:
        body["usage"] = usage_counts
    return body
