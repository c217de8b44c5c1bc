"""Guards for the layout rules (docs/architecture.md), so they live in the suite and not only in heads.

- every source file stays under ~400 lines (split it instead);
- imports point down: data and parallel import nothing else of megazoo, kernels only parallel's public tensor
  layer, models no training or evaluation code, eval no recipes (ALLOWED below is the whole table);
- no process group, device mesh or distributed initialisation at module level (the Topology is passed in);
- every recipe in recipes/ has a test that names it;
- every package folder is installed under the megazoo.* namespace (pyproject's package list);
- no folder's top level holds more than MAX_MODULES modules (group them into rooms: data/tokenizers, models/hf, ...);
- recipes/' rooms import sideways only where ROOM_RULES allows (training/ never reaches up into planner/).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "eval", "kernels", "models", "parallel", "recipes", "workers")
SOURCE_DIRS = PACKAGES + ("benchmarks", "tests")
MAX_LINES = 400
MAX_MODULES = 13  # "~12": a listing a newcomer reads at a glance

# Rooms that must not import each other, (importer, imported): what both need moves down (recipes/gpus.py,
# models/flops.py hold what training's MFU and the planner share).
ROOM_RULES = (("recipes.training", "recipes.planner"), ("recipes.training", "recipes.dry_run"),
              ("recipes.training", "recipes.reproduce"), ("recipes.training", "recipes.verify"),
              ("parallel", "parallel.simulation"))
# parallel's layers may read the simulation's three predicates (is this a fake tensor, do two share storage) and
# nothing else of it: the fake world is the dry run's, not the training step's.
SIMULATION_PREDICATES = "megazoo.parallel.simulation.fake_world"

# Which top-level megazoo packages (or sub-modules) each package may import. The order of the layers, lowest
# first: data, parallel, kernels, models, workers, eval, recipes.
ALLOWED = {
    "data": ("data",),
    "parallel": ("parallel", "data.fileio"),  # data/fileio.py: stdlib-only atomic writes and sha256
    # parallel.accelerator: the one owner of CUDA runtime calls (RNG state, device properties), which kernels need
    # too; it imports nothing of megazoo, so kernels still sit above parallel's lowest layer only.
    "kernels": ("kernels", "parallel.tensor", "parallel.topology", "parallel.collectives", "parallel.accelerator"),
    "models": ("models", "kernels", "data", "parallel.tensor", "parallel.topology", "parallel.checkpoint",
               "parallel.context", "parallel.expert"),
    "workers": ("workers", "parallel.topology", "parallel.checkpoint", "data.fileio"),  # no model, no recipe
    "eval": ("eval", "models", "kernels", "data", "parallel", "workers"),
    "recipes": PACKAGES,
}

# Calls that create process groups or initialise torch.distributed: never at import time.
GROUP_CALLS = {"new_group", "init_process_group", "init_device_mesh", "DeviceMesh", "new_subgroups",
               "init_distributed"}


def _sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)


def _megazoo_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every `megazoo.*` import in the file, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name.removeprefix("megazoo.")) for name in names if name.startswith("megazoo.")]
    return found


@pytest.mark.parametrize("path", _sources(*SOURCE_DIRS), ids=lambda p: str(p.relative_to(REPO)))
def test_source_files_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines (> {MAX_LINES}): split it by purpose"


def _package_folders() -> list[Path]:
    return sorted(p.parent for top in PACKAGES for p in (REPO / top).rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("folder", _package_folders(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_folder_is_a_long_listing(folder):
    modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_MODULES, (f"{folder.relative_to(REPO)}/ holds {len(modules)} modules (> {MAX_MODULES}): "
                                         f"group them into rooms by concern: {modules}")


def test_rooms_do_not_reach_sideways():
    wrong = []
    for importer, imported in ROOM_RULES:
        folder = REPO / importer.replace(".", "/")
        for path in _sources(str(folder.relative_to(REPO))):
            if importer == "parallel" and "simulation" in path.parts:
                continue
            for line, module in _megazoo_imports(path):
                allowed_predicates = importer == "parallel" and "megazoo." + module == SIMULATION_PREDICATES
                if (module == imported or module.startswith(imported + ".")) and not allowed_predicates:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports megazoo.{module}")
    assert not wrong, "rooms that reach sideways or up (move what both need down):\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down(package):
    allowed = ALLOWED[package]
    wrong = [f"{path.relative_to(REPO)}:{line} imports megazoo.{module}"
             for path in _sources(package) for line, module in _megazoo_imports(path)
             if not any(module == a or module.startswith(a + ".") for a in allowed)]
    assert not wrong, f"{package}/ may import only {allowed}:\n" + "\n".join(wrong)


def test_the_import_scan_sees_every_form(tmp_path):
    """A broken scan would pass every rule above: it must see top-level, function-level and aliased imports."""
    source = tmp_path / "module.py"
    source.write_text("import torch\nimport megazoo.data.tokenizer as tok\nfrom megazoo.models import config\n"
                      "def f():\n    from megazoo.kernels.optimizer import adamw_reference\n")
    assert _megazoo_imports(source) == [(2, "data.tokenizer"), (3, "models"), (5, "kernels.optimizer")]


@pytest.mark.parametrize("path", _sources(*PACKAGES), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_level_process_groups(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:  # module-level statements only: functions and classes run when called
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            assert name not in GROUP_CALLS, (f"{path.relative_to(REPO)}:{call.lineno} calls {name} at import time; "
                                             "build groups in Topology.build and pass the Topology in")


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.toml")), ids=lambda p: p.name)
def test_every_recipe_has_a_test_that_names_it(recipe):
    callers = [p.name for p in _sources("tests") if p.name != "test_style.py" and recipe.name in p.read_text()]
    assert callers, f"recipes/{recipe.name} is named by no test: add one that loads it (at least shortened)"


def test_every_package_folder_is_installed_under_megazoo():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"megazoo." + ".".join(p.parent.relative_to(REPO).parts)
               for top in PACKAGES for p in (REPO / top).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert set(config["packages"]) == folders
    assert config["package-dir"] == {f"megazoo.{top}": top for top in PACKAGES}


def _import_graph() -> dict[str, set[str]]:
    """module -> the megazoo modules it imports (top-level and function-level; `from pkg import sub` names the
    submodule when `sub` is one, else the package)."""
    modules = {}
    for path in _sources(*PACKAGES):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules["megazoo." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megazoo."):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                found |= subs or {node.module}
                if len(subs) < len(node.names):
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("megazoo.")}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_circles():
    """Each module imports only what sits below it: no set of modules imports each other in a loop (the issue-26
    circles were data's tokenizers and their loader, the two indexed formats, models' config / presets / layout,
    and the trainer with its checkpointing)."""
    graph, circles = _import_graph(), []
    index, low, stack, on_stack = {}, {}, [], set()

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "modules that import each other in a loop:\n" + "\n".join(map(str, circles))


TEST_ROOT_FILES = {"test_style.py"}  # repo-wide guards; every other test lives beside the package it proves


def test_tests_mirror_the_packages():
    """tests/<package>/<sub-package>/test_*.py: each test folder names a package folder of the source tree (or
    benchmarks/, or gpu/ for the CUDA suite), so the tests for a piece of code are found where the code is."""
    wrong = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        folder = path.parent.relative_to(REPO / "tests")
        if folder == Path("."):
            if path.name not in TEST_ROOT_FILES:
                wrong.append(f"tests/{path.name}: move it into tests/<package>/ beside what it tests")
        elif folder.parts[0] != "gpu" and not (REPO / folder / "__init__.py").exists() and folder != Path("benchmarks"):
            wrong.append(f"{path.relative_to(REPO)}: {folder}/ is not a package folder")
    assert not wrong, "\n".join(wrong)


def test_test_modules_never_import_each_other():
    """What several test files share lives in a helper module at tests/ (harness, jobs, parity_helpers, ...):
    a test module imported by another is collected twice in one worker and breaks when either moves."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[-1].startswith("test_") or n.startswith("tests.")]
    assert not found, "\n".join(found)
