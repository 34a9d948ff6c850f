"""train.py on raw (untokenized) data: tokenized once into a cache under --output-dir, gated at training time.

    .venv/bin/python -m pytest -q tests/test_train_raw_data.py

End to end (2 gloo CPU ranks under torchrun, tiny local models): raw JSON lines, and a dataset
repository folder of ShareGPT parquet shards with ``--data-split``, train exactly as process_data.py's
output of the same file (that split's) does (same losses, the same tokenized bytes); a resume reuses
the cache. Unit level: an edited input makes a new cache, a
touched one does not; the data-path kinds are told apart. The gates: a failed label audit and data
of another tokenizer are refused in one line at training time, each with its override. The other
ranks outwait a rank 0 busy longer than the process group's timeout (a plain collective does not).

Training on raw data is ordinary training: those runs are warm (``fixtures/warm_jobs.py``), and process_data.py
runs in-process (``main``) where only its files and exit status matter. Fresh processes remain where the
process is the subject: the timeouts of the waiting ranks and an old jinja2 made by a ``sitecustomize``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.e2e import ROOT, assert_ok, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.common.cli import parse_config
from minitrainer.common.log import logger
from minitrainer.data.cache import is_tokenized, tokenize_once, validation_split
from minitrainer.data.process_data import ProcessDataConfig, main
from minitrainer.tools.demo import DEMO_DATA
from minitrainer.train_config import TrainConfig

DEMO = DEMO_DATA
NUM_ROWS = 48


def _demo_rows() -> list[dict]:
    with DEMO.open() as f:
        return [json.loads(line) for _, line in zip(range(NUM_ROWS), f)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _sharegpt_parquet(path: Path) -> Path:
    """The demo's conversations as ShareGPT rows (``conversations`` of ``{from, value}``) in a parquet file."""
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    rows = [{"id": row["id"], "conversations": [{"from": names[m["role"]], "value": m["content"]}
                                                for m in row["messages"]]}
            for row in _demo_rows() if row["messages"][0]["role"] != "pretrain"]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _args(model: Path, data: Path | str, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--max-tokens-per-gpu", "512", "--seed", "3", "--learning-rate", "1e-3",
            "--num-warmup-steps", "0", "--lr-scheduler", "constant", "--min-samples-per-checkpoint", "1000",
            "--num-data-workers", "0", "--skip-objective-check", *extra]


def _process_data_argv(input_file: Path, model: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["--input-file", str(input_file), "--output-dir", str(output_dir), "--model-name-or-path", str(model),
            "--num-proc", "1", *extra]


def _process_data(input_file: Path, model: Path, output_dir: Path, *extra: str) -> int:
    """process_data.py's exit status, its ``main`` run in-process: the files it writes are the subject."""
    try:
        main(_process_data_argv(input_file, model, output_dir, *extra))
    except SystemExit as stop:
        return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    return 0


def _process_data_cli(input_file: Path, model: Path, output_dir: Path, *extra: str,
                      env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "process_data.py"),
                           *_process_data_argv(input_file, model, output_dir, *extra)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})


def _caches(out: Path) -> list[Path]:
    return sorted((out / "tokenized_data").iterdir())


