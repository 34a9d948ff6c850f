"""The docs stay true: every flag is documented, every command in them runs or parses, every link resolves.

    .venv/bin/python -m pytest -q tests/test_docs.py

Pages: README.md and docs/*.md. Every fenced ``bash``/``sh``/``console``/``python`` block starts with
``# needs: ...`` (README, "Conventions of these pages"):

- ``# needs: nothing``: the block is run, blocks in page order (README first, then docs/ by name),
  in one scratch folder that stands in for ``/tmp/quickstart`` (the README's quick start: tiny model,
  tokenizing, a 2-rank CPU training, loading the checkpoint);
- ``# needs: gpu, hub, ...``: what a test machine lacks. Such a block is not run, but each of its
  commands must still parse: training and tokenizing (``train.py``, ``process_data.py``, ``-m
  minitrainer.train``, ``minitrainer-train``, ...) through ``parse_config`` (what their ``main`` does,
  ``__post_init__`` validation included), after stripping environment variables and a ``torchrun``
  prefix (parsed by torchrun's own parser; the launcher ``python -m minitrainer.run`` / ``minitrainer-run``
  likewise, split where it splits them); other modules run with ``python -m`` (the only way a script
  outside the root runs: ``minitrainer.tools.demo``, ``bench.<script>``) and the console scripts of
  ``pyproject.toml``, through their own argparse (run up to ``parse_args`` and stopped there); ``make``
  targets and variables against the Makefile; ``pip install`` of requirement files or of the checkout
  (with extras ``pyproject.toml`` declares), ``bash`` scripts and ``pytest`` paths must exist.
  A command that fits none of these fails the test, so no block can rot unseen.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from minitrainer.common.cli import build_arg_parser, parse_config
from minitrainer.data.process_data import ProcessDataConfig
from minitrainer.train import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {page: page.read_text() for page in PAGES}
README = TEXT[ROOT / "README.md"]
CHECKED_LANGS = {"bash", "sh", "console", "python"}
NEEDS = {"nothing", "gpu", "hub", "network", "nodes", "slurm", "data", "time"}
QUICKSTART = "/tmp/quickstart"
MAKEFILE = (ROOT / "Makefile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSOLE_SCRIPTS = PYPROJECT["scripts"]
CONFIG_OF_MODULE = {"minitrainer.train": TrainConfig, "minitrainer.data.process_data": ProcessDataConfig}
"""The entry points whose flags come from a config dataclass: parsed as their ``main`` parses them."""
SBATCH_SCRIPT = "slurm_multi_node.sbatch"
# The flags slurm_multi_node.sbatch passes to train.py before the ones given at submission.
SBATCH_TRAIN_FLAGS = ["--model-name-or-path", "m", "--data-path", "d", "--output-dir", "o",
                      "--min-samples-per-checkpoint", "20000"]


@dataclasses.dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def needs(self) -> set[str] | None:
        first = self.text.lstrip("\n").split("\n", 1)[0].strip()
        match = re.fullmatch(r"#\s*needs:\s*(.+)", first)
        return {word.strip() for word in match.group(1).split(",")} if match else None


def fenced_blocks(page: Path) -> list[Block]:
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(TEXT[page].splitlines(), 1):
        if lang is None:
            if line.startswith("```"):
                lang, start, body = line[3:].strip(), number, []
        elif line.startswith("```"):
            blocks.append(Block(page, start, lang, "\n".join(body)))
            lang = None
        else:
            body.append(line)
    assert lang is None, f"{page.relative_to(ROOT)}:{start}: unclosed code block"
    return blocks


BLOCKS = [block for page in PAGES for block in fenced_blocks(page) if block.lang in CHECKED_LANGS]


def shell_commands(text: str) -> list[list[str]]:
    """The block's commands as word lists: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


class _Parsed(Exception):
    pass