# Imports decided at run time, in library code: each one here says why it cannot be a plain import. Anything
# else (a module reached through sys.path, a file loaded by path, a computed import_module) is a module the
# installed package may not have: `megazoo reproduce` once imported the checkout's benchmarks/ that way.
DYNAMIC_IMPORTS = {
    "parallel/zero/__init__.py": "lazy ZeroEngine: the ZeRO formulas' users load no torch (names from _LAZY)",
    "kernels/availability.py": "probes the optional triton install",
    "recipes/dry_run/cuda.py": "tests plant a bug through a 'module:function' the fake-CUDA child imports",
    "workers/replica_groups.py": "the lighthouse loads torchft's compiled module without torchft/__init__ (torch)",
}
PATH_LOADERS = {"spec_from_file_location", "SourceFileLoader", "SourcelessFileLoader", "load_source",
                "run_path", "module_from_spec"}


def _dynamic_imports(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every sys.path use, loader-by-path call and computed import in the file (import_module,
    __import__ or runpy.run_module on anything but a string literal)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) in ("sys", "os.sys"):
            found.append((node.lineno, "sys.path"))
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            found.append((node.lineno, "from sys import path"))
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in PATH_LOADERS:
                found.append((node.lineno, name))
            elif name in ("import_module", "__import__", "run_module") and not (
                    node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found.append((node.lineno, f"{name}({ast.unparse(node.args[0]) if node.args else ''})"))
    return found


@pytest.mark.parametrize("path", _sources(*PACKAGES), ids=lambda p: str(p.relative_to(REPO)))
def test_library_code_imports_nothing_through_sys_path_or_by_path(path):
    rel = str(path.relative_to(REPO))
    found = [] if rel in DYNAMIC_IMPORTS else _dynamic_imports(path)
    assert not found, (f"{rel} imports at run time: " + ", ".join(f"line {n}: {what}" for n, what in found)
                       + ". Import it plainly (the installed package must hold what it imports), or add the file "
                       "to DYNAMIC_IMPORTS with the reason it cannot")


def test_the_dynamic_import_scan_sees_what_reproduce_once_did(tmp_path):
    """The scan must catch the checkout-only import `megazoo reproduce` used before its benchmarks moved into the
    package, and each other form; a plain or literal import stays allowed."""
    source = tmp_path / "module.py"
    source.write_text("import importlib, sys, runpy\nfrom importlib import util\n"
                      "def benchmark(name):\n    sys.path.append('/checkout')\n"
                      "    return importlib.import_module(f'benchmarks.{name}')\n"
                      "spec = util.spec_from_file_location('m', '/x.py')\n"
                      "mod = __import__(name)\nrunpy.run_path('/x.py')\nimportlib.import_module('triton')\n"
                      "import megazoo.models\n")
    assert sorted(n for n, _ in _dynamic_imports(source)) == [4, 5, 6, 7, 8]


def test_dynamic_import_exceptions_are_still_needed():
    """An entry of DYNAMIC_IMPORTS whose file no longer imports at run time goes (the list only shrinks)."""
    stale = [rel for rel in DYNAMIC_IMPORTS if not _dynamic_imports(REPO / rel)
             and "import_module(" not in (REPO / rel).read_text()]
    assert not stale, f"DYNAMIC_IMPORTS lists files with no run-time import: {stale}"
