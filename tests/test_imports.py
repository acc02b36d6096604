"""The layout shows the architecture: no module imports the command line but the command line,
and no two modules import each other (directly or round a longer circle), lazily or not."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.fast  # the whole file: the import layout of the code, read from its source

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jshard"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The jshard modules `name` imports anywhere in its body (a function's lazy import too)."""
    found = set()
    package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from package import module` depends on the module; `from module import name` on the module.
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            targets = submodules if len(submodules) == len(node.names) else [base] + submodules
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: imports(name) for name in MODULES}


def test_the_library_never_imports_the_command_line():
    upward = {name: sorted(t for t in targets if t == "jshard.cli" or t.startswith("jshard.cli."))
              for name, targets in GRAPH.items() if not name.startswith("jshard.cli")}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def circle_through(start: str) -> list[str] | None:
    """A path of imports from `start` back to itself, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        name, path = stack.pop()
        for target in GRAPH[name]:
            if target == start:
                return path + [start]
            if target not in seen:
                seen.add(target)
                stack.append((target, path + [target]))
    return None


@pytest.mark.parametrize("name", [n for n in MODULES if n != "jshard"])
def test_no_module_is_in_an_import_circle(name):
    assert circle_through(name) is None