def _parse_with_own_argparse(run, argv0: str, args: list[str]) -> None:
    """Run a script or module as ``__main__`` (``run``) until its argparse has parsed ``args``, then stop it."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        original(self, argv, namespace)
        raise _Parsed

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_args = parse_then_stop
    sys.argv = [argv0, *args]
    try:
        run()
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv
    raise AssertionError(f"{argv0} ran to the end without parsing arguments with argparse")


def check_script(script: str, args: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"no such script {script}"
    # Only the root's scripts run by path; anything under bench/ or tests/ imports from the root.
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    assert path.parent == ROOT, f"{script} runs as `python -m {module}` from the repository root"
    if path.name == "train.py":
        parse_config(TrainConfig, args)
    elif path.name == "process_data.py":
        parse_config(ProcessDataConfig, args)
    else:
        _parse_with_own_argparse(lambda: runpy.run_path(str(path), run_name="__main__"), str(path), args)


def check_module(module: str, args: list[str]) -> None:
    """``python -m minitrainer.tools.demo ...``, ``python -m bench.x ...`` from the repository root
    (docs/code-layout.md, "How imports work")."""
    path = ROOT / (module.replace(".", "/") + ".py")
    assert path.is_file() and path.parent != ROOT, f"no module {module} in minitrainer/, bench/, tests/ or fixtures/"
    if module in CONFIG_OF_MODULE:
        parse_config(CONFIG_OF_MODULE[module], args)
        return
    if module == "minitrainer.run":
        check_launcher(args)
        return
    imported = sys.modules.pop(module, None)  # another script imported it: `python -m` would run it fresh
    try:
        _parse_with_own_argparse(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), str(path),
                                 args)
    finally:
        if imported is not None:
            sys.modules[module] = imported


def check_launcher(args: list[str]) -> None:
    """``python -m minitrainer.run`` / ``minitrainer-run``: torchrun's flags by torchrun's own parser, then the
    training flags by ``parse_config``, split where the launcher splits them."""
    from torch.distributed.run import get_args_parser

    from minitrainer.run import split_argv

    torchrun_words, train_words = split_argv([re.sub(r"\$\{?\w+\}?", "1", word) for word in args])
    get_args_parser().parse_args([*torchrun_words, "minitrainer.train"])
    parse_config(TrainConfig, train_words)


def check_torchrun(args: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    # Shell variables stand for values the job knows ($NNODES, $HEAD_NODE:29500): any number fits them.
    parsed = get_args_parser().parse_args([re.sub(r"\$\{?\w+\}?", "1", word) for word in args])
    check = check_module if parsed.module else check_console_script if parsed.no_python else check_script
    check(parsed.training_script, parsed.training_script_args)


def check_console_script(name: str, args: list[str]) -> None:
    """A console script of ``pyproject.toml`` (``minitrainer-train``): its module's command line."""
    assert name in CONSOLE_SCRIPTS, f"pyproject.toml declares no console script {name}"
    check_module(CONSOLE_SCRIPTS[name].split(":")[0], args)


def check_make(args: list[str]) -> None:
    phony = re.search(r"^\.PHONY:(.*)$", MAKEFILE, re.M).group(1).split()
    for word in args:
        if "=" in word:
            name = word.split("=", 1)[0]
            assert re.search(rf"\b{name}\b", MAKEFILE), f"the Makefile has no variable {name}"
        else:
            assert word in phony, f"the Makefile has no target {word}"


