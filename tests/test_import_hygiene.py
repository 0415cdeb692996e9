"""Import hygiene: core/ loads no UI, HTTP or database library, and a CLI call imports only the command it runs."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import core

BANNED = ["textual", "rich", "typer", "httpx", "starlette", "fastapi", "uvicorn", "sqlmodel", "sqlalchemy", "plotext"]


def test_core_imports_no_ui_http_or_db_library() -> None:
    modules = [m.name for m in pkgutil.walk_packages(core.__path__, "core.")]
    assert "core.sim.cluster.engine" in modules and "core.policies.sibyl" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(b for b in {BANNED!r} if b in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "", f"core/ pulled in: {out.stdout.strip()}"


def _cli_imports(*argv: str) -> tuple[set[str], str]:
    """The modules a `sibyl-console ARGV` call had imported by the time it exited, and its output."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('MODULES', ','.join(sorted(sys.modules)), file=sys.stderr))\n"
        f"sys.argv = ['sibyl-console', *{list(argv)!r}]\n"
        "from console.cli import main\n"
        "main()\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    line = next(x for x in out.stderr.splitlines() if x.startswith("MODULES "))
    return set(line.removeprefix("MODULES ").split(",")), out.stdout


def test_a_cli_call_imports_only_the_command_it_runs() -> None:
    modules, _ = _cli_imports("status", "--help")
    assert "console.commands.status" in modules
    assert not {"sqlalchemy", "console.commands.up", "console.commands.runs", "core.sim.cluster.engine"} & modules
    modules, out = _cli_imports("scale", "--help")
    assert "console.commands.status" in modules and "console.commands.up" not in modules and "scale [OPTIONS]" in out
    # policy set: the params parser and the HTTP client, not the registry, the state model or numpy
    modules, _ = _cli_imports("policy", "set", "routing", "least_load", "--url", "http://127.0.0.1:9")
    assert "console.commands.params" in modules and "httpx" in modules
    assert not {"core.policies", "console.live.state", "numpy"} & modules
    # the root --help lists every command; their modules load what each needs only when it runs
    modules, out = _cli_imports("--help")
    assert {f"console.commands.{m}" for m in ("up", "runs", "doctor", "train_predictor")} <= modules
    heavy = {"sqlalchemy", "httpx", "textual", "console.live.config", "console.serve", "adapters.store"}
    heavy |= {"adapters.backends", "console.offline.simulate", "console.offline.sweep", "core.policies"}
    assert not heavy & modules, heavy & modules
    for command in (
        "up",
        "status",
        "policy",
        "scale",
        "replay",
        "sweep",
        "runs",
        "calibrate",
        "doctor",
        "train-predictor",
    ):
        assert f" {command} " in out, command


def _folder_cycles(graph: object, package: str) -> list[list[str]]:
    """Import cycles among the modules directly inside `package` (module-level imports and those inside
    functions alike, as grimp sees them): strongly connected components of more than one module."""
    members = {m for m in graph.find_children(package)}  # type: ignore[attr-defined]
    edges = {m: {t for t in graph.find_modules_directly_imported_by(m) if t in members} for m in members}  # type: ignore[attr-defined]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                found.append(sorted(component))

    for m in sorted(members):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle_inside_a_folder_of_console_or_the_simulators() -> None:
    import grimp

    graph = grimp.build_graph("console", "core", "adapters", exclude_type_checking_imports=True)  # runtime imports
    folders = [p for p in graph.modules if p.startswith(("console", "core.sim")) and graph.find_children(p)]
    assert {"console", "console.live", "console.offline", "console.tui", "core.sim.cluster"} <= set(folders)
    cycles = {folder: _folder_cycles(graph, folder) for folder in folders}
    assert {f: c for f, c in cycles.items() if c} == {}


def test_no_module_outside_tests_is_much_over_500_lines() -> None:
    root = Path(__file__).resolve().parents[1]
    long = {
        str(p.relative_to(root)): n
        for top in ("core", "adapters", "console", "benchmarks")
        for p in (root / top).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 550
    }
    assert long == {}, "split these modules (the house aims at ~500 lines)"


def test_no_test_module_imports_another() -> None:
    """Tests share code through helper modules and conftest fixtures, never by importing a test_*.py
    (issue 39: a test module is one source module's tests, and moving it must break nothing else)."""
    import ast

    root = Path(__file__).resolve().parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert len(list(root.rglob("test_*.py"))) > 100 and not offenders, offenders
