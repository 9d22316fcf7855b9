"""The code-shape targets of the gateway-shape issue, measured on a checkout: module, class and
function sizes, ``create_app``'s length, where ``RequestRecord`` fields are set, the SSE
encoders and decoders, the parameter-error classes, and where ``TAILSCOPE_*`` is read.

    python bench/code_shape.py [--root DIR]

Run it on two checkouts (e.g. a ``git worktree`` of an older commit) to compare. Counts are
syntactic (Python's ``ast``): a record field is "set" where an attribute of a record variable
(``record``, ``rec``, ``r``, ``trace.record``) is assigned, which is what the issue counted.
No pass/fail here.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

PACKAGES = ("gateway", "engine", "kernels", "tracing", "tailscope", "evals", "dashboards")
RECORD_NAMES = {"record", "rec", "r"}


def _files(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def _record_fields(root: Path) -> set[str]:
    src = (root / "tracing" / "record.py").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name == "RequestRecord":
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)}
    return set()


def _is_record(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in RECORD_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "record"


def measure(root: Path) -> dict:
    fields = _record_fields(root)
    out = {"modules_over_600": [], "classes_over_25_methods": [], "functions_over_80": [],
           "create_app_lines": None, "record_setters": {}, "sse_writers": 0,
           "sse_parsers": 0, "param_error_classes": [], "env_readers": set()}
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        src = path.read_text()
        lines = src.count("\n") + 1
        if lines > 600:
            out["modules_over_600"].append((rel, lines))
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body
                           if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > 25:
                    out["classes_over_25_methods"].append((f"{rel}:{node.name}", len(methods)))
                if any(isinstance(b, ast.FunctionDef) and b.name == "__init__"
                       and any(a.arg == "param" for a in b.args.args) for b in node.body):
                    out["param_error_classes"].append(f"{rel}:{node.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if node.name == "create_app" and rel == "gateway/app.py":
                    out["create_app_lines"] = size
                if size > 80 and not rel.startswith("kernels/"):
                    out["functions_over_80"].append((f"{rel}:{node.name}", size))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and el.attr in fields \
                                and _is_record(el.value):
                            out["record_setters"].setdefault(rel, set()).add(el.attr)
        if rel != "tracing/sse.py":  # the codec itself
            out["sse_writers"] += len(re.findall(r'b?["\'](?:event: [^"\']*\\n)?data: ', src))
            out["sse_parsers"] += len(re.findall(r'startswith\(b?["\']data:', src))
        if re.search(r'environ(?:\.get)?\(\s*f?["\']TAILSCOPE_|environ\[\s*["\']TAILSCOPE_',
                     src):
            out["env_readers"].add(rel)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    m = measure(Path(p.parse_args().root))
    print(f"modules over 600 lines: {len(m['modules_over_600'])}")
    for name, n in sorted(m["modules_over_600"], key=lambda x: -x[1]):
        print(f"  {n:5d}  {name}")
    print(f"classes over 25 methods: {m['classes_over_25_methods']}")
    print(f"functions over 80 lines (outside kernels): {len(m['functions_over_80'])}")
    for name, n in sorted(m["functions_over_80"], key=lambda x: -x[1])[:10]:
        print(f"  {n:5d}  {name}")
    print(f"create_app: {m['create_app_lines']} lines")
    print(f"modules setting RequestRecord fields: {len(m['record_setters'])}")
    for name, f in sorted(m["record_setters"].items(), key=lambda x: -len(x[1])):
        print(f"  {len(f):3d} fields  {name}")
    print(f"SSE writers (data: literals) outside tracing/sse.py: {m['sse_writers']}, "
          f"parsers: {m['sse_parsers']}")
    print(f"parameter-error classes: {m['param_error_classes']}")
    print(f"modules reading TAILSCOPE_* from the environment: {sorted(m['env_readers'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