def check_command(words: list[str]) -> None:
    """Assert one documented command parses (see the module docstring); SystemExit means it did not."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if not words:
        return  # a variable assignment
    command, rest = words[0], words[1:]
    name = Path(command).name
    if name == "make":
        check_make(rest)
    elif name == "torchrun":
        check_torchrun(rest)
    elif name == "sbatch":
        assert SBATCH_SCRIPT in rest, f"sbatch of an unknown script: {rest}"
        assert (ROOT / SBATCH_SCRIPT).is_file()
        parse_config(TrainConfig, SBATCH_TRAIN_FLAGS + rest[rest.index(SBATCH_SCRIPT) + 1:])
    elif name in ("pip", "pip3"):
        check_pip(rest)
    elif name == "bash":
        assert (ROOT / rest[0]).is_file(), f"no such script {rest[0]}"
    elif name in CONSOLE_SCRIPTS:
        check_console_script(name, rest)
    elif name in ("python", "python3"):
        if rest[:2] == ["-m", "venv"]:
            return
        if rest[:2] == ["-m", "pip"]:
            check_pip(rest[2:])
        elif rest[:2] == ["-m", "torch.distributed.run"]:
            check_torchrun(rest[2:])
        elif rest[:2] == ["-m", "pytest"]:
            paths = [word for word in rest[2:] if not word.startswith("-")]
            assert paths and all((ROOT / path).exists() for path in paths), f"pytest of missing paths {paths}"
        elif rest[:1] == ["-c"]:
            compile(rest[1], "<python -c>", "exec")
        elif rest[:1] == ["-m"]:
            check_module(rest[1], rest[2:])
        else:
            check_script(rest[0], rest[1:])
    else:
        raise AssertionError(f"not a command this test can check: {shlex.join(words)}")


def check_pip(args: list[str]) -> None:
    """``pip install -r FILE``, ``pip install [-e] .[extras]`` (the checkout) or packages by name."""
    assert args[:1] == ["install"], f"pip {args}"
    for i, word in enumerate(args):
        if word == "-r":
            assert (ROOT / args[i + 1]).is_file(), f"no such requirements file {args[i + 1]}"
        elif match := re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word):
            extras = set(match.group(1).split(",")) if match.group(1) else set()
            assert extras <= set(PYPROJECT["optional-dependencies"]), f"pyproject.toml declares no extras {extras}"


# ---------------------------------------------------------------------------------------------------
# Flags and the CLI


@pytest.mark.parametrize(("config_cls", "page"), [(TrainConfig, "docs/training.md"),
                                                  (ProcessDataConfig, "docs/data.md")])
def test_every_flag_is_documented(config_cls, page):
    text = TEXT[ROOT / page]
    missing = [f.name for f in dataclasses.fields(config_cls) if f"`--{f.name.replace('_', '-')}" not in text]
    assert not missing, f"{page} lacks {missing}"


def test_every_make_target_is_in_the_readme():
    phony = re.search(r"^\.PHONY:(.*)$", MAKEFILE, re.M).group(1).split()
    missing = [target for target in phony if f"make {target}" not in README]
    assert not missing, f"README lacks {missing}"


@pytest.mark.parametrize("config_cls", [TrainConfig, ProcessDataConfig])
def test_every_field_has_help(config_cls):
    assert all(f.metadata.get("help") for f in dataclasses.fields(config_cls))
    build_arg_parser(config_cls).format_help()


def test_spec_command_line_parses_with_spec_defaults():
    config = parse_config(TrainConfig, [
        "--output-dir", "./output/", "--data-path", "./data/chat_tkns",
        "--model-name-or-path", "Qwen/Qwen2.5-1.5B-instruct", "--min-samples-per-checkpoint", "2000",
        "--num-warmup-steps", "20", "--max-tokens-per-gpu", "128000", "--batch-size", "128",
        "--use-liger-kernels", "--seed", "8888", "--learning-rate", "6e-6", "--logging-level", "debug"])
    assert config.max_tokens_per_gpu == 128000 and config.use_liger_kernels and config.logging_level == "DEBUG"
    defaults = TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1)
    assert (defaults.batch_size, defaults.max_tokens_per_gpu, defaults.learning_rate, defaults.num_warmup_steps,
            defaults.lr_scheduler, defaults.seed, defaults.fsdp_sharding_strategy) == (
        1024, 10000, 5e-6, 10, "constant_with_warmup", 42, "FULL_SHARD")
    assert parse_config(TrainConfig, ["--output-dir", "o", "--model-name-or-path", "m", "--data-path", "d",
                                      "--max-tokens-per-gpu", "auto"]).max_tokens_per_gpu == "auto"


def test_invalid_values_are_all_reported_at_once():
    with pytest.raises(ValueError) as err:
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=-1, batch_size=-1, logging_level="loud")
    message = str(err.value)
    assert "--min-samples-per-checkpoint" in message and "--batch-size" in message and "LOUD" in message


def test_compile_with_a_quantized_base_is_refused():
    with pytest.raises(ValueError, match="--compile with --lora-quantize-data-type nf4"):
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, lora_rank=4, lora_quantize_data_type="nf4",
                    compile=True)


# ---------------------------------------------------------------------------------------------------
# Commands


def test_every_block_says_what_it_needs():
    problems = [f"{block.where}: no '# needs: ...' first line" for block in BLOCKS if block.needs is None]
    problems += [f"{block.where}: unknown needs {sorted(block.needs - NEEDS)} (known: {sorted(NEEDS)})"
                 for block in BLOCKS if block.needs and block.needs - NEEDS]
    problems += [f"{block.where}: 'nothing' with other needs" for block in BLOCKS
                 if block.needs and "nothing" in block.needs and len(block.needs) > 1]
    assert not problems, "\n".join(problems)
    assert any(block.needs == {"nothing"} for block in BLOCKS if block.page.name == "README.md")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang != "python"], ids=lambda b: b.where)
def test_every_command_parses(block):
    for words in shell_commands(block.text):
        try:
            check_command(words)
        except SystemExit as exit_:
            raise AssertionError(f"{block.where}: `{shlex.join(words)}` does not parse (exit {exit_.code})") from None
        except AssertionError as err:
            raise AssertionError(f"{block.where}: `{shlex.join(words)}`: {err}") from None


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_every_python_block_compiles(block):
    compile(block.text, block.where, "exec")


def test_blocks_that_need_nothing_run(tmp_path):
    """The CPU quick start (and any other `# needs: nothing` block), end to end, in page order."""
    scratch = tmp_path / "quickstart"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ran = 0
    for block in BLOCKS:
        if block.needs != {"nothing"}:
            continue
        code = block.text.replace(QUICKSTART, str(scratch))
        argv = ["bash", "-euo", "pipefail", "-c", code] if block.lang != "python" else [sys.executable, "-c", code]
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{block.where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        ran += 1
    # What the README's quick start promises: a Hugging Face export after 4 steps of 16 samples, a metrics line per step.
    assert ran >= 2 and (scratch / "out" / "hf_format" / "samples_64" / "config.json").is_file()
    steps = [line for line in (scratch / "out" / "training_metrics_0.jsonl").read_text().splitlines() if '"val_loss"' not in line]
    assert len(steps) >= 4


# ---------------------------------------------------------------------------------------------------
# Links


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in re.findall(r"\]\(([^)\s]+)\)", README)}
    missing = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not missing, f"README links no {missing}"


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    text = TEXT[page] if page in TEXT else page.read_text()
    outside_code = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", outside_code, re.M):
        slug = github_anchor(heading)
        count = seen.get(slug, 0)
        found.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    outside_code = re.sub(r"^```.*?^```", "", TEXT[page], flags=re.M | re.S)
    outside_code = re.sub(r"`[^`\n]*`", "", outside_code)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", outside_code):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
