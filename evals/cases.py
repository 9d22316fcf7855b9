"""Eval cases and their scorers (``evals.runner`` sends them, ``evals.compare`` judges runs).

A case, in YAML (a list, or ``{"defaults": {"params": {...}, "tags": [...]}, "cases": [...]}``,
where a case's own params win over the suite's) or JSONL (one object per line)::

    - id: capital-france
      messages: [{role: user, content: "What is the capital of France?"}]   # or prompt: "..."
      params: {temperature: 0, max_tokens: 16}       # any request field, sent as is
      weight: 1.0
      tags: [geography]
      repeat: 1                                      # send it this many times (see consistent)
      expect:                                        # every scorer listed must pass
        contains_any: ["Paris"]                      # or contains_all: [...]
        exact: "Paris"                               # the whole output, stripped
        regex: "^[A-Z]"                              # re.search
        json: true                                   # the output parses as JSON
        json_schema: {type: object, required: [name]}
        finish_reason: stop
        not_contains: ["As an AI"]
        min_length: 1                                # characters
        max_length: 200
        consistent: true                             # every repeat gave the same choices
        n_choices: 3                                 # the response has this many choices
        prompt_tokens: 37                            # usage.prompt_tokens (the chat template)

A case with ``messages`` goes to ``/v1/chat/completions``, one with ``prompt`` to
``/v1/completions``; ``params`` may say ``stream: true`` (the runner then reads the SSE stream).
Text scorers look at the first choice of the first attempt.

``score`` returns a ``Score``: the fraction of the case's checks that passed, whether all
did, and a detail naming each failure, so a failing case says why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCORERS = ("exact", "contains_any", "contains_all", "regex", "json", "json_schema",
           "finish_reason", "not_contains", "min_length", "max_length", "consistent",
           "n_choices", "prompt_tokens")
FIELDS = {"id", "messages", "prompt", "params", "expect", "weight", "tags", "repeat"}


class CaseError(ValueError):
    pass


@dataclass(frozen=True)
class Case:
    id: str
    messages: list[dict] | None = None
    prompt: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    tags: tuple[str, ...] = ()
    repeat: int = 1

    @classmethod
    def from_dict(cls, d: dict, where: str = "") -> Case:
        if not isinstance(d, dict):
            raise CaseError(f"{where}: a case must be a mapping, not {type(d).__name__}")
        unknown = set(d) - FIELDS
        if unknown:
            raise CaseError(f"{where}: unknown case fields {sorted(unknown)}")
        if not d.get("id"):
            raise CaseError(f"{where}: a case needs an id")
        if (d.get("messages") is None) == (d.get("prompt") is None):
            raise CaseError(f"{where} ({d['id']}): give exactly one of messages or prompt")
        expect = d.get("expect") or {}
        bad = set(expect) - set(SCORERS)
        if bad:
            raise CaseError(f"{where} ({d['id']}): unknown scorers {sorted(bad)}; "
                            f"known: {', '.join(SCORERS)}")
        if "regex" in expect:
            try:
                re.compile(expect["regex"])
            except re.error as exc:
                raise CaseError(f"{where} ({d['id']}): bad regex: {exc}") from None
        weight = float(d.get("weight", 1.0))
        if weight < 0:
            raise CaseError(f"{where} ({d['id']}): weight must be >= 0")
        repeat = d.get("repeat", 1)
        if not isinstance(repeat, int) or repeat < 1:
            raise CaseError(f"{where} ({d['id']}): repeat must be a positive integer")
        if expect.get("consistent") and repeat < 2:
            raise CaseError(f"{where} ({d['id']}): consistent needs repeat >= 2")
        return cls(id=str(d["id"]), messages=d.get("messages"), prompt=d.get("prompt"),
                   params=dict(d.get("params") or {}), expect=dict(expect), weight=weight,
                   tags=tuple(d.get("tags") or ()), repeat=repeat)


def load_cases(path: str | Path) -> list[Case]:
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise CaseError(f"{path}:{n}: {exc}") from None
    else:
        import yaml

        data = yaml.safe_load(text)
        defaults = {}
        if isinstance(data, dict):
            defaults = data.get("defaults") or {}
            if set(defaults) - {"params", "tags"}:
                raise CaseError(f"{path}: suite defaults may set params and tags only")
            data = data.get("cases")
        if not isinstance(data, list):
            raise CaseError(f"{path}: expected a list of cases")
        rows = [(f"{path}[{i}]", _with_defaults(d, defaults)) for i, d in enumerate(data)]
    cases = [Case.from_dict(d, where) for where, d in rows]
    ids = [c.id for c in cases]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise CaseError(f"{path}: duplicate case ids {sorted(dup)}")
    return cases


def _with_defaults(case, defaults: dict):
    """Suite-level ``defaults``: params a case does not set, tags added to every case."""
    if not defaults or not isinstance(case, dict):
        return case
    return {**case, "params": {**(defaults.get("params") or {}), **(case.get("params") or {})},
            "tags": [*(case.get("tags") or []), *(defaults.get("tags") or [])]}


@dataclass(frozen=True)
class Score:
    score: float  # the fraction of checks passed
    passed: bool
    detail: str


VARIES = "differ from the first"  # in a result's detail: its attempts did not agree


def divergence(a: list[str], b: list[str]) -> str:
    """Where two attempts' choices first part: the choice, the character, both texts there."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            at = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v),
                      min(len(x), len(y)))
            return (f"first diverges in choice {i} at character {at}: {x[at:at + 24]!r} vs "
                    f"{y[at:at + 24]!r} (after {x[max(0, at - 24):at]!r})")
    return f"has {len(b)} choices, not {len(a)}"


