"""The house's shape: no import cycles between the toolkit's modules; the training loop fits one screen.

    .venv/bin/python -m pytest -q tests/test_layout.py
"""

from __future__ import annotations

import ast
from pathlib import Path

from e2e import ROOT

MODULES = {path.stem: path for path in ROOT.glob("*.py")}


def _imports(path: Path) -> set[str]:
    """The toolkit modules ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                 else [])
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in MODULES)
    return found - {path.stem}


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack, seen = [(start, [start])], set()
    while stack:
        module, trail = stack.pop()
        for imported in sorted(graph[module]):
            if imported == start:
                return trail + [start]
            if imported not in seen:
                seen.add(imported)
                stack.append((imported, trail + [imported]))
    return None


def test_no_module_imports_itself_through_others():
    graph = {name: _imports(path) for name, path in MODULES.items()}
    cycles = [cycle for name in sorted(graph) if (cycle := _cycle_from(name, graph))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_entry_points_import_train():
    importers = sorted(name for name, path in MODULES.items() if "train" in _imports(path))
    assert importers == [], f"{importers} import train.py: import train_config (the config) instead"


def test_the_training_loop_fits_one_screen():
    tree = ast.parse((ROOT / "train.py").read_text())
    loop = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "_train")
    assert loop.end_lineno - loop.lineno + 1 <= 60


def test_every_module_is_in_the_code_layout_page():
    page = (ROOT / "docs" / "code-layout.md").read_text()
    missing = sorted(name for name in MODULES if f"`{name}.py`" not in page)
    assert not missing, f"docs/code-layout.md does not say what {missing} are for"
