"""Plain-string prompt/completion rows on real BPE tokenizers: the completion starts where the tokens of the
prompt alone and of prompt + completion diverge, as TRL's ``SFTTrainer`` decides (``common_prefix_length``),
so a token that merges across the boundary (``"... is " + "Paris."`` -> ``' Paris'``) is learned, not masked.
The comparison with TRL itself runs in a venv of its own (``fixtures/trl_venv.py``, built once).

    .venv/bin/python -m pytest -q tests/test_trl_boundary.py
"""

from __future__ import annotations

import json

import pytest

from fixtures.real_templates import TokenizerUnavailable, tokenizer_dir
from minitrainer.common.labels import IGNORE_INDEX
from minitrainer.data.process_data import ProcessDataConfig, process_data

ROWS = [
    {"prompt": "The capital of France is ", "completion": "Paris."},
    {"prompt": "The capital of France is", "completion": " Paris."},
    {"prompt": "Translate to German: good morning\n", "completion": "Guten Morgen"},
    {"prompt": "def add(a, b):\n    return a +", "completion": " b\n"},
    {"prompt": "Count: 12", "completion": "345"},
    {"prompt": "Q: 2+2? A: ", "completion": " 4"},
    {"prompt": "", "completion": "Only a completion."},
]
TOKENIZERS = ["qwen3", "llama3_1"]


@pytest.fixture(scope="module", params=TOKENIZERS)
def real_tokenizer(request):
    try:
        return request.param, tokenizer_dir(request.param)
    except TokenizerUnavailable as err:
        pytest.skip(str(err))


def _ours(tmp_path, model) -> list[dict]:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    summary = process_data(ProcessDataConfig(input_file=str(tmp_path / "rows.jsonl"), output_dir=str(tmp_path / "out"),
                                             model_name_or_path=str(model), num_proc=1, num_printed_samples=0))
    assert summary["num_written"] == len(ROWS) and summary["rows_by_format"] == {"prompt_completion": len(ROWS)}
    return [json.loads(line) for line in (tmp_path / "out" / "data.jsonl").read_text().splitlines()]


def test_a_token_merging_across_the_boundary_is_learned(tmp_path, real_tokenizer):
    from transformers import AutoTokenizer

    _, model = real_tokenizer
    tok = AutoTokenizer.from_pretrained(model)
    data = _ours(tmp_path, model)
    learned = [tok.decode([t for t in row["labels"] if t != IGNORE_INDEX]) for row in data]
    # "is " + "Paris.": ' Paris' is one token of the whole text; it is the completion's, learned whole.
    assert data[0]["input_ids"] == data[1]["input_ids"] and data[0]["labels"] == data[1]["labels"]
    assert learned[0] == learned[1] == " Paris." + tok.eos_token
    for row, out in zip(ROWS, data):
        prompt_ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        whole = tok(row["prompt"] + row["completion"], add_special_tokens=False)["input_ids"]
        first = next(i for i, (a, b) in enumerate(zip(prompt_ids + [None], whole + [None])) if a != b)
        assert out["input_ids"] == whole + [tok.eos_token_id]
        assert out["labels"] == [IGNORE_INDEX] * first + out["input_ids"][first:]


# Run by the TRL venv: SFTTrainer's own data preparation of the rows (completion_only_loss, as for any
# prompt/completion dataset; bench/bench_peer_trl.py's sft_prepare), its input_ids and labels printed as JSON.
TRL_SCRIPT = r"""
import json, sys
import datasets, trl
from transformers import AutoTokenizer
from bench.bench_peer_trl import sft_prepare

rows, model, out = json.loads(open(sys.argv[1]).read()), sys.argv[2], sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(model)
prepared = sft_prepare(datasets.Dataset.from_list(rows), tokenizer, output_dir=out, chat_template=None,
                       assistant_only_loss=False, completion_only_loss=True, num_proc=None)
print(json.dumps({"trl": trl.__version__, "bos_token_id": tokenizer.bos_token_id,
                  "rows": [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in prepared]}))
"""


def test_labels_equal_trls_sft_preparation(tmp_path, real_tokenizer):
    from fixtures.trl_venv import TRL_VERSION, run_in_trl_venv

    name, model = real_tokenizer
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    result = run_in_trl_venv(TRL_SCRIPT, str(tmp_path / "rows.json"), str(model), str(tmp_path / "trl"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    assert theirs["trl"] == TRL_VERSION
    for row, ours, trl_row in zip(ROWS, _ours(tmp_path, model), theirs["rows"], strict=True):
        ids, labels = trl_row["input_ids"], trl_row["labels"]
        if ids[:1] == [theirs["bos_token_id"]] and ours["input_ids"][:1] != ids[:1]:
            # TRL tokenizes plain text with the tokenizer's special tokens (Llama's BOS), masked as prompt;
            # plain strings here take none, as text rows always did (docs/data.md).
            ids, labels = ids[1:], labels[1:]
        assert (ours["input_ids"], ours["labels"]) == (ids, labels), (name, row)