def score(case: Case, output: str, finish_reason: str | None, *,
          choices: list[str] | None = None, repeats: list[list[str]] | None = None,
          prompt_tokens: int | None = None) -> Score:
    """Run each of the case's checks on one output (``choices``: every choice's text of the
    first attempt; ``repeats``: the choices of each later attempt)."""
    failures, checks = [], 0

    def check(ok: bool, why: str) -> None:
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(why)

    e = case.expect
    if "exact" in e:
        check(output.strip() == str(e["exact"]).strip(), f"output is not exactly {e['exact']!r}")
    if "contains_any" in e:
        check(any(s in output for s in e["contains_any"]),
              f"output contains none of {e['contains_any']}")
    if "contains_all" in e:
        missing = [s for s in e["contains_all"] if s not in output]
        check(not missing, f"output lacks {missing}")
    if "regex" in e:
        check(re.search(e["regex"], output) is not None, f"output does not match /{e['regex']}/")
    parsed, parse_error = None, None
    if "json" in e or "json_schema" in e:
        try:
            parsed = json.loads(output)
        except json.JSONDecodeError as exc:
            parse_error = str(exc)
    if e.get("json"):
        check(parse_error is None, f"output is not JSON ({parse_error})")
    if "json_schema" in e:
        import jsonschema

        if parse_error is not None:
            check(False, f"output is not JSON ({parse_error})")
        else:
            try:
                jsonschema.validate(parsed, e["json_schema"])
                check(True, "")
            except jsonschema.ValidationError as exc:
                check(False, f"JSON does not match the schema: {exc.message}")
    if "finish_reason" in e:
        check(finish_reason == e["finish_reason"],
              f"finish_reason is {finish_reason!r}, not {e['finish_reason']!r}")
    if "not_contains" in e:
        found = [s for s in e["not_contains"] if s in output]
        check(not found, f"output contains {found}")
    if "min_length" in e:
        check(len(output) >= int(e["min_length"]),
              f"output has {len(output)} characters, fewer than {e['min_length']}")
    if "max_length" in e:
        check(len(output) <= int(e["max_length"]),
              f"output has {len(output)} characters, more than {e['max_length']}")
    if "n_choices" in e:
        got = len(choices) if choices is not None else 1
        check(got == int(e["n_choices"]), f"{got} choices, not {e['n_choices']}")
    if e.get("consistent"):
        first = choices if choices is not None else [output]
        differ = [i + 1 for i, r in enumerate(repeats or []) if r != first]
        why = "no repeats to compare"
        if differ:
            why = (f"attempts {differ} {VARIES}; attempt {differ[0]} "
                   + divergence(first, (repeats or [])[differ[0] - 1]))
        check(bool(repeats) and not differ, why)
    if "prompt_tokens" in e:
        check(prompt_tokens == int(e["prompt_tokens"]),
              f"prompt has {prompt_tokens} tokens, not {e['prompt_tokens']}")
    if not checks:
        return Score(1.0, True, "no checks")
    return Score((checks - len(failures)) / checks, not failures,
                 "; ".join(failures) or "all checks passed")
