"""OpenAI's Responses API (``POST /v1/responses``) over the chat pipeline.

A Responses request is translated into the chat-completions request it means (``to_chat``:
``instructions`` a system message, ``input`` items messages, function tools and their calls and
outputs the chat shapes, ``text.format`` a ``response_format``, ``max_output_tokens`` the
completion limit) and served by ``Service.chat`` like any chat request, record included (its
``endpoint`` is ``/v1/responses``, its ``response_id`` the ``resp_...`` id); the chat answer is
translated back: a response object (``response_object``), or for a stream the chat chunks become
the typed Responses events (``ResponseEvents``: ``response.created`` ...
``response.output_text.delta`` ... ``response.completed``). LiteLLM serves the Responses API
over chat backends the same way.

More: docs/design/gateway-notes.md#gatewayresponses."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from gateway.schemas import ResponsesRequest, unsupported
from tracing.sse import event as sse_event

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# a chat request's field -> the Responses field it came from (a 400 names the client's field)
PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format", "messages": "input", "logprobs": "include",
          "stream_options": "stream"}


def param_name(param: str | None) -> str | None:
    """The Responses request's name of a chat request field named in a 400."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "tools":  # a chat tool is {"type", "function": {...}}; a Responses one is flat
        return param.replace(".function.", ".")
    return PARAMS.get(head, head) + ("." + rest if rest and head not in PARAMS else "")


