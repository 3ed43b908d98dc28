"""The package's layout as docs/architecture.md draws it: no import circle among course_lib's modules, no module
importing one of a higher layer, no file over 600 lines and no function over 80 (issue 34).

The layers are read from the table in docs/architecture.md ("Layers, from the ground up"), so the picture in the
docs and this test cannot drift apart. Every import counts: at the top of a module, inside a function (a lazy
import is still a dependency) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_lib"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """The course_lib modules ``name`` imports, resolved to modules (``from pkg import mod`` names the module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imported_modules(name) for name in MODULES}


def layers() -> dict[str, int]:
    """``{folder or module: layer}`` from the architecture's table rows ``| 1 | `ledgers/` | ... |``."""
    rows = re.findall(r"^\| *(\d+) *\| *`([\w./]+)`", ARCHITECTURE.read_text(), flags=re.M)
    assert rows, "docs/architecture.md has no layer table"
    return {where.rstrip("/").removesuffix(".py"): int(n) for n, where in rows}


def layer_of(name: str, table: dict[str, int]) -> int:
    rest = name.removeprefix("course_lib.")
    if rest in ("course_lib", "__main__"):  # the package's face: above every layer
        return max(table.values()) + 1
    top = rest.split(".")[0]
    assert top in table, f"course_lib.{top} is in no layer of docs/architecture.md's table"
    return table[top]


def test_every_module_has_a_layer():
    table = layers()
    for name in MODULES:
        layer_of(name, table)


def test_no_module_imports_a_higher_layer():
    table = layers()
    upward = [
        f"{name} (layer {layer_of(name, table)}) imports {dep} (layer {layer_of(dep, table)})"
        for name, deps in GRAPH.items()
        for dep in sorted(deps)
        if layer_of(dep, table) > layer_of(name, table)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    """Depth-first search for a back edge; the message names the circle."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for name in MODULES:
        if name not in state:
            circle = visit(name)
            assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_package_top_holds_only_the_front_door():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "harness.py"], top


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_are_short(name):
    source = MODULES[name].read_text()
    lines = source.count("\n")
    assert lines <= MAX_FILE_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_FILE_LINES})"
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 >
        MAX_FUNCTION_LINES
    ]
    assert not long, f"{MODULES[name]}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_short_names_still_work():
    """README: ``from course_lib import launch, comm`` (lazy: importing course_lib imports no torch)."""
    from course_lib import comm, launch, trace
    from course_lib.ledgers import comm as ledger_comm
    from course_lib.ledgers import trace as ledger_trace
    from course_lib.runtime import launch as runtime_launch

    assert (launch, comm, trace) == (runtime_launch, ledger_comm, ledger_trace)


def test_the_package_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, course_lib, course_lib.runtime.forkserver; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_the_rank_server_preloads_modules_that_exist():
    """The forkserver skips a preload it cannot import without a word, so a moved module would silently cost every
    launch its import: each entry must name a module."""
    import importlib.util

    from course_lib.runtime.forkserver import PRELOAD

    missing = [name for name in PRELOAD if importlib.util.find_spec(name) is None]
    assert not missing, missing
