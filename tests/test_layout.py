"""The house's shape: no import cycle anywhere in the repository; each folder imports only the ones below
it; the training loop fits one screen.

    .venv/bin/python -m pytest -q tests/test_layout.py

The import graph covers every ``*.py`` of the root, ``fixtures/``, ``bench/``, ``tests/`` and ``data/``,
imports inside functions included. The folders are layers (docs/code-layout.md, "How imports work"): the
root imports only the root; ``fixtures/`` the root and itself; ``bench/`` those and itself; ``tests/``
everything. A module outside the root is imported by its dotted path from the repository root
(``fixtures.e2e``, ``bench.bench_train``); a bare name that only a sys.path edit could resolve is reported.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from fixtures.e2e import ROOT

LAYERS = {"": 0, "data": 0, "fixtures": 1, "bench": 2, "tests": 3}
"""A module may import modules of its own layer or a lower one (``data/``: the demo data's standalone generator)."""
FOLDERS = ("", "fixtures", "bench", "tests", "data")
MODULES = {path.stem: path for path in ROOT.glob("*.py")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TREE = {_module_name(path): path for folder in FOLDERS for path in sorted((ROOT / folder).glob("*.py"))}


def _folder(name: str) -> str:
    return name.split(".")[0] if "." in name or name in FOLDERS else ""


def _resolve(name: str, importer: str) -> tuple[str | None, bool]:
    """The repository module ``name`` means, and whether it is spelled as from the root. A bare name that
    is no root module is resolved as the sys.path edit it needs would have (a sibling first, else the
    only module of that name elsewhere), so an old-style import still shows in the graph."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if (candidate := ".".join(parts[:end])) in TREE:
            return candidate, True
    siblings = [n for n in TREE if n.rsplit(".", 1)[-1] == parts[0] and n != parts[0]]
    if not siblings:
        return None, True
    own = [n for n in siblings if _folder(n) == _folder(importer)]
    return (own or siblings)[0], False


def _imports(path: Path) -> dict[str, bool]:
    """``{module: spelled from the root}`` for every repository module ``path`` imports, anywhere in it."""
    importer, found = _module_name(path), {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = importer.split(".")[:len(importer.split(".")) - node.level] if node.level else []
            base = ".".join([*package, *([node.module] if node.module else [])])
            # `from bench import bench_train` names a module; `from utils import IGNORE_INDEX` does not.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in TREE else base for alias in node.names]
        else:
            continue
        for name in names:
            module, rooted = _resolve(name, importer)
            if module is not None and module != importer:
                found[module] = found.get(module, True) and rooted
    return found


GRAPH = {name: _imports(path) for name, path in TREE.items()}


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
    cycles = [cycle for name in sorted(GRAPH) if (cycle := _cycle_from(name, GRAPH))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_folder_imports_only_its_own_layer_or_lower():
    upward = [f"{name} -> {imported}" for name, imports in sorted(GRAPH.items()) for imported in sorted(imports)
              if _folder(name) in LAYERS and LAYERS[_folder(imported)] > LAYERS[_folder(name)]]
    assert not upward, ("imports against the layers (root < fixtures < bench < tests; shared helpers go to "
                        "fixtures/): " + "; ".join(upward))


def test_modules_outside_the_root_are_imported_from_the_root():
    bare = [f"{name} imports {imported} by a bare name" for name, imports in sorted(GRAPH.items())
            for imported, rooted in sorted(imports.items()) if not rooted]
    assert not bare, "; ".join(bare) + " (write `fixtures.e2e`, `bench.bench_train`, ...)"


def test_no_file_edits_sys_path():
    edits = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in TREE.values()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
             and node.value.id == "sys"]
    assert not edits, f"sys.path used at {edits}: the repository root is the import root (docs/code-layout.md)"


def test_only_entry_points_import_train():
    importers = sorted(name for name, imports in GRAPH.items() if "train" in imports and _folder(name) == "")
    assert importers == [], f"{importers} import train.py: import train_config (the config) instead"


def test_the_training_loop_fits_one_screen():
    tree = ast.parse((ROOT / "train.py").read_text())
    loop = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "_train")
    assert loop.end_lineno - loop.lineno + 1 <= 60


def test_every_module_is_in_the_code_layout_page():
    page = (ROOT / "docs" / "code-layout.md").read_text()
    missing = sorted(name for name in MODULES if f"`{name}.py`" not in page)
    assert not missing, f"docs/code-layout.md does not say what {missing} are for"


METHOD_NAMES = {"LoRA": (r"lora", {"lora.py", "qlora.py"}),
                "QLoRA": (r"qlora|nf4|quantiz", {"qlora.py", "lora.py"}),  # LoraSettings carries the NF4 flag
                "OSFT": (r"osft", {"osft.py"})}
"""Each fine-tuning method, as its code spells it, and its own modules. Besides them only the config
(``train_config.py``: its flags and ``fine_tuning_method``, the one place that picks a method) names it."""


def _code_tokens(path: Path) -> list[str]:
    """The names and strings of a module's code: comments and docstrings left out (they may cite a method)."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else []:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
                    and isinstance(statement.value.value, str):
                docstrings.update(range(statement.lineno, statement.end_lineno + 1))
    # Python 3.12 splits an f-string into FSTRING_START/MIDDLE/END tokens: its text is the middle.
    kinds = {tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type in kinds and token.start[0] not in docstrings]


@pytest.mark.parametrize("method", sorted(METHOD_NAMES))
def test_a_fine_tuning_method_is_named_only_in_its_own_module_and_the_config(method):
    pattern, own = METHOD_NAMES[method]
    named = sorted(name for name, path in MODULES.items() if f"{name}.py" not in own | {"train_config.py"}
                   and any(re.search(pattern, token, re.IGNORECASE) for token in _code_tokens(path)))
    assert not named, (f"{named} name {method}: ask the run's FineTuningMethod instead (docs/code-layout.md, "
                       "'How to add a fine-tuning method')")


def test_optional_packages_are_imported_only_by_their_feature():
    """Importing the trainer (every root module a plain full fine-tuning run imports) loads none of peft,
    torchao, liger, or a tracker's package: each is imported where its feature is switched on."""
    optional = ("peft", "torchao", "liger_kernel", "wandb", "mlflow", "tensorboard", "torch.utils.tensorboard")
    code = ("import sys, train, setup_run, setup_model_fsdp, run_actions, train_step, trackers, lora, qlora, osft; "
            f"print(sorted(m for m in {optional!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_a_method_that_acts_after_the_update_says_so():
    """``acts_after_update`` is what train_step asks before it lets the optimizer skip a non-finite step on
    the device alone: each method declares it exactly when it overrides ``after_update``."""
    import lora  # noqa: F401  (the methods register as subclasses on import)
    import osft  # noqa: F401
    import qlora  # noqa: F401
    from finetune_method import FineTuningMethod

    methods, todo = [FineTuningMethod], [FineTuningMethod]
    while todo:
        todo += todo.pop().__subclasses__()
        methods += [cls for cls in todo if cls not in methods]
    assert {"LoRA", "QLoRA", "OSFT"} <= {cls.__name__ for cls in methods}
    for cls in methods:
        overrides = cls.after_update is not FineTuningMethod.after_update
        assert cls.acts_after_update == overrides, cls
