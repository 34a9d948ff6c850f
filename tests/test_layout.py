"""The house's shape: one package whose folders import downward only, no import cycle anywhere in the
repository, thin entry scripts at the root, the training loop in one screen.

    .venv/bin/python -m pytest -q tests/test_layout.py

The import graph covers every ``*.py`` of ``minitrainer/``, the root, ``fixtures/``, ``bench/`` and ``tests/``,
imports inside functions included. The layers, lowest first, are ``LAYERS`` below (what each is for:
docs/code-layout.md). A module imports its own layer or a lower one, by its dotted path from the repository root (``minitrainer.data.sampler``, ``fixtures.e2e``); a
bare name that only a sys.path edit could resolve is reported. How the package installs and what a user's
own modules do to it: tests/test_packaging.py.
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

PACKAGE = ROOT / "minitrainer"
LAYERS = ("minitrainer.common", "minitrainer.data", "minitrainer.model", "minitrainer.methods",
          "minitrainer.objectives", "minitrainer.checkpoint", "minitrainer.optim",
          "minitrainer.train_config", "minitrainer.report", "minitrainer.setup", "minitrainer.loop", "minitrainer",
          "minitrainer.tools", "minitrainer.compat", "minitrainer.integrations", "", "fixtures", "bench", "tests")
"""Lowest first (docs/code-layout.md): a module may import modules of its own layer or a lower one (a tuple: layers
of one rank; ``"minitrainer"``: the doors left at the package top; ``""``: the root's entry scripts)."""
RANK = {layer: rank for rank, tier in enumerate(LAYERS) for layer in (tier if isinstance(tier, tuple) else (tier,))}
ENTRY_SCRIPTS = ("batch_metrics.py", "process_data.py", "sampler.py", "setup_model_fsdp.py", "train.py", "utils.py")
"""The brief's six root files: entry scripts and re-exports of the package, nothing of their own."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = sorted([*PACKAGE.rglob("*.py"), *ROOT.glob("*.py"),
                *(path for folder in ("fixtures", "bench", "tests") for path in (ROOT / folder).glob("*.py"))])
TREE = {_module_name(path): path for path in FILES}
PACKAGE_MODULES = {name: path for name, path in TREE.items() if name.split(".")[0] == "minitrainer"}


def _layer(name: str) -> str:
    """The layer of module ``name``: its package folder, the run's top folder, or the repository folder."""
    if name.split(".")[0] != "minitrainer":
        return name.split(".")[0] if "." in name or name in RANK else ""
    if name == "minitrainer.train_config":
        return name  # every flag: below all that reads the config, above all that the config reads
    parts = name.split(".")
    is_package = TREE.get(name, Path()).name == "__init__.py"
    folder = parts if is_package else parts[:-1]
    return ".".join(folder[:2])


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
    own = [n for n in siblings if _layer(n) == _layer(importer)]
    return (own or siblings)[0], False


def _imports(path: Path) -> dict[str, bool]:
    """``{module: spelled from the root}`` for every repository module ``path`` imports, anywhere in it."""
    importer, found = _module_name(path), {}
    package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            anchor = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            # `from minitrainer.data import sampler` names a module; `from minitrainer.common.labels import
            # IGNORE_INDEX` does not.
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


def test_each_layer_imports_only_its_own_or_lower_ones():
    upward = [f"{name} -> {imported}" for name, imports in sorted(GRAPH.items()) for imported in sorted(imports)
              if RANK[_layer(imported)] > RANK[_layer(name)]]
    assert not upward, ("imports against the layers (docs/code-layout.md; a function that needs a higher layer moves "
                        "to the layer it belongs to): " + "; ".join(upward))


def test_every_package_module_is_in_a_layer():
    folders = {_layer(name) for name in PACKAGE_MODULES}
    assert folders <= set(RANK), f"folders of the package outside the layers: {sorted(folders - set(RANK))}"


def test_modules_are_imported_from_the_root():
    bare = [f"{name} imports {imported} by a bare name" for name, imports in sorted(GRAPH.items())
            for imported, rooted in sorted(imports.items()) if not rooted]
    assert not bare, "; ".join(bare) + " (write `minitrainer.data.sampler`, `fixtures.e2e`, ...)"


def test_no_file_edits_sys_path():
    edits = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in TREE.values()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
             and node.value.id == "sys"]
    assert not edits, f"sys.path used at {edits}: the repository root is the import root (docs/code-layout.md)"


def test_the_root_holds_only_the_entry_scripts():
    assert sorted(path.name for path in ROOT.glob("*.py")) == sorted(ENTRY_SCRIPTS), (
        "a module of the library belongs in minitrainer/ (docs/code-layout.md)")


@pytest.mark.parametrize("script", ENTRY_SCRIPTS)
def test_an_entry_script_only_re_exports_the_package(script):
    """A docstring, imports from ``minitrainer`` and at most ``if __name__ == "__main__": <imported>()``."""
    tree = ast.parse((ROOT / script).read_text())
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    imported = {alias.asname or alias.name for node in body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    for node in body:
        if isinstance(node, ast.ImportFrom):
            assert node.module.split(".")[0] == "minitrainer" and node.level == 0, ast.dump(node)
        else:
            assert isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'", ast.unparse(node)
            [call] = node.body
            assert isinstance(call.value, ast.Call) and not call.value.args and call.value.func.id in imported


def test_nothing_of_the_package_imports_the_loop():
    importers = sorted(name for name in PACKAGE_MODULES if "minitrainer.train" in GRAPH[name])
    assert importers == [], f"{importers} import minitrainer/train.py: import minitrainer.train_config (the config)"


def test_the_training_loop_fits_one_screen():
    tree = ast.parse((PACKAGE / "train.py").read_text())
    loop = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "_train")
    assert loop.end_lineno - loop.lineno + 1 <= 60


