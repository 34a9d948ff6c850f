"""inspect_data reads every single source train.py reads: raw data (any format process_data.py reads) is
tokenized as train.py tokenizes it (data/cache.py), into a cache a training run can share, and shown as the
tokenized data is.

    .venv/bin/python -m pytest -q tests/test_inspect_data.py
"""

from __future__ import annotations

import json

import pytest

from minitrainer.data.process_data import ProcessDataConfig, process_data
from minitrainer.tools.inspect_data import main

ROWS = [{"conversations": [{"from": "human", "value": f"What is {i} plus {i}?"},
                           {"from": "gpt", "value": f"It is {2 * i}." + " Indeed." * (i % 5)}]} for i in range(24)]
PLAN = ["--batch-size", "8", "--max-tokens-per-gpu", "64", "--world-size", "2", "--num-steps", "3"]


def test_raw_data_is_tokenized_as_train_py_does_and_shown_the_same(tmp_path, tiny_models, capsys):
    raw = tmp_path / "chat.jsonl"
    raw.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    model = str(tiny_models["chatml"])
    process_data(ProcessDataConfig(input_file=str(raw), model_name_or_path=model, output_dir=str(tmp_path / "tkns"),
                                   num_proc=1, num_printed_samples=0))
    expected = main(["--data-path", str(tmp_path / "tkns"), *PLAN])
    capsys.readouterr()
    cache_root = tmp_path / "out" / "tokenized_data"
    report = main(["--data-path", str(raw), "--model-name-or-path", model, "--tokenized-data-dir", str(cache_root),
                   *PLAN])
    out = capsys.readouterr().out
    assert "length histogram" in out and "packing plan" in out
    assert report == expected and report["num_samples"] == len(ROWS)
    (folder,) = cache_root.iterdir()  # the cache train.py --output-dir out would find and reuse
    assert folder.name.startswith("chat-") and (folder / "summary.json").is_file()
    assert (folder / "data.jsonl").read_bytes() == (tmp_path / "tkns" / "data.jsonl").read_bytes()
    assert main(["--data-path", str(raw), "--model-name-or-path", model, "--tokenized-data-dir", str(cache_root),
                 *PLAN]) == expected
    assert list(cache_root.iterdir()) == [folder]  # reused, not tokenized again


def test_raw_data_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    raw = tmp_path / "chat.jsonl"
    raw.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    with pytest.raises(SystemExit, match="is raw data .* pass --model-name-or-path"):
        main(["--data-path", str(raw), *PLAN])


def test_a_mix_of_raw_and_tokenized_sources_is_planned_as_the_trainer_draws_it(tmp_path, tiny_models):
    from minitrainer.data.mix import load_data
    from minitrainer.data.sampler import _StepDataset, load_tokenized_dataset

    model = str(tiny_models["chatml"])
    raw = {}
    for name, rows in (("a", ROWS[:16]), ("b", ROWS[16:])):
        raw[name] = tmp_path / f"{name}.jsonl"
        raw[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
        process_data(ProcessDataConfig(input_file=str(raw[name]), model_name_or_path=model,
                                       output_dir=str(tmp_path / f"{name}_tkns"), num_proc=1, num_printed_samples=0))
    tokenized_mix = f"{tmp_path / 'a_tkns'}:0.7,{tmp_path / 'b_tkns'}:0.3"
    expected = main(["--data-path", tokenized_mix, *PLAN])
    report = main(["--data-path", f"{raw['a']}:0.7,{tmp_path / 'b_tkns'}:0.3", "--model-name-or-path", model,
                   "--tokenized-data-dir", str(tmp_path / "cache"), *PLAN])
    assert report == expected and report["num_samples"] == len(ROWS)
    # The plan is the trainer's: its step dataset on the mix (the mix's own stream) makes the same steps.
    dataset = load_data(tokenized_mix, load_tokenized_dataset)
    trainer_steps = _StepDataset(dataset, batch_size=8, max_tokens_per_rank=64, rank=0, world_size=2, seed=42,
                                 start_position=0, balance="tokens")
    for index, plan in enumerate(report["steps"]):
        batch = trainer_steps[index]
        assert (plan.num_samples, plan.num_dropped, plan.num_minibatches, plan.num_tokens) == (
            batch.num_samples, batch.num_dropped_samples, batch.num_minibatches, batch.num_total_tokens)
