"""Eval case format and every scorer, on passing and failing outputs."""

from __future__ import annotations

import pytest

from evals.cases import Case, CaseError, load_cases, score


def case(**expect) -> Case:
    return Case.from_dict({"id": "c", "prompt": "x", "expect": expect})


@pytest.mark.parametrize("expect,good,bad", [
    ({"exact": "Paris"}, " Paris\n", "Paris, France"),
    ({"contains_any": ["Paris", "paris"]}, "It is paris.", "It is Lyon."),
    ({"contains_all": ["a", "b"]}, "a and b", "only a"),
    ({"regex": r"^\d{4}$"}, "1789", "year 1789"),
    ({"json": True}, '{"a": 1}', "{a: 1}"),
    ({"json_schema": {"type": "object", "required": ["name"]}}, '{"name": "x"}', '{"n": 1}'),
    ({"not_contains": ["sorry"]}, "Sure.", "I am sorry"),
    ({"min_length": 3}, "abc", "ab"),
    ({"max_length": 3}, "abc", "abcd"),
])
def test_each_scorer_passes_and_fails(expect, good, bad):
    assert score(case(**expect), good, "stop").passed
    s = score(case(**expect), bad, "stop")
    assert not s.passed and s.score == 0.0 and s.detail


def test_finish_reason_and_partial_scores():
    c = case(contains_any=["Paris"], finish_reason="stop", max_length=10)
    assert score(c, "Paris", "stop").passed
    s = score(c, "Paris is a big city", "length")
    assert not s.passed and s.score == pytest.approx(1 / 3)
    assert "finish_reason is 'length'" in s.detail and "more than 10" in s.detail
    assert score(case(json_schema={"type": "object"}), "not json", "stop").detail.startswith(
        "output is not JSON")


def test_loading_yaml_and_jsonl_and_clear_errors(tmp_path):
    y = tmp_path / "s.yaml"
    y.write_text("cases:\n  - id: a\n    messages: [{role: user, content: hi}]\n"
                 "    params: {temperature: 0}\n    weight: 2\n    tags: [t]\n"
                 "    expect: {contains_any: [hello]}\n")
    (c,) = load_cases(y)
    assert c.messages[0]["content"] == "hi" and c.weight == 2 and c.tags == ("t",)
    j = tmp_path / "s.jsonl"
    j.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    assert [c.id for c in load_cases(j)] == ["a", "b"]
    for text, message in (('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n',
                           "duplicate"),
                          ('{"id": "a"}\n', "exactly one of messages or prompt"),
                          ('{"id": "a", "prompt": "x", "expect": {"fuzzy": 1}}\n',
                           "unknown scorers"),
                          ('{"id": "a", "prompt": "x", "expect": {"regex": "("}}\n',
                           "bad regex"),
                          ('{"id": "a", "prompt": "x"\n', "s.jsonl:1")):
        j.write_text(text)
        with pytest.raises(CaseError, match=message):
            load_cases(j)


def test_repeat_choices_and_prompt_token_scorers():
    c = Case.from_dict({"id": "r", "prompt": "x", "repeat": 3,
                        "expect": {"consistent": True, "n_choices": 2, "prompt_tokens": 5}})
    ok = score(c, "a", "stop", choices=["a", "b"], repeats=[["a", "b"], ["a", "b"]],
               prompt_tokens=5)
    assert ok.passed, ok.detail
    bad = score(c, "a", "stop", choices=["a"], repeats=[["a"], ["a!"]], prompt_tokens=6)
    assert not bad.passed and bad.score == 0.0
    assert "1 choices, not 2" in bad.detail and "attempts [2] differ" in bad.detail
    assert "prompt has 6 tokens, not 5" in bad.detail
    with pytest.raises(CaseError, match="consistent needs repeat >= 2"):
        Case.from_dict({"id": "r", "prompt": "x", "expect": {"consistent": True}})
    with pytest.raises(CaseError, match="repeat must be a positive integer"):
        Case.from_dict({"id": "r", "prompt": "x", "repeat": 0})


def test_suite_defaults_fill_params_and_add_tags(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("defaults: {params: {temperature: 0, max_tokens: 8}, tags: [suite]}\n"
                 "cases:\n- {id: a, prompt: x, params: {max_tokens: 2}, tags: [t]}\n"
                 "- {id: b, prompt: y}\n")
    a, b = load_cases(p)
    assert a.params == {"temperature": 0, "max_tokens": 2} and a.tags == ("t", "suite")
    assert b.params == {"temperature": 0, "max_tokens": 8} and b.tags == ("suite",)
    p.write_text("defaults: {expect: {json: true}}\ncases: []\n")
    with pytest.raises(CaseError, match="defaults may set params and tags only"):
        load_cases(p)


@pytest.mark.parametrize("name", ["protocol", "smoke-qa", "determinism"])
def test_builtin_suites_load(name):
    from evals.runner import load_suite

    suite, cases = load_suite(name)
    assert suite == name and cases
    if name == "smoke-qa":
        assert len(cases) >= 40
        assert all(c.params.get("temperature") == 0 for c in cases)
    if name == "determinism":
        assert all(c.repeat >= 2 and c.expect.get("consistent") for c in cases)


def test_a_case_whose_attempts_differ_says_where_they_part():
    from evals.cases import Case, score

    case = Case(id="c", prompt="p", repeat=2, expect={"consistent": True})
    s = score(case, "The sea is wide and blue", "stop", choices=["The sea is wide and blue"],
              repeats=[["The sea is wide and grey"]])
    assert not s.passed
    assert "attempt 1 first diverges in choice 0 at character 20" in s.detail
    assert "'blue' vs 'grey'" in s.detail


def test_the_across_configs_report_names_each_config_and_the_first_divergence():
    from evals.runner import CaseResult, RunSummary, across_configs

    def run(name, outputs, detail="all checks passed"):
        return RunSummary(f"run-{name}", "determinism", f"id-{name}", name, [
            CaseResult(cid, "t", 1.0, True, detail, [], out, "stop", 1.0)
            for cid, out in outputs.items()], 2)

    a = run("fp32", {"x": "one two three", "y": "same"})
    b = run("bf16", {"x": "one two four", "y": "same"})
    c = run("chunks", {"x": "one two three", "y": "same"},
            detail="attempts [1] differ from the first; ...")
    text = across_configs([a, b, c])
    assert "1/2 cases gave the same output on every config" in text
    assert "x on bf16: first diverges at character 8: 'three' vs 'four'" in text
    row_x = next(line for line in text.splitlines() if line.startswith("x "))
    assert row_x.split() == ["x", "consistent,", "same", "consistent,", "DIFFERS", "varies,",
                             "same"]
