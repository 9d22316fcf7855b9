"""Tool calling for the bundled engine: the request's tools in the prompt, the model's calls out of
its text, enforced by the grammar engine when the caller requires a call.

The format (Tailscope's, for every model: the bundled chat template has no tool section, and
one documented format beats a guess at each checkpoint's own). The tools are listed in a system
message (``preamble``), and a call is one JSON object and nothing else::

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}

An assistant turn that made calls is rendered in the conversation as that object, and a ``tool``
message as the tool's result text (``[tool result call_…]`` first), so earlier turns look like
what the model is asked to write.

More: docs/design/gateway-notes.md#gatewaytools."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import ParamError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_SCALAR = re.compile(r"-?[0-9.eE+-]+|true|false|null")




@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    mode: str  # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True
    # asked with OpenAI's deprecated ``functions``: one call, answered as ``function_call``
    legacy: bool = False

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @classmethod
    def parse(cls, tools: list | None, tool_choice, parallel: bool | None) -> ToolSpec | None:
        """None when the request has no tools (and no tool_choice that needs one)."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ParamError("tool_choice", "tool_choice needs tools")
            return None
        parsed = []
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise ParamError(f"tools.{i}", 'each tool is {"type": "function", "function": '
                                '{"name": ..., "parameters": {...}}}')
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ParamError(f"tools.{i}.function.name", "a tool name is 1-64 letters, "
                                "digits, '_' or '-'")
            params = fn.get("parameters", _EMPTY_PARAMETERS)
            if not isinstance(params, dict):
                raise ParamError(f"tools.{i}.function.parameters", "parameters must be a JSON "
                                "schema object")
            desc = fn.get("description") or ""
            if not isinstance(desc, str):
                raise ParamError(f"tools.{i}.function.description", "description must be text")
            parsed.append(Tool(name, desc, params))
        if len({t.name for t in parsed}) != len(parsed):
            raise ParamError("tools", "tool names must be unique")
        parallel = True if parallel is None else parallel
        if tool_choice in (None, "auto"):
            return cls(tuple(parsed), "auto", parallel=parallel)
        if tool_choice in ("none", "required"):
            return cls(tuple(parsed), tool_choice, parallel=parallel)
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" \
                or not isinstance(name, str):
            raise ParamError("tool_choice", 'tool_choice is "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}')
        if name not in {t.name for t in parsed}:
            raise ParamError("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        return cls(tuple(parsed), "named", name, parallel)

    # ---- the prompt ------------------------------------------------------------------------
    def preamble(self) -> str:
        listed = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                       "parameters": t.parameters}, ensure_ascii=False)
                           for t in self.tools if self.mode != "named" or t.name == self.name)
        how = ("You must call the tool " + repr(self.name) if self.mode == "named" else
               "You must call one or more tools" if self.mode == "required" else
               "To call tools")
        return (f"You have access to these tools:\n{listed}\n{how}, answer with only a JSON "
                'object: {"tool_calls": [{"name": <tool name>, "arguments": {<arguments>}}]}. '
                "Tool results come back in messages from the tool.")

    def schema(self) -> dict:
        """The grammar for a forced call: the call object, arguments per the tool's schema."""
        chosen = [t for t in self.tools if self.mode != "named" or t.name == self.name]
        items = [{"type": "object", "properties": {"name": {"const": t.name},
                                                   "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in chosen]
        array: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1
                                 else {"anyOf": items}, "minItems": 1}
        if self.mode == "named" or not self.parallel:
            array["maxItems"] = 1
        # fixed separators: a call is compact JSON, whitespace cannot run on forever
        return {"type": "object", "properties": {"tool_calls": array},
                "required": ["tool_calls"], "additionalProperties": False,
                "x-guidance": {"whitespace_flexible": False}}


def render_messages(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    """The conversation as plain role/content messages for the chat template: the tools'
    preamble in the system message, earlier calls as the call object, tool results as text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            body = {"tool_calls": [{"name": c["function"]["name"],
                                    "arguments": _arguments(c["function"].get("arguments"))}
                                   for c in calls]}
            text = (m.get("content") or "") + json.dumps(body, ensure_ascii=False)
            out.append({**_plain(m), "content": text})
        elif m["role"] == "tool":
            call = m.get("tool_call_id") or ""
            out.append({**_plain(m), "content": f"[tool result {call}] {m['content']}".strip()})
        else:
            out.append(_plain(m))
    if spec is not None and spec.mode != "none":
        pre = spec.preamble()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{pre}"}
        else:
            out.insert(0, {"role": "system", "content": pre})
    return out


def _plain(m: dict) -> dict:
    return {k: v for k, v in m.items() if k in ("role", "content", "name")}


def _arguments(raw) -> Any:
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw or "{}")
    except (TypeError, ValueError):
        raise ParamError("messages", f"tool_calls arguments are not JSON: {raw!r}") from None


def check_message(m, i: int) -> None:
    """An assistant message's tool_calls and a tool message's id, in OpenAI's shapes."""
    calls = m.tool_calls
    if calls is not None:
        if m.role != "assistant":
            raise ParamError(f"messages.{i}.tool_calls", "only assistant messages carry "
                            "tool_calls")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ParamError(f"messages.{i}.tool_calls.{j}", 'a tool call is {"id": ..., '
                                '"type": "function", "function": {"name": ..., "arguments": '
                                '"<JSON>"}}')
            _arguments(fn.get("arguments"))
    if m.tool_call_id is not None and m.role != "tool":
        raise ParamError(f"messages.{i}.tool_call_id", "only tool messages carry tool_call_id")


# ---- OpenAI's deprecated function calling ------------------------------------------------------
# ``functions`` / ``function_call`` on the request, ``function_call`` on an assistant message and
# the ``function`` role are the same calls as ``tools`` in an older shape (one call a turn, no
# call ids), which clients written before tools still send: they are taken as tools and
# answered in their own shape (``message.function_call``, ``finish_reason: function_call``).
def _legacy_tools(functions: list | None, function_call) -> tuple[list | None, Any]:
    """``functions`` and ``function_call`` as ``tools`` and ``tool_choice``."""
    tools = None
    if functions is not None:
        for i, f in enumerate(functions):
            if not isinstance(f, dict):
                raise ParamError(f"functions.{i}", 'each function is {"name": ..., '
                                '"description": ..., "parameters": {...}}')
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is None or function_call in ("none", "auto"):
        return tools, function_call
    name = function_call.get("name") if isinstance(function_call, dict) else None
    if not isinstance(name, str) or set(function_call) != {"name"}:
        raise ParamError("function_call", 'function_call is "none", "auto" or {"name": ...}')
    return tools, {"type": "function", "function": {"name": name}}


def _legacy_param(param: str) -> str:
    """A ``tools`` error's param in the names the request used (``functions.N.name``)."""
    param = re.sub(r"^tools\.(\d+)\.function\b", r"functions.\1", param)
    return {"tools": "functions", "tool_choice": "function_call"}.get(param, param)


def _message(m, i: int) -> dict:
    """One message as ``render_messages`` takes it: a deprecated ``function_call`` as a turn's
    one tool call, a ``function`` message as a tool result (named by the function)."""
    calls, role, call_id = m.tool_calls, m.role, m.tool_call_id
    if m.function_call is not None:
        fc = m.function_call
        if m.role != "assistant" or calls is not None:
            raise ParamError(f"messages.{i}.function_call", "only an assistant message without "
                            "tool_calls carries function_call")
        if not isinstance(fc.get("name"), str) or not isinstance(fc.get("arguments", ""), str):
            raise ParamError(f"messages.{i}.function_call", 'function_call is {"name": ..., '
                            '"arguments": "<JSON>"}')
        _arguments(fc.get("arguments"))
        calls = [{"id": "", "type": "function", "function": {
            "name": fc["name"], "arguments": fc.get("arguments") or "{}"}}]
    if role == "function":
        if not m.name:
            raise ParamError(f"messages.{i}.name", "a function message names its function")
        role, call_id = "tool", m.name
    return {"role": role, "content": m.text(), **({"name": m.name} if m.name else {}),
            "tool_calls": calls, "tool_call_id": call_id}


def conversation(req) -> tuple[list[dict], ToolSpec | None]:
    """A chat request's (or ``/tokenize``'s) messages, checked and rendered with its tools for
    the chat template, and the tools' spec (None: no tools). ``ParamError`` names the field."""
    tools, choice, legacy = req.tools, req.tool_choice, False
    if req.functions is not None or req.function_call is not None:
        if req.tools is not None or req.tool_choice is not None:
            raise ParamError("functions", "send tools and tool_choice, or the deprecated "
                            "functions and function_call, not both")
        if req.parallel_tool_calls is not None:  # the deprecated shape holds one call
            raise ParamError("parallel_tool_calls", "parallel_tool_calls goes with tools; "
                            "functions make one call a turn")
        tools, choice = _legacy_tools(req.functions, req.function_call)
        legacy = True
    try:
        spec = ToolSpec.parse(tools, choice, False if legacy else req.parallel_tool_calls)
    except ParamError as exc:
        if legacy:
            raise ParamError(_legacy_param(exc.param), str(exc), exc.code) from None
        raise
    if spec is not None and legacy:
        spec = dataclasses.replace(spec, legacy=True)
    for i, m in enumerate(req.messages):
        check_message(m, i)
    return render_messages([_message(m, i) for i, m in enumerate(req.messages)], spec), spec


def legacy_delta(tool_calls: list[dict]) -> dict | None:
    """A stream's ``tool_calls`` delta as the deprecated ``function_call`` delta (the first
    call's: a legacy request makes one)."""
    first = [d["function"] for d in tool_calls if d.get("index") == 0]
    return first[0] if first else None


# ---- reading the model's calls ----------------------------------------------------------------
@dataclass
class CallSpan:
    name: str | None = None  # once its string is complete
    args_start: int | None = None  # where the arguments value starts in the text
    args_end: int | None = None  # where it ends, once complete


def scan(text: str) -> tuple[list[CallSpan], bool]:
    """The calls in a (possibly partial) ``{"tool_calls": [...]}`` text, and whether the text
    still looks like one. A small JSON scanner rather than a partial-JSON library: what is
    streamed is the raw text of each ``arguments`` value, which a parser that rebuilds values
    cannot give back byte for byte."""
    calls: list[CallSpan] = []
    stack: list[str] = []  # '{' or '['
    key: str | None = None  # the last key read in the current object
    path: list[str | None] = []  # the key each open container hangs from
    i, n = 0, len(text)
    expect_key = False
    while i < n:
        ch = text[i]
        if ch in " \t\r\n,:":
            if ch == "," and stack and stack[-1] == "{":
                expect_key = True
            i += 1
            continue
        depth = len(stack)
        in_calls_array = depth == 2 and stack[-1] == "[" and path[-1] == "tool_calls"
        in_call = depth == 3 and stack[-1] == "{" and path[-2] == "tool_calls"
        if ch == '"':
            j, s = _string(text, i)
            if j is None:
                return calls, True  # an unfinished string
            if stack and stack[-1] == "{" and expect_key:
                key, expect_key = s, False
                if depth == 1 and key != "tool_calls":
                    return calls, False
            elif in_call and key == "name":
                calls[-1].name = s
            elif in_call and key == "arguments":
                calls[-1].args_start, calls[-1].args_end = i, j
            i = j
            continue
        if ch in "{[":
            if depth == 0 and ch != "{":
                return calls, False
            if in_calls_array:
                calls.append(CallSpan())
            if in_call and key == "arguments":
                calls[-1].args_start = i
            path.append(key if stack and stack[-1] == "{" else None)
            stack.append(ch)
            expect_key, key = ch == "{", None
            i += 1
            continue
        if ch in "}]":
            if not stack or {"}": "{", "]": "["}[ch] != stack[-1]:
                return calls, False
            stack.pop()
            key = path.pop()
            if len(stack) == 3 and stack[-1] == "{" and key == "arguments" and calls:
                calls[-1].args_end = i + 1
            i += 1
            if not stack:
                return calls, text[i:].strip() == ""
            continue
        if depth == 0:
            return calls, False
        m = _SCALAR.match(text, i)  # a number, true, false or null
        if m is None:  # a literal cut short is still fine
            return calls, any(w.startswith(text[i:]) for w in ("true", "false", "null"))
        if in_call and key == "arguments":
            calls[-1].args_start, calls[-1].args_end = i, m.end()
        i = m.end()
    return calls, True


def _string(text: str, i: int) -> tuple[int | None, str]:
    """(index after the closing quote, the decoded string), or (None, "") if unfinished."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            try:
                return j + 1, json.loads(text[i:j + 1])
            except ValueError:
                return j + 1, ""
        j += 1
    return None, ""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the raw JSON text the model wrote

    def body(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse(text: str, spec: ToolSpec) -> list[ToolCall] | None:
    """The calls in a finished answer, or None when it is not a (valid) call object."""
    try:
        whole = json.loads(text)
    except ValueError:
        return None
    calls, _ = scan(text.strip())
    if not isinstance(whole, dict) or set(whole) != {"tool_calls"} or not calls:
        return None
    stripped = text.strip()
    out = []
    for c in calls:
        if c.name not in spec.names or c.args_start is None or c.args_end is None:
            return None
        args = stripped[c.args_start:c.args_end]
        if not isinstance(json.loads(args), dict):
            return None
        out.append(ToolCall(new_call_id(), c.name, args))
    return out


def cut_short(text: str) -> list[ToolCall]:
    """The calls of a forced answer that ended before its object closed (``max_tokens``): each
    named call with the arguments text written so far, as OpenAI returns a call cut short (and
    as the same answer streams), rather than the call object leaking as content."""
    stream = ToolStream()
    stream.feed(text)
    return stream.calls()


@dataclass
class ToolStream:
    """Turns a forced call's text, as it is generated, into OpenAI's ``tool_calls`` deltas."""

    text: str = ""
    ids: list[str] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # argument characters sent, per call

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        stripped = self.text.lstrip()
        calls, _ = scan(stripped)
        out = []
        for idx, c in enumerate(calls):
            if c.name is None:
                break
            if idx == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                out.append({"index": idx, "id": self.ids[idx], "type": "function",
                            "function": {"name": c.name, "arguments": ""}})
            if c.args_start is None:
                continue
            end = c.args_end if c.args_end is not None else len(stripped)
            fragment = stripped[c.args_start + self.sent[idx]:end]
            if fragment:
                self.sent[idx] += len(fragment)
                out.append({"index": idx, "function": {"arguments": fragment}})
        return out

    def calls(self) -> list[ToolCall]:
        """The calls streamed so far, each with the argument text sent."""
        stripped = self.text.lstrip()
        spans, _ = scan(stripped)
        return [ToolCall(self.ids[i], c.name,
                         stripped[c.args_start:c.args_start + self.sent[i]]
                         if c.args_start is not None else "")
                for i, c in enumerate(spans[:len(self.ids)])]
