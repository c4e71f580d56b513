"""House rules that a reviewer would otherwise count by hand: no file over 400 lines and no
function over 60 lines in the shipped packages (Python, and the C++ kernels), and no import
cycle among their modules; each offender listed by name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.import_graph import import_cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "model_shards", "deploy", "benchmarks")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

_CONTROL = re.compile(r"^\s*(if|for|while|switch|else|do|return|catch)\b")
_HEAD_END = re.compile(r"\)\s*(const\s*)?(noexcept\s*)?(->\s*[\w:<>,\s*&]+)?\s*\{\s*(//.*)?$")


def _sources(suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(
        p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*")
        if p.suffix in suffixes and ".cache" not in p.parts and "__pycache__" not in p.parts
    )


def _python_functions(path: Path) -> list[tuple[str, int, int]]:
    """``(name, first line, length)`` of every function and method."""
    tree = ast.parse(path.read_text())
    return [
        (node.name, node.lineno, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def _code(line: str) -> str:
    """A C++ line without its comment and string or character literals."""
    line = re.sub(r"//.*", "", line)
    return re.sub(r"'(\\.|[^'])'|\"(\\.|[^\"])*\"", "", line)


def cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """``(name, first line, length)`` of each C++ function body: a ``{`` that closes a
    parameter list at a line's end (not a control statement), through its matching ``}``."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        head = lines[i]
        before_paren = head.split("(")[0]
        if (
            not _HEAD_END.search(head)
            or _CONTROL.match(head)
            or any(c in before_paren for c in "=[")
            or "(" not in "".join(lines[max(0, i - 8) : i + 1])
        ):
            i += 1
            continue
        start = i
        while start > 0 and "(" not in lines[start]:
            start -= 1
        match = re.search(r"(\w+)\s*\(", lines[start])
        depth, end = 0, i
        for end in range(i, len(lines)):
            depth += _code(lines[end]).count("{") - _code(lines[end]).count("}")
            if depth <= 0:
                break
        found.append((match.group(1) if match else "?", start + 1, end - start + 1))
        i = end + 1
    return found


def test_cpp_function_finder_measures_a_known_function() -> None:
    text = "namespace n {\nstatic int f(int a,\n          int b) {\n  if (a) {\n    return b;\n"
    text += "  }\n  return a;  // }\n}\n}  // namespace n\n"
    assert cpp_functions(text) == [("f", 2, 7)]


def test_no_file_over_400_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in _sources((".py", ".cpp", ".h"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long, "files over 400 lines:\n" + "\n".join(long)


def test_no_function_over_60_lines() -> None:
    long = []
    for path in _sources((".py", ".cpp", ".h")):
        functions = (
            _python_functions(path) if path.suffix == ".py" else cpp_functions(path.read_text())
        )
        long += [
            f"{path.relative_to(ROOT)}:{line} {name}: {n} lines"
            for name, line, n in functions
            if n > MAX_FUNCTION_LINES
        ]
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_cycle_finder_finds_a_known_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    graph = import_graph(_sources((".py",)))
    assert len(graph) > 200 and graph["server.http.app"], "the import graph looks empty"
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
