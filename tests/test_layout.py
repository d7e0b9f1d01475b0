"""The package's folders are its architecture: each is one layer, imports point only downward (lazy ones and
`importlib` by string included), the merged `requests` read is spelled in one place, test doubles live in
`stepline.testing`, and every module is imported by a test and has its tests where it is (tests/X/test_Y.py)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "collector" / "stepline"

# Lowest first: a module imports only from its own layer or one listed before it (stepline/__init__.py says why).
LAYERS = ("core", "model", "queries", "store", "config", "clickhouse_http", "plugin", "gateway", "sources", "ingest",
          "endpoints", "diagnosis", "analysis", "watchdog", "alerting", "dashboards", "testing", "loadgen", "sim",
          "whatif", "app", "drills", "cli")
ROOT_MODULES = {"__init__", "__main__"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("stepline", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The stepline module an imported name lives in (a module, or the module holding the imported attribute)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name if name in MODULES else None


def _imports(module: str, path: Path) -> Iterator[str]:
    """Every stepline module `module` imports: at the top, inside functions, and named by string (importlib)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count(".") >= 1:
            names = [node.value] if node.value in MODULES else []  # a module named by string, for importlib
        for name in names:
            owner = _owner(name)
            if owner is not None and owner != module:
                yield owner


GRAPH = {module: set(_imports(module, path)) for module, path in MODULES.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ROOT_MODULES:
        return len(LAYERS)  # the root package and `python -m stepline` sit above every layer
    return LAYERS.index(parts[1])


def test_the_root_holds_only_the_package_and_its_entry_point() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_every_folder_is_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS), "add the new package to LAYERS (and to stepline/__init__.py's list)"


def test_imports_point_only_downward() -> None:
    upward = sorted(f"{module} -> {target}" for module, targets in GRAPH.items() for target in targets
                    if _layer(target) > _layer(module))
    assert upward == []


def test_no_import_cycles() -> None:
    """Within a layer too (across layers, downward-only imports cannot close a cycle): Tarjan's strongly connected
    components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in GRAPH:
        if start in index:
            continue
        work = [(start, iter(sorted(GRAPH[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(GRAPH[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert cycles == []


def test_the_merged_requests_read_is_spelled_once() -> None:
    """`requests FINAL` lives in stepline.queries.requests; the schema's column reference says it to users;
    dashboards keep their own SQL (it is their output)."""
    spelled = sorted(m for m, p in MODULES.items() if ".dashboards." not in m
                     and re.search(r"\bFINAL\b", p.read_text(encoding="utf-8")))
    assert spelled == ["stepline.model.schema", "stepline.queries.requests"]


def test_test_doubles_live_in_testing() -> None:
    doubles = sorted(f"{m}.{node.name}" for m, p in MODULES.items() if not m.startswith("stepline.testing")
                     for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                     if isinstance(node, ast.ClassDef) and re.match(r"(Fake|Stub|Mock|InMemory)[A-Z]", node.name))
    assert doubles == []


def test_every_package_says_what_it_offers_and_runs_nothing() -> None:
    """An `__init__.py` is its package's docstring and nothing else: importing a package costs nothing and a reader
    finds the public surface named there."""
    for path in PACKAGE.rglob("__init__.py"):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        assert ast.get_docstring(ast.Module(body=body, type_ignores=[])), path
        assert len(body) == 1, f"{path}: code beside the docstring"


def test_every_module_is_imported_by_a_test() -> None:
    tested: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                tested.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                tested.add(node.module)
                tested.update(f"{node.module}.{alias.name}" for alias in node.names)
        tested.update(re.findall(r"stepline(?:\.\w+)+", text))  # modules a test runs in a subprocess
    untested = sorted(m for m, p in MODULES.items() if p.name != "__init__.py" and m not in tested)
    assert untested == []


def test_every_module_has_its_mirror() -> None:
    """`stepline/X/Y.py` has `tests/X/test_Y.py` (or `test_Y_<aspect>.py`): whoever changes a module finds its tests
    where the module is."""
    missing = []
    for module, path in MODULES.items():
        if path.name == "__init__.py" or path.parent == PACKAGE:
            continue  # a package's docstring, and the root's entry point (test_main_module.py)
        folder = ROOT / "tests" / path.parent.relative_to(PACKAGE)
        if not (folder / f"test_{path.stem}.py").is_file() and not any(folder.glob(f"test_{path.stem}_*.py")):
            missing.append(module)
    assert sorted(missing) == []


def test_tests_mirror_the_tree() -> None:
    """`tests/X/test_Y.py` (or `test_Y_<aspect>.py`) tests `stepline/X/Y.py` or the package `stepline/X/Y/`, and
    `tests/benchmarks/test_Y.py` the script `benchmarks/Y.py`; the real-engine, client, end-to-end, fuzz, docs and
    deploy tests keep folders of their own."""
    own_folders = {"realvllm", "clients", "e2e", "fuzz", "docs", "deploy"}
    strays = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        folder = path.parent.relative_to(ROOT / "tests")
        if folder.parts and folder.parts[0] in own_folders:
            continue
        package = (ROOT if folder.parts[:1] == ("benchmarks",) else PACKAGE).joinpath(*folder.parts)
        stem = path.stem.removeprefix("test_")
        modules = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if p.is_dir()}
        if not folder.parts:
            modules |= {"layout", "main_module"}  # the package as a whole, and `python -m stepline`
        if not any(stem == m or stem.startswith(f"{m}_") for m in modules if not m.startswith("__")):
            strays.append(str(path.relative_to(ROOT)))
    assert sorted(strays) == []
