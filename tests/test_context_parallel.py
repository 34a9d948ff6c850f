"""Context parallelism: the token split (properties), and attention plus a tiny model over real gloo groups.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_context_parallel.py

The distributed tests spawn 2 or 4 gloo processes and compare every rank's
output and the gradients of q, k and v (and of a tiny model's parameters)
with the unsharded computation on the whole packed row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.model.attention import REFERENCE_VARLEN, register_attention_backends, varlen_reference
from minitrainer.model.context_parallel import (CONTEXT_PARALLEL, context_parallel_attention, context_parallel_plan,
                                                document_lengths, loss_counted_tokens_per_rank, query_segments,
                                                rank_attention_costs, register_context_parallel_backend, shard_row,
                                                split_row)

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ROWS = {
    "crossing": [13, 20, 7],  # documents crossing shard boundaries
    "short": [3, 2, 4, 1, 5, 2, 3, 4, 1, 2],  # documents shorter than a shard
    "spanning": [37],  # one document over every shard (37 tokens: unequal shards for N = 4)
    "padded": [17, 9, 6],  # the last "document" is padding: positions restart, labels all IGNORE_INDEX
}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
"""atol and rtol: fp32 sums in another order differ by a few ulps of values around 4 (1.4e-6 absolute seen)."""


@st.composite
def rows(draw):
    """(document lengths, N): mixes of short documents and one long one."""
    num_ranks = draw(st.integers(min_value=1, max_value=8))
    short = draw(st.lists(st.integers(min_value=1, max_value=40), min_size=0, max_size=30))
    long = draw(st.lists(st.integers(min_value=41, max_value=3000), min_size=0, max_size=2))
    lengths = draw(st.permutations(short + long))
    return (lengths or [1]), num_ranks


@PROPERTY
@given(rows(), st.sampled_from(["attention", "tokens"]))
def test_split_holds_every_token_once_within_the_token_cap(row, balance):
    lengths, num_ranks = row
    splits = split_row(lengths, num_ranks, balance=balance)
    total = sum(lengths)
    assert len(splits) == num_ranks
    assert np.array_equal(np.sort(np.concatenate(splits)), np.arange(total))
    assert all(np.all(np.diff(index) > 0) for index in splits)  # row order kept
    assert max(index.size for index in splits) <= -(-total // num_ranks)


@PROPERTY
@given(rows())
def test_attention_balance_bounds_every_ranks_cost(row):
    """No rank carries more than its share of the row's attention cost plus one document's cost."""
    lengths, num_ranks = row
    costs = rank_attention_costs(lengths, split_row(lengths, num_ranks, balance="attention"))
    document_costs = np.asarray(lengths) * (np.asarray(lengths) + 1) // 2
    target = document_costs.sum() / num_ranks
    assert costs.sum() == document_costs.sum()
    assert costs.max() <= target + document_costs.max()


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("short", [[], [5, 3, 8, 1, 2]])
def test_one_long_document_is_split_head_tail_evenly(num_ranks, short):
    """A long document among short ones: every rank gets its tokens' share and about 1/N of the cost."""
    lengths = [4000] + short
    splits = split_row(lengths, num_ranks)
    costs = rank_attention_costs(lengths, splits)
    target = sum(n * (n + 1) // 2 for n in lengths) / num_ranks
    assert costs.max() <= 1.01 * target
    head = splits[0][splits[0] < 4000]  # rank 0 holds the first and the last chunk of the document
    assert head[0] == 0 and head[-1] == 3999


def test_the_module_docstrings_example():
    rank_0, rank_1 = split_row([16, 4, 4], 2)
    assert rank_0.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19]
    assert rank_1.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert rank_attention_costs([16, 4, 4], [rank_0, rank_1]).tolist() == [78, 78]