def _refused_in_one_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The job's last error line (the refusal) holds every fragment; no rank printed a traceback
    (a fresh torchrun's own summary of a failed job is one, as in tests/test_faults.py; a warm run has none)."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert output.count("Traceback (most recent call last)") == output.count("ChildFailedError:"), output[-4000:]
    line = [line for line in output.splitlines() if "[rank0] ERROR " in line][-1]
    assert all(fragment in line for fragment in fragments), line
    return line


def _sharegpt_repository(root: Path) -> tuple[Path, Path]:
    """A downloaded dataset repository with ultrachat_200k's split names: ``(folder, its train_sft file)``."""
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: mit\n---\n")
    held_out = [{"conversations": [{"from": "human", "value": "Held out?"}, {"from": "gpt", "value": "Yes."}]}]
    pq.write_table(pa.Table.from_pylist(held_out), root / "data" / "test_sft-00000-of-00001.parquet")
    return root, _sharegpt_parquet(root / "data" / "train_sft-00000-of-00001.parquet")


@pytest.mark.parametrize("kind", ["jsonl", "sharegpt_repository"])
def test_raw_data_trains_as_its_process_data_output_does(kind, tmp_path, chatml_model):
    if kind == "jsonl":
        raw = raw_file = _write_jsonl(tmp_path / "chat.jsonl", _demo_rows())
        split = ()
    else:  # only the split asked for trains: the test_sft rows are left out, and validate
        raw, raw_file = _sharegpt_repository(tmp_path / "repo")
        split = ("--data-split", "train_sft", "--validation-data-path", str(raw), "--validation-data-split", "test_sft",
                 "--validation-every-n-steps", "1")
    assert _process_data(raw_file, chatml_model, tmp_path / "tokenized") == 0
    assert_ok(torchrun(_args(chatml_model, tmp_path / "tokenized", tmp_path / "out_tokenized", "--max-steps", "2"),
                       warm=True))

    out = tmp_path / "out_raw"
    result = torchrun(_args(chatml_model, raw, out, "--max-steps", "2", *split), warm=True)
    assert_ok(result)
    assert "is raw input; tokenizing it once into" in result.stderr
    assert "label audit:" in result.stderr and "sample " in result.stderr  # what process_data.py prints
    caches = _caches(out)  # and the validation split's, for the repository
    assert len(caches) == 1 + (kind == "sharegpt_repository")
    assert (tmp_path / "tokenized" / "data.jsonl").read_bytes() in [(c / "data.jsonl").read_bytes() for c in caches]
    losses = [record["loss"] for record in read_metrics(out) if "loss" in record]  # not the validation records
    assert losses == [record["loss"] for record in read_metrics(tmp_path / "out_tokenized")]
    if kind == "sharegpt_repository":
        assert "split train_sft by file names; not read: 1 file(s) of split test_sft" in result.stderr
        assert "split test_sft by file names; not read: 1 file(s) of split train_sft" in result.stderr
        assert len([record for record in read_metrics(out) if "val_loss" in record]) == 2  # every step
        return

    [cache] = caches
    result = torchrun(_args(chatml_model, raw, out, "--max-steps", "3"), warm=True)  # resumes at step 2
    assert_ok(result)
    assert f"tokenized data: reusing {cache}" in result.stderr and "tokenizing it once" not in result.stderr
    assert "resum" in result.stderr and _caches(out) == [cache]
    assert [record["loss"] for record in read_metrics(out)][:2] == losses and len(read_metrics(out)) == 3


@pytest.fixture
def cache_log() -> list[str]:
    """The cache's log lines (the toolkit's logger does not propagate to pytest's capture)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_an_edited_input_makes_a_new_cache_and_a_touched_one_does_not(tmp_path, chatml_model, cache_log):
    raw = _write_jsonl(tmp_path / "chat.jsonl", _demo_rows()[:12])
    config = ProcessDataConfig(input_file=str(raw), model_name_or_path=str(chatml_model), num_proc=1,
                               output_dir=str(tmp_path / "cache"), overwrite=True)
    first = tokenize_once(config)
    os.utime(raw, (1, 1))
    assert tokenize_once(config) == first
    _write_jsonl(raw, _demo_rows()[:11])
    second = tokenize_once(config)
    assert second != first and sorted((tmp_path / "cache").iterdir()) == sorted([first, second])
    assert sum(1 for _ in (second / "data.jsonl").open()) == 11
    why = [line for line in cache_log if "again into" in line]
    assert why == [f"tokenized data: {first} was made with other input content: tokenizing {raw} again into "
                   f"{second} (this run does not read the earlier folder; remove it when no run needs it)"]
    masked = tokenize_once(ProcessDataConfig(**{**config.__dict__, "mask_reasoning": True}))
    assert masked not in (first, second)  # an option that shapes the labels is part of the key
    assert [line for line in cache_log if "again into" in line][-1].startswith(
        f"tokenized data: {second} was made with other tokenizing options (--mask-reasoning): tokenizing")
    train = parse_config(TrainConfig, ["--data-path", str(raw), "--model-name-or-path", str(chatml_model),
                                       "--output-dir", str(tmp_path / "out"), "--min-samples-per-checkpoint", "1",
                                       "--max-sample-num-tokens", "4096", "--split-long-text"])
    cut = train.tokenizing_config(str(raw), output_dir=str(tmp_path / "cache"))
    assert cut.split_long_text and cut.max_sample_num_tokens == 4096
    whole = tokenize_once(ProcessDataConfig(**{**cut.__dict__, "split_long_text": False}))
    assert tokenize_once(cut) not in (first, second, masked, whole)


def test_a_cache_made_before_the_package_is_made_again_once_saying_why(tmp_path, chatml_model, cache_log):
    """A cache folder whose fingerprint hashed the tokenizing code under its old file names (the flat layout's
    process_data.py, data_sources.py, ...) has another key today: the input is tokenized again, once, with
    one line naming the old folder and why; the next run reuses the new one without a word of the old."""
    raw = _write_jsonl(tmp_path / "chat.jsonl", _demo_rows()[:12])
    config = ProcessDataConfig(input_file=str(raw), model_name_or_path=str(chatml_model), num_proc=1,
                               output_dir=str(tmp_path / "cache"), overwrite=True)
    old = tmp_path / "cache" / "chat-0123456789abcdef"  # what the flat layout wrote: no fingerprint.json
    other = tmp_path / "cache" / "chat-v2-0123456789abcdef"  # another input's, newer: not this one's
    for folder in (old, other):
        folder.mkdir(parents=True)
        (folder / "data.jsonl").write_text("")
        (folder / "summary.json").write_text(json.dumps({"num_written": 12}))
    new = tokenize_once(config)
    assert new != old and (new / "fingerprint.json").is_file()
    [line] = [line for line in cache_log if "tokenizing" in line]
    assert line.startswith(f"tokenized data: {old} predates the fingerprints caches record (made before the "
                           "tokenizing code moved into the minitrainer package") and f"again into {new}" in line
    cache_log.clear()
    assert tokenize_once(config) == new
    assert [line for line in cache_log if "tokenizing" in line] == [] and str(old) not in " ".join(cache_log)


def test_a_fingerprint_file_that_cannot_be_written_is_one_warning(tmp_path, chatml_model, cache_log, monkeypatch):
    """The record of what a cache was made from is a report: a failed write (here: into a folder that is not
    there) leaves the cache whole and usable, with one warning."""
    from minitrainer.data import cache

    monkeypatch.setattr(cache, "FINGERPRINT_FILE", "missing/fingerprint.json")
    raw = _write_jsonl(tmp_path / "chat.jsonl", _demo_rows()[:4])
    config = ProcessDataConfig(input_file=str(raw), model_name_or_path=str(chatml_model), num_proc=1,
                               output_dir=str(tmp_path / "cache"), overwrite=True)
    folder = tokenize_once(config)
    assert (folder / "summary.json").is_file() and tokenize_once(config) == folder
    [warning] = [line for line in cache_log if "not written" in line]
    assert warning.startswith(f"tokenized data: {folder / 'missing' / 'fingerprint.json'} not written (No such file")


def test_a_validation_folder_is_read_as_its_held_out_split(tmp_path):
    """A repository given as --validation-data-path too validates on its validation (else test) split,
    never silently on the rows --data-path trains on."""
    def repository(name: str, splits: tuple[str, ...]) -> str:
        (tmp_path / name / "data").mkdir(parents=True)
        for split in splits:
            _write_jsonl(tmp_path / name / "data" / f"{split}-00000-of-00001.jsonl", _demo_rows()[:1])
        return str(tmp_path / name)

    def split(data: str, held_out: str, **flags) -> str:
        config = TrainConfig(model_name_or_path="m", output_dir=str(tmp_path / "out"), min_samples_per_checkpoint=1, data_path=data,
                             validation_data_path=held_out, **flags)
        return validation_split(config, held_out)

    both = repository("both", ("train", "validation", "test"))
    test_only = repository("test_only", ("train", "test"))
    ultrachat = repository("ultrachat", ("train_sft", "test_sft"))
    assert split(both, both) == "validation" and split(test_only, test_only) == "test"
    assert split(test_only, test_only, validation_data_split="train") == "train"  # asked for: taken
    with pytest.raises(ValueError, match=r"has no validation or test split, so it would validate on the rows "
                                         r"--data-path trains on \(split train_sft\); name a held-out split"):
        split(ultrachat, ultrachat, data_split="train_sft")
    assert split(ultrachat, ultrachat, data_split="train_sft", validation_data_split="test_sft") == "test_sft"
    plain = tmp_path / "plain"
    plain.mkdir()
    _write_jsonl(plain / "held_out.jsonl", _demo_rows()[:1])
    assert split(both, str(plain)) == "train"  # a folder whose names mark no split is read whole


def test_tokenized_and_raw_sources_are_told_apart(tmp_path, chatml_model):
    tokenized = write_tokenized_jsonl(tmp_path / "tok" / "data.jsonl", num_samples=3, vocab_size=50)
    assert is_tokenized(tokenized) and is_tokenized(tokenized.parent)
    (tmp_path / "raw").mkdir()
    raw = _write_jsonl(tmp_path / "raw" / "chat.jsonl", _demo_rows()[:2])
    assert not is_tokenized(raw) and not is_tokenized(raw.parent)
    (tmp_path / "array.json").write_text(json.dumps(_demo_rows()[:2]))
    assert not is_tokenized(tmp_path / "array.json")
    (tmp_path / "bom_array.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(_demo_rows()[:2]).encode())
    assert not is_tokenized(tmp_path / "bom_array.json")
    assert not is_tokenized(_sharegpt_parquet(tmp_path / "chat.parquet"))
    broken_first = tmp_path / "broken_first.jsonl"
    broken_first.write_text("{not json\n" + raw.read_text())
    assert not is_tokenized(broken_first)  # a bad raw row is skipped by tokenizing, not read as tokens
    truncated = tmp_path / "truncated.jsonl"
    truncated.write_text(tokenized.read_text()[:30])
    assert is_tokenized(truncated)  # the tokenized reader names the broken line
    corpus = tmp_path / "corpus.txt"  # text for continued pretraining: no line is JSON, none is tokens
    corpus.write_text("Once upon a time.\nThe end.\n")
    assert not is_tokenized(corpus)
    tokenized_txt = tmp_path / "tokenized.txt"
    tokenized_txt.write_text(tokenized.read_text())
    assert is_tokenized(tokenized_txt)  # JSON lines under a .txt name stay JSON lines


# ----------------------------------------------------------------------------
# Gates at training time


def _audit_failing_rows() -> list[dict]:
    """Mistral's template refuses conversations whose roles do not alternate: 4 of 7 cannot be masked."""
    good = {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]}
    not_alternating = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                    {"role": "assistant", "content": "c"}]}
    return [good] * 3 + [not_alternating] * 4


