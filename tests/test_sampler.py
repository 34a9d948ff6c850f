"""Dataset loading, the infinite sampler, collation and the per-step loader.

    .venv/bin/python -m pytest -q tests/test_sampler.py
"""

import itertools
import json
import re

import numpy as np
import pytest
import torch

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.common.log import logger
from minitrainer.data.sampler import (InfiniteSampler, collate_minibatch, load_tokenized_dataset, make_batch_loader,
                                      resolve_data_file)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_rows(lengths, seed=0):
    """Row r holds token r + 1 (so packed tokens name their row) and a random mask."""
    rng = np.random.default_rng(seed)
    rows = []
    for r, length in enumerate(lengths):
        input_ids = [r + 1] * int(length)
        labels = [t if rng.random() < 0.6 else IGNORE_INDEX for t in input_ids]
        rows.append({"input_ids": input_ids, "labels": labels, "messages": [{"role": "user", "content": "x"}]})
    return rows


@pytest.fixture
def dataset(tmp_path):
    lengths = np.random.default_rng(0).integers(1, 60, size=97).tolist()
    lengths[5] = 200  # longer than the budget used below
    lengths[40] = 150
    path = write_jsonl(tmp_path / "data" / "data.jsonl", make_rows(lengths))
    return load_tokenized_dataset(str(path.parent), cache_dir=str(tmp_path / "cache"))


def rows_of(minibatch):
    """Dataset rows packed in a minibatch (token r + 1 marks row r); dummies excluded."""
    bounds = minibatch.cu_seqlens.tolist()
    tokens = minibatch.input_ids[0]
    return [int(tokens[start]) - 1 for start in bounds[:-1]][: minibatch.num_samples]


# ----------------------------------------------------------------------------
# Dataset


def test_load_computes_lengths_and_shifted_loss_counts(tmp_path):
    rows = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4], "len": 4, "num_loss_counted_tokens": 2},
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "extra": "ignored"},
        {"input_ids": [8], "labels": [8]},
    ]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    dataset = load_tokenized_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == 3 and dataset.path == str(path)
    assert dataset.lengths.tolist() == [4, 3, 1]
    assert dataset.lengths.dtype == np.int64 and dataset.num_loss_counted_tokens.dtype == np.int64
    # Shifted: the first label is never a target.
    assert dataset.num_loss_counted_tokens.tolist() == [2, 2, 0]
    assert dataset.sample(1) == ([5, 6, 7], [5, 6, 7])
    assert dataset.sample(0) == ([1, 2, 3, 4], [-100, -100, 3, 4])


def test_folder_resolution(tmp_path):
    single = write_jsonl(tmp_path / "one" / "tokens.jsonl", [])
    assert resolve_data_file(single.parent) == single
    write_jsonl(tmp_path / "two" / "a.jsonl", [])
    write_jsonl(tmp_path / "two" / "b.jsonl", [])
    with pytest.raises(ValueError, match="exactly one"):
        resolve_data_file(tmp_path / "two")
    preferred = write_jsonl(tmp_path / "two" / "data.jsonl", [])
    assert resolve_data_file(tmp_path / "two") == preferred
    with pytest.raises(ValueError, match="no such file"):
        resolve_data_file(tmp_path / "missing")


@pytest.mark.parametrize(
    "bad_row, reason",
    [
        ({"input_ids": [1, 2]}, "missing 'labels'"),
        ({"labels": [1, 2]}, "missing 'input_ids'"),
        ({"input_ids": [1, 2], "labels": [1]}, "different lengths"),
        ({"input_ids": [], "labels": []}, "empty 'input_ids'"),
        ({"input_ids": [1, None], "labels": [1, 2]}, "null value inside 'input_ids'"),
    ],
)
def test_broken_row_names_file_and_row(tmp_path, bad_row, reason):
    good = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_row, good])
    with pytest.raises(ValueError, match=f"bad.jsonl:3: .*{re.escape(reason)}"):
        load_tokenized_dataset(str(path), cache_dir=str(tmp_path / "cache"))


def test_dataset_pickles_without_copying_rows(dataset):
    import pickle

    dataset.sample(3)  # populate the lazily built views
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone.sample(3) == dataset.sample(3)
    assert np.array_equal(clone.lengths, dataset.lengths)


# ----------------------------------------------------------------------------
# Sampler