def _text(content: Any, where: str, roles: tuple[str, ...]) -> str:
    """A message's content as text: a string, or text parts (``input_text``, and an
    assistant's ``output_text``); any other part is refused, naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise unsupported(f"{where}.content", "content is a string or a list of parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in roles or not isinstance(part.get("text"), str):
            raise unsupported(f"{where}.content.{j}.type",
                              f"content part type {kind!r}: the bundled engine reads text parts "
                              f"({', '.join(roles)}) only; image, file and audio input are "
                              "refused rather than dropped")
        out.append(part["text"])
    return "".join(out)


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": req.input}]}]
    return list(req.input)


def to_messages(items: list[dict], where: str = "input") -> list[dict]:
    """Responses items (a request's input, or a response's output) as chat messages: messages,
    the model's function calls (an assistant turn's ``tool_calls``; parallel calls one turn) and
    their outputs (tool messages); anything else is refused, naming it."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise unsupported(f"{at}.role", f"role {role!r}: one of user, system, "
                                  "developer, assistant")
            parts = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            messages.append({"role": role, "content": _text(item.get("content"), at, parts)})
        elif kind == "function_call":  # the model's earlier call: an assistant turn's call
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                raise unsupported(at, "a function_call item has call_id, name and arguments "
                                  "(strings)")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last["content"]:  # parallel calls: one assistant turn
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise unsupported(f"{at}.call_id", "a function_call_output names its call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(output, at, ("input_text",))})
        else:
            raise unsupported(f"{at}.type", f"input item type {kind!r}: message, "
                              "function_call and function_call_output items are served (an "
                              "earlier turn is continued with previous_response_id, not by "
                              "item reference)")
    return messages


def _tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise unsupported(f"tools.{i}.type", f"tool type {kind!r}: only function tools "
                                  "are served (built-in tools such as web search run at "
                                  "OpenAI, not here)")
            fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
            extra = set(t) - {"type", "name", "description", "parameters", "strict"}
            if extra:
                raise unsupported(f"tools.{i}.{sorted(extra)[0]}", "unknown tool field")
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise unsupported("tool_choice", 'tool_choice is "none", "auto", "required" or '
                              '{"type": "function", "name": ...} (hosted tools are not served)')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _format(req: ResponsesRequest) -> dict | None:
    fmt = (req.text or {}).get("format")
    extra = set(req.text or {}) - {"format"}
    if extra:  # e.g. verbosity: a reasoning model's setting
        raise unsupported(f"text.{sorted(extra)[0]}", "text takes format only here")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise unsupported("text.format.type", "text.format is text, json_object or json_schema")


def to_chat(req: ResponsesRequest, history: list[dict] | None = None) -> dict:
    """The chat-completions request a Responses request means, continuing ``history`` (the
    chat messages of the conversation its ``previous_response_id`` ended; the caller looks
    it up); ``unsupported`` (a 400 naming the field) for what this gateway cannot honour."""
    for field in ("conversation", "prompt", "max_tool_calls"):
        if getattr(req, field) is not None:
            raise unsupported(field, f"{field} is not supported (continue a conversation with "
                              "previous_response_id, or send all of it in input)")
    if req.background:
        raise unsupported("background", "background responses are not supported")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise unsupported("reasoning", "reasoning settings are not supported by the bundled "
                          "engine")
    if req.truncation == "auto":
        raise unsupported("truncation", "truncation: auto is not supported (a prompt over the "
                          "context is a 400)")
    if req.stream_options and (set(req.stream_options) - {"include_obfuscation"} or
                               not isinstance(req.stream_options["include_obfuscation"], bool)):
        raise unsupported("stream_options", "stream_options takes include_obfuscation (true or "
                          "false) only")
    include = set(req.include or ())
    if include - {LOGPROBS_INCLUDE}:
        raise unsupported("include", f"include takes {LOGPROBS_INCLUDE!r} only")
    if req.top_logprobs and LOGPROBS_INCLUDE not in include:
        raise unsupported("top_logprobs", f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")
    tools, choice = _tools(req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "stream": req.stream, "messages": [
        *system, *(history or []), *to_messages(input_items(req))]}
    optional = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "tools": tools, "tool_choice": choice,
                "parallel_tool_calls": req.parallel_tool_calls,
                "response_format": _format(req), "user": req.user, "metadata": req.metadata,
                "safety_identifier": req.safety_identifier}
    body.update({k: v for k, v in optional.items() if v is not None})
    if LOGPROBS_INCLUDE in include:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.stream:  # the final usage goes into response.completed
        body["stream_options"] = {"include_usage": True}
    return body


# ---- stored responses ---------------------------------------------------------------------------
@dataclass
class Stored:
    tenant: str
    response: dict  # the response object as the client got it
    conversation: list[dict]  # chat messages: earlier turns, this input, this output
    items: list[dict]  # this request's input items, with ids (GET .../input_items)
    size: int  # bytes, as JSON


class ResponseStore:
    """Responses kept for ``previous_response_id`` and retrieval, in this gateway's memory,
    at most ``max_bytes`` of them (their JSON size). A response is found only by the tenant
    that created it. Past the bound, the tenant holding the most bytes gives up its least
    recently used response first: one tenant's flood evicts its own, not everyone's."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: dict[str, OrderedDict[str, Stored]] = {}  # tenant -> its, LRU first
        self._held: dict[str, int] = {}  # tenant -> the bytes it holds
        self._lock = threading.Lock()  # the event loop and a stream's end may both touch it

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def put(self, tenant: str, response: dict, conversation: list[dict], items: list[dict]
            ) -> bool:
        """Keep ``response``; False when it alone is over the bound (then nothing is kept)."""
        size = len(json.dumps([response, conversation, items], ensure_ascii=False))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(tenant, response["id"])
            self._kept.setdefault(tenant, OrderedDict())[response["id"]] = Stored(
                tenant, response, conversation, items, size)
            self._held[tenant] = self._held.get(tenant, 0) + size
            self.bytes += size
            while self.bytes > self.max_bytes:
                biggest = max(self._held, key=self._held.__getitem__)
                self._drop(biggest, next(iter(self._kept[biggest])))
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        with self._lock:
            kept = self._kept.get(tenant)
            got = kept.get(response_id) if kept is not None else None
            if got is not None:
                kept.move_to_end(response_id)
            return got

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return self._drop(tenant, response_id)

    def held(self, tenant: str) -> int:
        """The bytes ``tenant``'s responses take."""
        return self._held.get(tenant, 0)

    def _drop(self, tenant: str, response_id: str) -> bool:
        kept = self._kept.get(tenant)
        got = kept.pop(response_id, None) if kept is not None else None
        if got is None:
            return False
        self.bytes -= got.size
        self._held[tenant] -= got.size
        if not kept:
            del self._kept[tenant], self._held[tenant]
        return True


def with_ids(items: list[dict]) -> list[dict]:
    """Input items as OpenAI lists them: each with an ``id`` (kept when the client gave one)
    and a message's string content as an ``input_text`` part."""
    out = []
    for item in items:
        item = {"type": "message", **item}
        prefix = {"message": "msg_", "function_call": "fc_",
                  "function_call_output": "fco_"}.get(item["type"], "item_")
        item.setdefault("id", prefix + uuid.uuid4().hex)
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        out.append(item)
    return out


# ---- answers ------------------------------------------------------------------------------------
def _usage(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _logprobs(chat_logprobs: dict | None) -> list:
    """Chat's logprobs content entries in the Responses shape (the same fields)."""
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
             "top_logprobs": e["top_logprobs"]}
            for e in (chat_logprobs or {}).get("content") or []]


class Shell:
    """What every response object of one request repeats: its id, creation time and the
    request's settings, as OpenAI echoes them."""

    def __init__(self, req: ResponsesRequest, stored: bool = False) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.req = req
        self.stored = stored  # kept in the gateway's ResponseStore once it ends

    def response(self, status: str, output: list, usage: dict | None = None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "model": r.model, "output": output,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id,
                "reasoning": {"effort": None, "summary": None}, "store": self.stored,
                "temperature": r.temperature, "text": r.text or {
                    "format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto",
                "tools": r.tools or [], "top_p": r.top_p, "truncation": "disabled",
                "usage": usage, "user": r.user, "metadata": r.metadata or {}}


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24],
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def response_object(shell: Shell, chat: dict) -> dict:
    """A chat completion (non-streamed) as the response object."""
    (choice,) = chat["choices"]
    message = choice["message"]
    output: list[dict] = []
    if message.get("content"):
        output.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status":
                       "completed", "role": "assistant", "content": [{
                           "type": "output_text", "text": message["content"],
                           "annotations": [], "logprobs": _logprobs(choice.get("logprobs"))}]})
    output += [_call_item(c) for c in message.get("tool_calls") or []]
    status, incomplete = _status(choice.get("finish_reason"))
    if incomplete and output:  # the item the token budget cut (the ones before it are whole)
        output[-1]["status"] = "incomplete"
    return shell.response(status, output, _usage(chat.get("usage")), incomplete)


