"""The package's architecture, read from its source: which part may import which, no import
cycles, no private name used across modules, few top-level modules, short functions.

The parts, from the bottom up: the library (functional, ops, connections, runtime), then lm and
integrations (which import the library), then tools (which may import anything). Every
import statement counts, also those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "torch_mhc"
LIBRARY = ("functional", "ops", "connections", "runtime")
# what each part may not import
FORBIDDEN = {
    **{part: ("lm", "integrations", "tools") for part in LIBRARY},
    "lm": ("integrations", "tools"),
    "integrations": ("lm", "tools"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`, the block a module runs only as a script."""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name) and test.left.id == "__name__")


def imports_of(name: str, scripts: bool = True) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement of a module,
    relative imports resolved; only imports of torch_mhc. scripts=False leaves out the
    `__main__` block (run as a script, the module is `__main__`: no cycle with its importers)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    if not scripts:
        tree.body = [node for node in tree.body if not is_main_guard(node)]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names
                      if a.name.split(".")[0] == "torch_mhc"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "torch_mhc":
                found.append((target, [a.name for a in node.names], node.lineno))
    return found


def resolve(target: str, names: list[str]) -> list[str]:
    """The modules an import statement loads: `from pkg import submodule` loads the
    submodule; `from module import name` loads the module."""
    subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
    return subs or [target]


def part_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_parts_import_only_downwards():
    wrong = []
    for name in MODULES:
        for target, names, line in imports_of(name):
            for mod in resolve(target, names):
                if part_of(mod) in FORBIDDEN.get(part_of(name), ()):
                    wrong.append(f"{MODULES[name].relative_to(PACKAGE)}:{line} imports {mod}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    # torch_mhc itself (the package's __init__) is imported by every submodule's import:
    # only edges between modules inside the package count.
    graph = {name: set() for name in MODULES}
    for name in MODULES:
        for target, names, _ in imports_of(name, scripts=False):
            for mod in resolve(target, names):
                if mod in MODULES and mod != name and mod != "torch_mhc":
                    graph[name].add(mod)
    # a package's __init__ re-exporting its submodules is no cycle with them
    for name in MODULES:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_no_private_name_imported_from_another_module():
    wrong = []
    for name in MODULES:
        for target, names, line in imports_of(name):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            if private and target != name:
                wrong.append(f"{MODULES[name].relative_to(PACKAGE)}:{line} imports "
                             f"{private} from {target}")
    assert not wrong, "\n".join(wrong)


def test_few_modules_at_the_top_level():
    top = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= 8, top


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_over_80_lines(name):
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(MODULES[name].read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long