def test_a_failed_label_audit_is_refused_unless_allowed_when_tokenized(tmp_path, tiny_models):
    model = tiny_models["mistral"]
    raw = _write_jsonl(tmp_path / "chat.jsonl", _audit_failing_rows())
    out = tmp_path / "out"
    line = _refused_in_one_line(torchrun(_args(model, raw, out, "--max-steps", "1"), warm=True),
                                f"--data-path {raw}: its label audit failed", "4 of 7 conversations",
                                "--allow-audit-failures")
    assert "could not be masked" in line
    [cache] = _caches(out)  # kept: allowing the failure needs no second tokenization
    result = torchrun(_args(model, raw, out, "--max-steps", "1", "--allow-audit-failures"), warm=True)
    assert_ok(result)
    assert f"reusing {cache}" in result.stderr and "that was allowed when it was tokenized" in result.stderr

    # process_data.py's own output: its recorded --allow-audit-failures decides, not train.py's flag.
    assert _process_data(raw, model, tmp_path / "strict") == 1
    line = _refused_in_one_line(torchrun(_args(model, tmp_path / "strict", tmp_path / "out_strict",
                                               "--allow-audit-failures"), warm=True), "its label audit failed")
    assert "process_data.py" in line
    assert _process_data(raw, model, tmp_path / "allowed", "--allow-audit-failures") == 0
    assert_ok(torchrun(_args(model, tmp_path / "allowed", tmp_path / "out_allowed", "--max-steps", "1"), warm=True))


