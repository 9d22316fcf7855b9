"""Chat templates (Jinja, as shipped with the checkpoint) rendered the way HF renders them."""

from __future__ import annotations

import json
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise TemplateError(message)


# the variables a render sets itself: ``chat_template_kwargs`` cannot replace them
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "continue_final_message",
                                "bos_token", "eos_token"})


def conflict(add_generation_prompt: bool, continue_final_message: bool,
             variables: dict[str, Any]) -> tuple[str, str] | None:
    """The request field at fault and why, when these render options cannot go together
    (the gateway's 400 and ``ChatTemplate.render``'s ValueError say the same)."""
    if continue_final_message and add_generation_prompt:
        return ("continue_final_message", "continue_final_message needs "
                "add_generation_prompt: false (they cannot both be true)")
    taken = sorted(RESERVED_VARIABLES & variables.keys())
    if taken:
        return ("chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(taken)}: "
                "the request's own fields set them")
    return None


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                  indent=indent)
        self.source = source
        self._template = env.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **extra: Any) -> str:
        """The prompt text. ``continue_final_message``: the text ends with the last message's
        content, left open for the model to continue (HF's rule: everything the template adds
        after that content, such as an end-of-turn token, is cut). ``extra``: more template
        variables (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``). A template that
        refuses the messages (``raise_exception``, an undefined name) raises ValueError."""
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] needs 'role' and 'content'")
        bad = conflict(add_generation_prompt, continue_final_message, extra)
        if bad is not None:
            raise ValueError(bad[1])
        try:
            text = self._template.render(
                **extra, messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from None
        if not continue_final_message:
            return text
        final = messages[-1]["content"] if messages else ""
        if not isinstance(final, str) or not final.strip():
            raise ValueError("continue_final_message needs a last message with text to continue")
        at = text.rfind(final.strip())
        if at < 0:
            raise ValueError("continue_final_message: the last message's content is not in the "
                             "rendered chat (the template rewrites it)")
        # the template kept the message's own trailing whitespace: keep it; else cut after
        # the stripped content
        kept = final.lstrip()
        return text[:at + (len(kept) if text[at:at + len(kept)] == kept else
                           len(final.strip()))]