def test_sampler_same_on_every_rank_and_reshuffled_per_epoch():
    ranks = [InfiniteSampler(50, seed=7) for _ in range(4)]
    streams = [sampler.take(150) for sampler in ranks]
    assert all(np.array_equal(streams[0], stream) for stream in streams)
    epochs = streams[0].reshape(3, 50)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(50))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert np.array_equal(epochs[1], np.random.default_rng(7 + 1).permutation(50))
    assert not np.array_equal(InfiniteSampler(50, seed=8).take(50), epochs[0])


def test_sampler_state_resumes_mid_epoch_exactly():
    sampler = InfiniteSampler(30, seed=3)
    sampler.take(47)  # epoch 1, offset 17
    state = sampler.state_dict()
    assert (state["position"], state["epoch"], state["offset"]) == (47, 1, 17)
    expected = sampler.take(40)
    resumed = InfiniteSampler(30, seed=3)
    resumed.load_state_dict(state)
    assert np.array_equal(resumed.take(40), expected)
    assert np.array_equal(InfiniteSampler(30, seed=3, position=47).take(40), expected)
    with pytest.raises(ValueError, match="num_samples"):
        InfiniteSampler(31, seed=3).load_state_dict(state)


# ----------------------------------------------------------------------------
# Collation


def test_collate_packs_and_shifts_per_sample():
    samples = [([10, 11, 12, 13], [-100, -100, 12, 13]), ([20, 21, 22], [-100, 21, 22]), ([30], [30])]
    minibatch = collate_minibatch(samples)
    assert minibatch.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 30]]
    assert minibatch.labels.tolist() == [[-100, 12, 13, -100, 21, 22, -100, -100]]
    assert minibatch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert minibatch.cu_seqlens.tolist() == [0, 4, 7, 8]
    assert minibatch.cu_seqlens.dtype == torch.int32
    assert minibatch.input_ids.dtype == minibatch.labels.dtype == minibatch.position_ids.dtype == torch.int64
    assert (minibatch.max_seqlen, minibatch.num_tokens, minibatch.num_samples) == (4, 8, 3)
    assert minibatch.num_loss_counted_tokens == 4


def test_collate_dummy_counts_nothing():
    dummy = collate_minibatch([])
    assert dummy.labels.tolist() == [[IGNORE_INDEX]]
    assert (dummy.num_samples, dummy.num_loss_counted_tokens, dummy.num_tokens) == (0, 0, 1)
    assert dummy.cu_seqlens.tolist() == [0, 1] and dummy.position_ids.tolist() == [[0]]


# ----------------------------------------------------------------------------
# Loader


def take_steps(dataset, num_steps, **kwargs):
    return list(itertools.islice(make_batch_loader(dataset, **kwargs), num_steps))


LOADER = dict(batch_size=24, max_tokens_per_rank=100, seed=5, num_workers=0)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_ranks_together_cover_each_batch_exactly_once(dataset, world):
    per_rank = [take_steps(dataset, 6, rank=rank, world_size=world, **LOADER) for rank in range(world)]
    sampler = InfiniteSampler(len(dataset), seed=5)
    for step in range(6):
        batches = [steps[step] for steps in per_rank]
        drawn = sampler.take(24)
        kept = [int(i) for i in drawn if dataset.lengths[i] <= 100]
        dropped = [int(i) for i in drawn if dataset.lengths[i] > 100]
        # Same number of minibatches on every rank.
        assert len({b.num_minibatches for b in batches}) == 1
        rows = [row for b in batches for m in b.minibatches for row in rows_of(m)]
        assert sorted(rows) == sorted(kept)
        for b in batches:
            assert b.num_samples == len(kept) and b.num_dropped_samples == len(dropped)
            assert sorted(b.dropped_indices) == sorted(dropped)
            assert b.num_total_tokens == int(dataset.lengths[kept].sum())
            assert (b.start_position, b.end_position) == (24 * step, 24 * step + 24)
            assert b.epoch == 24 * step // len(dataset)
            assert all(m.num_tokens <= 100 for m in b.minibatches)
        # The loss denominator is the sum of what the ranks actually count.
        counted = sum(m.num_loss_counted_tokens for b in batches for m in b.minibatches)
        assert {b.batch_num_loss_counted_tokens for b in batches} == {counted}
        for b in batches:
            for m in b.minibatches:
                assert m.num_loss_counted_tokens == int((m.labels != IGNORE_INDEX).sum())


