"""An answer's shape: chat completions or completions, over one request session's choices.

``ChatFormat`` and ``CompletionFormat`` hold everything that differs between the two
endpoints (the object names, a choice's body, the logprobs object, where vLLM's extra fields
go); the serving code drives either the same way, for a JSON body or for stream chunks.
"""

from __future__ import annotations

import itertools

from gateway.session import Choice, Part
from gateway.tools import ToolCall, cut_short, legacy_delta, parse

MIN_LOGPROB = -9999.0  # what a masked token (-inf) is reported as, like vLLM: JSON has no -inf


def finite_logprob(x: float) -> float:
    return x if x >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares False: reported as the floor


def usage(prompt_len: int, choices: list[Choice]) -> dict:
    completion = sum(c.stream.emitted_tokens for c in choices)
    return {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion}


def echoed(c: Choice) -> tuple[str, list]:
    """An echoing choice's prompt text and (with logprobs) its prompt entries."""
    return c.echo or "", (c.prompt_logprobs or []) if c.logprobs is not None else []


def new_logprobs(c: Choice) -> list:
    """Entries for tokens emitted since the last call (a stop string's tokens never are)."""
    if c.logprobs is None:
        return []
    upto = c.stream.emitted_tokens
    entries = c.logprobs[c.logprobs_sent:upto]
    c.logprobs_sent = max(c.logprobs_sent, upto)
    return entries


def tool_calls(c: Choice, text: str) -> list[ToolCall]:
    """A finished choice's tool calls (none: it answered in text); notes them on it."""
    if c.tools is None or c.final_state != "FINISHED":
        return []
    calls = parse(text, c.tools) or []
    if not calls and c.tools.forced and c.finish_reason == "length":
        calls = cut_short(text)
    if calls and c.tools.legacy:  # the deprecated shape holds one call
        calls = calls[:1]
    if calls:
        c.calls, c.called = calls, [x.name for x in calls]
        if c.finish_reason == "stop":
            c.finish_reason = "function_call" if c.tools.legacy else "tool_calls"
    return calls


class Format:
    """What both endpoints share; the subclasses fill in the rest."""

    obj = ""  # the JSON body's object name
    chunk_obj = ""  # a stream chunk's
    id_prefix = ""
    finish_text: str | None = None  # a stream's closing chunk's text

    def __init__(self, tokenizer, model: str) -> None:
        self.tokenizer, self.model = tokenizer, model

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def logprobs(self, entries: list, c: Choice | None = None) -> dict:
        raise NotImplementedError

    def vllm_prompt_logprobs(self, entries: list | None) -> list:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} for the token itself and its alternatives (rank: its place among the
        alternatives, None when it is not among them)."""
        out: list = []
        for tok, lp, top in entries or []:
            if lp is None:
                out.append(None)
                continue
            ranked = {i: (r, x) for r, (i, x) in enumerate(top or (), start=1)}
            item = {str(tok): {"logprob": finite_logprob(lp), "rank": ranked.get(tok, (None,))[0],
                               "decoded_token": self.token_text(tok)}}
            for i, (r, x) in ranked.items():
                item.setdefault(str(i), {"logprob": finite_logprob(x), "rank": r,
                                         "decoded_token": self.token_text(i)})
            out.append(item)
        return out

    # ---- a JSON body ---------------------------------------------------------------------
    def body(self, req, rid: str, created: int, parts: list[Part], texts: list[str],
             prompt_tokens: int) -> dict:
        """The whole answer; ``texts`` per choice index, echoed prompts put in front here."""
        choices = [c for part in parts for c in part.choices]
        lead = {c.index: part.choices[0] for part in parts for c in part.choices}
        out = []
        for c in choices:
            head, head_lps = echoed(c)
            text = texts[c.index] = head + texts[c.index]
            lp = self.logprobs(head_lps + new_logprobs(c), c) if c.logprobs is not None \
                else None
            item = self.choice_body(c, text, lp, req, lead[c.index])
            if req.return_token_ids:
                item["token_ids"] = [] if c.scoring else c.token_ids
            out.append(item)
        return {"id": rid, "object": self.obj, "created": created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, choices)}

    def choice_body(self, c: Choice, text: str, lp: dict | None, req, lead: Choice) -> dict:
        raise NotImplementedError

    # ---- a stream --------------------------------------------------------------------------
    def opening(self, choices: list[Choice]) -> list[tuple[Choice, dict]]:
        """(choice, delta fields) sent before any token: none, or chat's role."""
        return []

    def chunk(self, rid: str, created: int, c: Choice, text: str | None, finish: str | None,
              entries: list | None = None, extra: dict | None = None,
              calls: list | None = None) -> dict:
        """One choice's chunk, with the logprobs of ``entries`` (by default those of the
        tokens emitted since its last chunk); ``extra``: more fields of chat's delta (its
        role)."""
        if entries is None:
            entries = new_logprobs(c)
        lp = self.logprobs(entries, c) if entries else None
        body = self.chunk_body(c, text, finish, lp, extra, calls)
        payload = {"id": rid, "object": self.chunk_obj, "created": created,
                   "model": self.model, "choices": [body]}
        if c.return_ids:  # vLLM's shape: the prompt's ids with a choice's first chunk
            if c.ids_sent < 0:
                self.prompt_ids_home(payload, body)["prompt_token_ids"] = c.prompt
            body["token_ids"] = c.new_ids()
        return payload

    def chunk_body(self, c: Choice, text: str | None, finish: str | None, lp: dict | None,
                   extra: dict | None, calls: list | None) -> dict:
        raise NotImplementedError

    def prompt_ids_home(self, payload: dict, body: dict) -> dict:
        """Where vLLM puts a stream's prompt_token_ids."""
        return body

    @staticmethod
    def error(c: Choice) -> dict:
        """A choice that failed mid-stream: an error chunk (the status was sent)."""
        code = {"timeout": "timeout", "rejected": "rejected"}.get(c.finish_reason,
                                                                   "generation_failed")
        return {"error": {"message": c.error, "type": "server_error", "param": None,
                          "code": code}}