class ResponseEvents:
    """A chat stream's chunks (decoded) as the Responses API's typed events, in order: the
    response created and in progress, each output item added, its text or arguments in
    deltas, each done, the response completed (or incomplete, or failed) with its usage.
    Each event is ``(type, payload)``; payloads carry ``type`` and ``sequence_number``."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.seq = 0
        self.output: list[dict] = []
        self.message: dict | None = None  # the text item while it is open
        self.calls: dict[int, dict] = {}  # chat tool-call index -> function_call item
        self.finish: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **payload) -> tuple[str, dict]:
        out = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return kind, out

    def start(self) -> list[tuple[str, dict]]:
        r = self.shell.response("in_progress", [])
        return [self._event("response.created", response=r),
                self._event("response.in_progress", response=r)]

    def chunk(self, data: dict) -> list[tuple[str, dict]]:
        if "error" in data:  # the chat stream's error event: the response failed
            return self._fail(data["error"])
        if data.get("usage"):
            self.usage = _usage(data["usage"])
        events: list[tuple[str, dict]] = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"], _logprobs(choice.get("logprobs")))
            for tc in delta.get("tool_calls") or []:
                events += self._call(tc)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def _text(self, delta: str, logprobs: list) -> list[tuple[str, dict]]:
        events = []
        if self.message is None:
            self.message = {"type": "message", "id": "msg_" + uuid.uuid4().hex,
                            "status": "in_progress", "role": "assistant", "content": []}
            self.output.append(self.message)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index,
                                      item={**self.message, "content": []}))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.message["content"].append(part)
            events.append(self._event("response.content_part.added",
                                      item_id=self.message["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        part = self.message["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        events.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                  output_index=self.output.index(self.message),
                                  content_index=0, delta=delta, logprobs=logprobs))
        return events

    def _call(self, tc: dict) -> list[tuple[str, dict]]:
        events = []
        fn = tc.get("function") or {}
        item = self.calls.get(tc.get("index", 0))
        if item is None:
            item = _call_item({"id": tc.get("id") or "", "function": {
                "name": fn.get("name") or "", "arguments": ""}}, status="in_progress")
            self.calls[tc.get("index", 0)] = item
            self.output.append(item)
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output) - 1, item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"],
                                      output_index=self.output.index(item),
                                      delta=fn["arguments"]))
        return events

    def end(self) -> list[tuple[str, dict]]:
        events = []
        status, incomplete = _status(self.finish)
        for index, item in enumerate(self.output):
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self._event("response.output_text.done", item_id=item["id"],
                                          output_index=index, content_index=0,
                                          text=part["text"], logprobs=part["logprobs"]))
                events.append(self._event("response.content_part.done", item_id=item["id"],
                                          output_index=index, content_index=0,
                                          part=dict(part)))
            else:
                events.append(self._event("response.function_call_arguments.done",
                                          item_id=item["id"], output_index=index,
                                          name=item["name"], arguments=item["arguments"]))
            cut = incomplete is not None and index == len(self.output) - 1
            item["status"] = "incomplete" if cut else "completed"
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=item))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=self.shell.response(
            status, self.output, self.usage, incomplete)))
        return events

    def _fail(self, error: dict) -> list[tuple[str, dict]]:
        err = {"code": error.get("code") or "server_error", "message": error.get("message")}
        return [self._event("error", code=err["code"], message=err["message"],
                            param=error.get("param")),
                self._event("response.failed", response=self.shell.response(
                    "failed", self.output, self.usage, error=err))]


def response_event(kind: str, payload: dict, obfuscate: bool = False) -> bytes:
    """One Responses event; with ``obfuscate`` a delta event is padded (``obfuscated``)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    if obfuscate and kind.endswith(".delta"):
        data = obfuscated(data)
    return sse_event(data, kind)


# A streamed chunk's length tells an eavesdropper on an encrypted link how long its token is,
# and a run of them the text (the token-length side channel). With stream_options'
# include_obfuscation, OpenAI adds random characters in an ``obfuscation`` field to normalize
# the sizes; here the field pads each chunk's JSON to a multiple of this many bytes, so every
# chunk of a few tokens' text is the same size on the wire. Written here (a few lines) because
# no library does it: it is a payload convention, not an encoding.
OBFUSCATION_BLOCK = 64
_OBFUSCATION_FIELD = b',"obfuscation":""'


def obfuscated(data: bytes) -> bytes:
    """A JSON object's bytes with an ``obfuscation`` field of random URL-safe characters
    appended, its length making the whole a multiple of ``OBFUSCATION_BLOCK`` bytes."""
    pad = -(len(data) + len(_OBFUSCATION_FIELD)) % OBFUSCATION_BLOCK
    noise = base64.urlsafe_b64encode(os.urandom(pad))[:pad]
    return data[:-1] + b',"obfuscation":"' + noise + b'"}'