def test_short_documents_stay_whole():
    lengths = [10, 10, 10, 10]
    splits = split_row(lengths, 2)
    starts = np.cumsum([0] + lengths)
    for index in splits:
        documents = set(np.searchsorted(starts, index, side="right") - 1)
        assert sum(lengths[d] for d in documents) == index.size  # only whole documents


@PROPERTY
@given(rows(), st.data())
def test_segments_give_each_query_its_documents_prefix(row, data):
    """Query segments + key rows = brute force: a token attends its document from its start up to itself."""
    lengths, num_ranks = row
    splits = split_row(lengths, num_ranks)
    rank = data.draw(st.integers(min_value=0, max_value=num_ranks - 1))
    segments = query_segments(lengths, splits, rank)
    starts = np.repeat(np.cumsum([0] + lengths)[:-1], lengths)
    local = splits[rank]
    cu_q, cu_k = segments.cu_seqlens_q, segments.cu_seqlens_k
    assert cu_q[-1] == local.size and cu_k[-1] == segments.key_index.size
    for s in range(cu_q.size - 1):
        queries = local[cu_q[s]:cu_q[s + 1]]
        keys = segments.key_index[cu_k[s]:cu_k[s + 1]]
        offset = keys.size - queries.size  # bottom-right causal
        for j, token in enumerate(queries):
            assert np.array_equal(keys[: j + offset + 1], np.arange(starts[token], token + 1))
    owner = np.concatenate([np.full(index.size, r) for r, index in enumerate(splits)])
    place = np.concatenate([np.arange(index.size) for index in splits])
    order = np.argsort(np.concatenate(splits))
    expected_slot = (owner * segments.max_local + place)[order][segments.key_index]
    assert np.array_equal(segments.key_slot, expected_slot)


def test_loss_counts_per_rank_add_up():
    labels = np.array([5, 6, IGNORE_INDEX, 7, IGNORE_INDEX, IGNORE_INDEX, 8, 9, IGNORE_INDEX])
    splits = split_row([3, 2, 4], 2)
    counts = loss_counted_tokens_per_rank(labels, splits)
    assert sum(counts) == int((labels != IGNORE_INDEX).sum())


def test_a_row_shorter_than_the_group_is_refused():
    row = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="pad it to at least 2 tokens"):
        shard_row(row, row, row, rank=0, num_ranks=2)


def test_document_lengths_reads_positions():
    assert document_lengths([0, 1, 2, 0, 1, 0]).tolist() == [3, 2, 1]
    with pytest.raises(ValueError, match="first position_id"):
        document_lengths([1, 2])


# ----------------------------------------------------------------------------
# Real gloo groups


def _spawn(worker, num_ranks: int, tmp_path, *args) -> None:
    """Run ``worker(rank, num_ranks, store, *args)`` in ``num_ranks`` processes; a failure in any raises here."""
    mp.spawn(worker, args=(num_ranks, str(tmp_path / "store"), *args), nprocs=num_ranks)


def _join(rank: int, num_ranks: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=num_ranks)


def _packed_qkv(lengths, dtype, *, value_dim: int):
    generator = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    make = (lambda heads, dim: torch.randn(total, heads, dim, dtype=dtype, generator=generator))
    # GQA: 4 query heads over 2 key/value heads; the upstream gradient makes every output count.
    return make(4, 8), make(2, 8), make(2, value_dim), make(4, value_dim)