def test_every_module_is_in_the_code_layout_page():
    page = (ROOT / "docs" / "code-layout.md").read_text()
    named = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"]
    missing = sorted(name for name in named + list(ENTRY_SCRIPTS) if f"`{name}`" not in page)
    assert not missing, f"docs/code-layout.md does not say what {missing} are for"


METHOD_NAMES = {"LoRA": (r"lora", {"methods/lora.py", "methods/qlora.py"}),
                "QLoRA": (r"qlora|nf4|quantiz", {"methods/qlora.py", "methods/lora.py"}),  # LoraSettings: NF4 flag
                "OSFT": (r"osft", {"methods/osft.py"})}
"""Each fine-tuning method, as its code spells it, and its own modules of ``minitrainer/``. Besides them only
the config (``train_config.py``: its flags and ``fine_tuning_method``, the one place that picks a method)
names it."""


CONFIG_TRANSLATIONS = {"compat/mini_trainer.py", "integrations/hub_parameters.py", "integrations/training_hub.py",
                       "common/foreign_names.py"}
"""Other tools' settings written as ``TrainConfig`` fields: as the config does, they name the methods' flags
(``lora_r`` -> ``lora_rank``), and branch on nothing of a run."""


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


def _named_outside(pattern: str, own: set[str]) -> list[str]:
    """The package modules and entry scripts whose code spells ``pattern``, besides ``own``, the config and the
    translations of other tools' settings."""
    allowed = {f"minitrainer/{name}" for name in own | {"train_config.py"} | CONFIG_TRANSLATIONS}
    code = [*PACKAGE_MODULES.values(), *(ROOT / name for name in ENTRY_SCRIPTS)]
    return sorted(str(path.relative_to(ROOT)) for path in code if str(path.relative_to(ROOT)) not in allowed
                  and any(re.search(pattern, token, re.IGNORECASE) for token in _code_tokens(path)))


@pytest.mark.parametrize("method", sorted(METHOD_NAMES))
def test_a_fine_tuning_method_is_named_only_in_its_own_module_and_the_config(method):
    named = _named_outside(*METHOD_NAMES[method])
    assert not named, (f"{named} name {method}: ask the run's FineTuningMethod instead (docs/code-layout.md, "
                       "'How to add a fine-tuning method')")


OBJECTIVE_NAMES = {"DPO": (r"(?:^|[^a-z])dpo|reference[_-]model",
                           {"objectives/dpo.py", "objectives/reference.py", "objectives/base.py",
                            "objectives/pairs.py", "objectives/kto.py"}),
                   "KTO": (r"(?:^|[^a-z])kto", {"objectives/kto.py", "objectives/base.py", "objectives/pairs.py",
                                               "data/unpaired.py", "data/rows.py", "data/formats.py",
                                               "data/process_data.py"}),
                   "CPO and SimPO": (r"(?:^|[^a-z])(?:cpo|simpo)",
                                     {"objectives/cpo.py", "objectives/pairs.py", "objectives/base.py"}),
                   "ORPO": (r"(?:^|[^a-z])orpo", {"objectives/orpo.py", "objectives/pairs.py", "objectives/base.py"}),
                   "reward models": (r"objective[ =]+[\"']?reward|reward[_-]center",
                                     {"objectives/reward.py", "objectives/base.py", "model/heads.py",
                                      "tools/score_pairs.py"})}
"""Each training objective but SFT (the interface itself), as its code spells it (its name, its flags), and the
modules that may name it: its own, the interface's one-line refusal of its data, its data kind's reader (KTO's
unpaired rows; DPO's reference model, which KTO shares), and the config
(``training_objective`` picks it); the run asks the objective (``preflight``, ``run_params``, ``prepare``)."""


@pytest.mark.parametrize("objective", sorted(OBJECTIVE_NAMES))
def test_a_training_objective_is_named_only_in_its_own_modules_and_the_config(objective):
    named = _named_outside(*OBJECTIVE_NAMES[objective])
    assert not named, f"{named} name {objective}: ask the run's TrainingObjective instead (objectives/base.py)"


def test_optional_packages_are_imported_only_by_their_feature():
    """Importing the trainer (every module a plain full fine-tuning run imports, and the methods) loads none
    of peft, torchao, liger, or a tracker's package: each is imported where its feature is switched on."""
    optional = ("peft", "torchao", "liger_kernel", "wandb", "mlflow", "tensorboard", "torch.utils.tensorboard")
    modules = ("minitrainer.train", "minitrainer.setup.run", "minitrainer.setup.model", "minitrainer.loop.actions",
               "minitrainer.loop.step", "minitrainer.report.trackers", "minitrainer.methods.lora", "minitrainer.methods.qlora",
               "minitrainer.methods.osft")
    code = f"import sys, {', '.join(modules)}; print(sorted(m for m in {optional!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_a_method_that_acts_after_the_update_says_so():
    """``acts_after_update`` is what train_step asks before it lets the optimizer skip a non-finite step on
    the device alone: each method declares it exactly when it overrides ``after_update``."""
    from minitrainer.methods import lora, osft, qlora  # noqa: F401  (the methods register as subclasses on import)
    from minitrainer.methods.base import FineTuningMethod

    methods, todo = [FineTuningMethod], [FineTuningMethod]
    while todo:
        todo += todo.pop().__subclasses__()
        methods += [cls for cls in todo if cls not in methods]
    assert {"LoRA", "QLoRA", "OSFT"} <= {cls.__name__ for cls in methods}
    for cls in methods:
        overrides = cls.after_update is not FineTuningMethod.after_update
        assert cls.acts_after_update == overrides, cls
