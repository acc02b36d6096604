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


# The layers, lowest first: the sharding core (what a user imports to shard a model), the trainer
# app (`jshard.app`), the benchmarks (which build steps as the app does), the command line.
LAYERS = ("core", "jshard.app", "jshard.bench", "jshard.cli")


def layer(name: str) -> int:
    return max([i for i, prefix in enumerate(LAYERS) if name == prefix or name.startswith(prefix + ".")], default=0)


def test_no_module_imports_a_higher_layer():
    upward = {name: sorted(t for t in targets if layer(t) > layer(name)) for name, targets in GRAPH.items() if name != "jshard"}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_module_basenames_are_unique():
    """One meaning per name: `step.py` is the step, not also its context and its benchmark."""
    seen: dict[str, list[str]] = {}
    for path in MODULES.values():
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


MAX_LINES = 600  # a module read in one sitting


def test_no_module_is_longer_than_a_sitting():
    lengths = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def names_bound_by_imports(name: str) -> set[str]:
    """The public names a module's top-level imports bind (`from x import a, b as c`: a, c)."""
    bound = set()
    for node in ast.parse(MODULES[name].read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return {n for n in bound if not n.startswith("_")}


@pytest.mark.parametrize("name", ["jshard", "jshard.nn"])
def test_a_package_exports_each_name_it_imports_once(name):
    """The public surface is one list: every name the package imports is in `__all__`, once, and
    nothing else public but submodules (imported for their own `jshard.x.y` names) sits beside it."""
    import importlib
    import types

    package = importlib.import_module(name)
    assert len(package.__all__) == len(set(package.__all__)), package.__all__
    assert names_bound_by_imports(name) == set(package.__all__)
    public = {k for k, v in vars(package).items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public == {k for k in package.__all__ if not isinstance(getattr(package, k), types.ModuleType)}


def test_jshard_nn_exports_only_what_a_model_author_writes():
    import types

    import jshard.nn

    assert len(jshard.nn.__all__) <= 20, sorted(jshard.nn.__all__)
    step_internals = {"LocalBlock", "ShardWithReplica", "StepContext", "step_context", "relayout_local", "QUERY_TILE",
                      "gathered_layout", "holds_replicas", "manual_axes"}
    # (`jshard.nn.step_context` is also the module's name: its functions are not exported)
    exported = {k for k, v in vars(jshard.nn).items() if not isinstance(v, types.ModuleType)}
    assert not step_internals & exported


def test_the_core_package_never_imports_the_app():
    assert not {t for t in GRAPH["jshard"] if t == "jshard.app" or t.startswith("jshard.app.")}