def test_data_of_another_tokenizer_is_refused_unless_overridden(tmp_path, tiny_models):
    raw = _write_jsonl(tmp_path / "chat.jsonl", _demo_rows()[:16])
    # llama2's tiny tokenizer has the chatml one's size: every id is in the vocabulary, and means something else.
    assert _process_data(raw, tiny_models["llama2"], tmp_path / "llama2_tokens") == 0
    chatml = tiny_models["chatml"]
    line = _refused_in_one_line(torchrun(_args(chatml, tmp_path / "llama2_tokens", tmp_path / "out",
                                               "--max-steps", "1"), warm=True),
                                f"was tokenized with '{tiny_models['llama2']}' but the model is '{chatml}'",
                                "--allow-tokenizer-mismatch")
    assert "eos_token" in line
    result = torchrun(_args(chatml, tmp_path / "llama2_tokens", tmp_path / "out", "--max-steps", "1",
                            "--allow-tokenizer-mismatch"), warm=True)
    assert_ok(result)
    assert "training anyway (--allow-tokenizer-mismatch)" in result.stderr


# ----------------------------------------------------------------------------
# The other ranks wait for rank 0's tokenizing, however long it takes

_WAIT_SCRIPT = """
import sys, time
import torch.distributed as dist
from minitrainer.setup import run as setup_run
from minitrainer.common.distributed import init_distributed

info = init_distributed(timeout_minutes=0.05)  # a 3-second process-group timeout
if info.rank == 0:
    time.sleep(10)  # rank 0 tokenizing, longer than the timeout
if sys.argv[1] == "patient":
    value = setup_run._patient_broadcast(("verdict", info.rank))
else:
    box = [("verdict", info.rank)]
    dist.broadcast_object_list(box, src=0)
    value = box[0]
print(f"rank {info.rank} got {value}", flush=True)
"""


