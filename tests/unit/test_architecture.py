"""The rooms' rules, read from the source: which room may import which, no import circle, and
files and functions small enough to read (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rayllm"

# What each room may import of rayllm (itself always). The driver-side rooms at the top may
# import the rooms below them; nothing imports runtime but the CLI, the public API and benches.
BELOW = {
    "errors": set(),
    "events": set(),  # the run's events, rank 0 -> the driver (no rayllm import)
    "io": {"errors"},
    "hardware": set(),
    "autoscaler": set(),
    "ray_cluster": set(),  # join or start Ray, node-pinned actors: every Ray-side room's bottom
    "model": {"errors"},
    "parallel": {"model", "errors"},
    "config": {"io", "errors", "model", "parallel", "checkpoint"},  # checks: layout arithmetic; resolve: HF config.json
    "data": {"io", "config", "errors", "ray_cluster"},
    "checkpoint": {"io", "config", "model", "data", "errors", "ray_cluster", "events"},
    "loop": {"checkpoint", "data", "parallel", "model", "config", "io", "errors", "hardware", "events"},
    "use": {"checkpoint", "model", "data", "io", "config", "errors", "ray_cluster"},
    "prepare": {"data", "io", "config", "errors", "ray_cluster"},
    "runtime": {"loop", "checkpoint", "data", "parallel", "model", "config", "io", "errors", "ray_cluster", "events"},
}
ENTRY_POINTS = {"cli", "bench", "__init__"}  # may import any room
NO_RAY = {"model", "parallel", "loop", "config", "events"}  # (io seals credentials in Ray's object store)
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED = {("cli.py", "build_parser")}  # the CLI's argument table


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The rayllm modules ``path`` imports (module-level ones, TYPE_CHECKING blocks included,
    when ``top_level_only``)."""
    tree = ast.parse(path.read_text())
    nodes = []
    if top_level_only:
        stack = list(tree.body)
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, ast.If | ast.Try):  # if TYPE_CHECKING / try-except ImportError
                stack.extend(node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", []))
            elif isinstance(node, ast.ExceptHandler):
                stack.extend(node.body)
    else:
        nodes = list(ast.walk(tree))
    known = modules()
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rayllm")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayllm"):
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            found |= submodules if len(submodules) == len(node.names) else submodules | {node.module}
    return found


def test_every_room_imports_only_the_rooms_below_it():
    wrong = []
    for module, path in modules().items():
        mine = room(module)
        if mine in ENTRY_POINTS:
            continue
        for target in imports(path, top_level_only=False):
            theirs = room(target)
            if target == "rayllm" or (theirs != mine and theirs not in BELOW[mine]):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(NO_RAY))
def test_rooms_below_the_driver_do_not_know_ray(name):
    for path in (ROOT / name).rglob("*.py") if (ROOT / name).is_dir() else [ROOT / f"{name}.py"]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        assert not {n for n in names if n == "ray" or n.startswith("ray.")}, path


def test_no_import_circle():
    known = modules()
    graph = {m: imports(p, top_level_only=True) & set(known) - {m} for m, p in known.items()}
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_files_and_functions_stay_small():
    long_files, long_functions = [], []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                key = (str(path.relative_to(ROOT)), node.name)
                if length > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS_ALLOWED:
                    long_functions.append(f"{key[0]}::{node.name}: {length} lines")
    assert not long_files and not long_functions, long_files + long_functions


def test_the_loop_reads_the_session_through_its_protocol_only():
    for path in (ROOT / "loop").rglob("*.py"):
        assert "getattr(session" not in path.read_text() and "getattr(self.session" not in path.read_text(), path