def _check_attention(rank: int, num_ranks: int) -> None:
    for name, lengths in ROWS.items():
        for dtype in (torch.float64, torch.float32):
            for value_dim, split in ((8, "attention"), (8, "tokens"), (6, "random")):
                query, key, value, upstream = _packed_qkv(lengths, dtype, value_dim=value_dim)
                # Unsharded reference: attention.py's per-document causal SDPA over the whole row.
                full = [t.clone().requires_grad_() for t in (query, key, value)]
                cu_seqlens = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
                expected = varlen_reference(*(t.transpose(0, 1).unsqueeze(0) for t in full), cu_seqlens,
                                            scale=0.3).squeeze(0).transpose(0, 1)
                (expected * upstream).sum().backward()
                if split == "random":  # any assignment of tokens to ranks works, not only split_row's
                    owner = np.random.default_rng(len(lengths)).integers(0, num_ranks, size=sum(lengths))
                    owner[:num_ranks] = np.arange(num_ranks)
                    splits = [np.flatnonzero(owner == r) for r in range(num_ranks)]
                else:
                    splits = split_row(lengths, num_ranks, balance=split)
                index = torch.from_numpy(splits[rank])
                local = [t[index].clone().requires_grad_() for t in (query, key, value)]
                plan = context_parallel_plan(lengths, splits, rank=rank)
                out = context_parallel_attention(*local, plan, scale=0.3)
                (out * upstream[index]).sum().backward()
                where = f"{name} N={num_ranks} rank {rank} {dtype} {split}"
                tolerance = TOLERANCE[dtype]
                torch.testing.assert_close(out, expected[index], atol=tolerance, rtol=tolerance,
                                           msg=lambda detail: f"{where}: {detail}")
                for label, mine, reference in zip("qkv", local, full):
                    torch.testing.assert_close(mine.grad, reference.grad[index], atol=tolerance, rtol=tolerance,
                                               msg=lambda detail: f"grad {label}: {where}: {detail}")


def _check_tiny_model(rank: int, num_ranks: int, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    register_attention_backends()
    register_context_parallel_backend()
    lengths = [11, 19, 3, 6]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 64, (1, sum(lengths)), generator=generator)
    labels = torch.cat([torch.cat([input_ids[0, start + 1:start + n], torch.tensor([IGNORE_INDEX])])
                        for start, n in zip(np.cumsum([0] + lengths), lengths)]).unsqueeze(0)
    labels[0, 2:5] = IGNORE_INDEX  # some unlearned positions, as prompts are
    labels[0, -6:] = IGNORE_INDEX  # the last "document" is padding
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)

    def loss_and_grads(attn_implementation, input_ids, labels, position_ids, **kwargs):
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation,
                                                     dtype=torch.float64)
        logits = model(input_ids=input_ids, position_ids=position_ids, **kwargs).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    expected_loss, expected_grads = loss_and_grads(REFERENCE_VARLEN, input_ids, labels, position_ids)
    shard = shard_row(input_ids, labels, position_ids, rank=rank, num_ranks=num_ranks)
    assert sum(shard.group_loss_counted_tokens) == int((labels != IGNORE_INDEX).sum())
    loss, grads = loss_and_grads(CONTEXT_PARALLEL, shard.input_ids, shard.labels, shard.position_ids,
                                 context_parallel_plan=shard.plan)
    dist.all_reduce(loss)  # each rank's summed CE over its own learned tokens
    for grad in grads:
        dist.all_reduce(grad)
    torch.testing.assert_close(loss, expected_loss, atol=1e-10, rtol=0)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-10, rtol=0)


def _worker(rank: int, num_ranks: int, store: str, model_dir: str) -> None:
    _join(rank, num_ranks, store)
    _check_attention(rank, num_ranks)
    _check_tiny_model(rank, num_ranks, model_dir)
    dist.destroy_process_group()


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_sharded_attention_and_tiny_model_equal_the_unsharded_row(num_ranks, tmp_path):
    """One spawn per group size (process start-up dominates on a small CPU), two checks:

    * attention alone (``ROWS`` x fp64/fp32 x three splits, GQA, Dv != D): each rank's output
      and the gradients of its q, k and v equal the unsharded reference's rows;
    * a tiny Qwen2 (fp64) through the registered ``context_parallel`` backend: shifted labels
      split with the tokens, the per-rank summed CE and the parameter gradients, summed over
      the group, equal the unsharded row's (``reference_varlen``).
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    _spawn(_worker, num_ranks, tmp_path, str(tmp_path / "model"))