@pytest.mark.parametrize("how", ["patient", "plain"])
def test_the_other_ranks_outwait_the_process_group_timeout(how, tmp_path):
    """Real processes, a 3-second timeout and a rank 0 busy for 10: the patient broadcast delivers rank 0's
    value; the plain one it replaces times out (the failure the patient one exists to avoid)."""
    script = tmp_path / "wait.py"
    script.write_text(_WAIT_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                             how],
                            cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    output = result.stdout + result.stderr
    if how == "patient":
        assert result.returncode == 0, output[-3000:]
        assert "rank 1 got ('verdict', 0)" in output
    else:
        assert result.returncode != 0 and "rank 1 got" not in output, output[-3000:]


def test_a_jinja2_below_its_floor_is_a_one_line_refusal(tmp_path, chatml_model):
    """transformers renders no chat template with jinja2 before 3.1.6 (requirements.txt's floor): where an
    older one is installed, as a ``sitecustomize`` that sets its version makes it for these processes, both
    commands stop in one line saying so, not in a traceback on rank 0 and a lost connection on the others."""
    old = tmp_path / "old_jinja2"
    old.mkdir()
    (old / "sitecustomize.py").write_text('import jinja2\njinja2.__version__ = "3.1.0"\n')
    raw = _write_jsonl(tmp_path / "chat.jsonl", _demo_rows()[:2])
    result = _process_data_cli(raw, chatml_model, tmp_path / "tokenized", env={"PYTHONPATH": str(old)})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "process_data.py: error: apply_chat_template requires jinja2>=3.1.6"), result.stderr[-3000:]
    _refused_in_one_line(torchrun(_args(chatml_model, raw, tmp_path / "out"), env={"PYTHONPATH": str(old)}),
                         "requires jinja2>=3.1.6", "Your version is 3.1.0")