class ChatFormat(Format):
    obj, chunk_obj, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def logprobs(self, entries: list, c: Choice | None = None) -> dict:
        """OpenAI's chat logprobs object: a ``content`` list."""
        t, v = self.token_text, finite_logprob
        return {"content": [
            {"token": t(tok), "logprob": v(lp), "bytes": list(t(tok).encode()),
             "top_logprobs": [{"token": t(i), "logprob": v(x), "bytes": list(t(i).encode())}
                              for i, x in top]}
            for tok, lp, top in entries]}

    def body(self, req, rid, created, parts, texts, prompt_tokens) -> dict:
        out = super().body(req, rid, created, parts, texts, prompt_tokens)
        choices = parts[0].choices if parts else []
        if req.prompt_logprobs is not None and choices:  # vLLM's chat: top level
            out["prompt_logprobs"] = self.vllm_prompt_logprobs(choices[0].prompt_logprobs)
        if req.return_token_ids:
            out["prompt_token_ids"] = parts[0].prompt
        return out

    def choice_body(self, c, text, lp, req, lead) -> dict:
        if c.calls or (c.tools is not None and c.tools.forced):
            message: dict = {"role": "assistant", "content": None}
            if not c.tools.legacy:
                message["tool_calls"] = [x.body() for x in c.calls]
            elif c.calls:  # the deprecated shape: the one call, no id
                message["function_call"] = c.calls[0].body()["function"]
        else:
            message = {"role": "assistant", "content": text}
        return {"index": c.index, "message": message, "logprobs": lp,
                "finish_reason": c.finish_reason}

    def opening(self, choices):
        return [(c, {"role": "assistant"}) for c in choices]

    def chunk_body(self, c, text, finish, lp, extra, calls) -> dict:
        delta: dict = dict(extra or {})
        if calls and c.tools is not None and c.tools.legacy:
            if (call := legacy_delta(calls)) is not None:
                delta["function_call"] = call
        elif calls:
            delta["tool_calls"] = calls
        elif text is not None:
            delta["content"] = text
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def prompt_ids_home(self, payload, body) -> dict:
        return payload


class CompletionFormat(Format):
    obj = chunk_obj = "text_completion"
    id_prefix = "cmpl-"
    finish_text = ""

    def logprobs(self, entries: list, c: Choice | None = None) -> dict:
        """OpenAI's completions logprobs: parallel lists with ``text_offset``, where each
        token's text starts in the choice's text, counted from the texts of the tokens before
        it, an echoed prompt's included, as vLLM counts them (``c`` carries the count across a
        stream's chunks)."""
        t, v = self.token_text, finite_logprob
        tokens = [t(tok) for tok, _, _ in entries]
        offset = c.text_offset if c is not None else 0
        offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=offset)) \
            if tokens else []
        if c is not None:
            c.text_offset = offset + sum(map(len, tokens))
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else v(lp) for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {t(i): v(x) for i, x in top}
                                 for _, _, top in entries],  # an echoed first token: None
                "text_offset": offsets}

    def choice_body(self, c, text, lp, req, lead) -> dict:
        item = {"index": c.index, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason}
        if req.return_token_ids:
            item["prompt_token_ids"] = c.prompt
        if req.prompt_logprobs is not None:  # vLLM's completions: per choice
            item["prompt_logprobs"] = self.vllm_prompt_logprobs(lead.prompt_logprobs)
        return item

    def chunk_body(self, c, text, finish, lp, extra, calls) -> dict:
        return {"index": c.index, "text": text or "", "logprobs": lp, "finish_reason": finish}