def test_over_long_samples_are_dropped_counted_and_logged(dataset, caplog):
    too_long = {5, 40}
    # setup_logging() turns propagation off, so listen on the toolkit's logger itself.
    logger.addHandler(caplog.handler)
    try:
        steps = take_steps(dataset, 12, rank=0, world_size=2, **LOADER)  # 288 draws: about 3 epochs
    finally:
        logger.removeHandler(caplog.handler)
    drawn = InfiniteSampler(len(dataset), seed=5).take(12 * 24)
    assert sum(b.num_dropped_samples for b in steps) == sum(int(i) in too_long for i in drawn)
    assert {i for b in steps for i in b.dropped_indices} == too_long
    for b in steps:
        assert all(len(rows_of(m)) == m.num_samples for m in b.minibatches)
        assert not too_long & {row for m in b.minibatches for row in rows_of(m)}
    assert "longer than max_tokens_per_rank=100" in caplog.text


def test_workers_give_identical_batches(dataset):
    in_process = take_steps(dataset, 5, rank=1, world_size=2, **LOADER)
    with_worker = take_steps(dataset, 5, rank=1, world_size=2, **{**LOADER, "num_workers": 1})
    two_workers = take_steps(dataset, 5, rank=1, world_size=2, **{**LOADER, "num_workers": 2})
    for a, b, c in zip(in_process, with_worker, two_workers, strict=True):
        assert_same_step(a, b)
        assert_same_step(a, c)


def test_resume_from_end_position(dataset):
    straight = take_steps(dataset, 7, rank=0, world_size=2, **LOADER)
    resumed = take_steps(dataset, 3, rank=0, world_size=2, start_position=straight[3].end_position, **LOADER)
    for a, b in zip(straight[4:], resumed, strict=True):
        assert_same_step(a, b)


def test_attention_balance_and_all_dropped_batch(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", make_rows([50, 60, 70]))
    dataset = load_tokenized_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    (step,) = take_steps(dataset, 1, batch_size=3, max_tokens_per_rank=10, rank=1, world_size=2, seed=0, num_workers=0)
    # Every sample dropped: one dummy minibatch keeps the step's shape.
    assert step.num_dropped_samples == 3 and step.num_samples == 0 and step.batch_num_loss_counted_tokens == 0
    assert step.num_minibatches == 1 and step.minibatches[0].num_samples == 0
    (step,) = take_steps(
        dataset, 1, batch_size=3, max_tokens_per_rank=100, rank=0, world_size=2, seed=0, num_workers=0,
        balance="attention",
    )  # fmt: skip
    assert step.num_samples == 3


def test_invalid_loader_arguments(dataset):
    with pytest.raises(ValueError) as error:
        make_batch_loader(dataset, batch_size=0, max_tokens_per_rank=0, rank=2, world_size=2, seed=0, balance="x")
    message = str(error.value)
    for needle in ("batch_size", "max_tokens_per_rank", "rank=2", "balance"):
        assert needle in message


def assert_same_step(a, b):
    assert a.num_minibatches == b.num_minibatches
    for field in ("batch_num_loss_counted_tokens", "num_samples", "num_dropped_samples", "num_total_tokens",
                  "start_position", "end_position", "epoch", "dropped_indices"):  # fmt: skip
        assert getattr(a, field) == getattr(b, field), field
    for x, y in zip(a.minibatches, b.minibatches, strict=True):
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert (x.max_seqlen, x.num_loss_counted_tokens, x.num_samples, x.num_tokens) == (
            y.max_seqlen, y.num_loss_counted_tokens, y.num_samples, y.num_tokens,
        )  # fmt: skip


def test_the_originals_public_packer_imports_from_sampler_and_packs_as_its_tests_ask():
    """mini_trainer's own tests import ``batch_lengths_to_minibatches`` from ``sampler`` and call it with
    positional ``(batch_lengths, max_tokens_per_rank, num_ranks, rank)``: every index lands once on one
    rank, every rank gets the same number of minibatches, none over budget."""
    from minitrainer.data.sampler import batch_lengths_to_minibatches

    assert batch_lengths_to_minibatches([], 130000, 4, 0) == []
    assert batch_lengths_to_minibatches([5000], 130000, 4, 0) == [[0]]
    assert batch_lengths_to_minibatches([5000], 130000, 4, 3) == [[-1]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 100_000, size=300).tolist()
    columns = [batch_lengths_to_minibatches(lengths, 130000, 8, rank) for rank in range(8)]
    assert len({len(column) for column in columns}) == 1
    placed = [i for column in columns for minibatch in column for i in minibatch if i != -1]
    assert sorted(placed) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in minibatch if i != -1) <= 130000 for column in columns for minibatch in column)
