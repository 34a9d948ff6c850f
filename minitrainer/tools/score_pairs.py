"""Score preference pairs with a trained reward model and print its accuracy: one JSON line on stdout.

    minitrainer-score-pairs --model out/hf_format/samples_4096 --data prefs_tkns
    python -m minitrainer.tools.score_pairs --model out/hf_format/samples_4096 --data held_out.jsonl \\
        --output scores.jsonl --batch-size 16
    # {"pairs": 200, "accuracy": 0.73, "margin": 0.412, "mean_reward": -0.013, "model": ..., "data": ..., ...}

``--model`` is a ``--objective reward`` export: a Hugging Face ``*ForSequenceClassification`` folder with one
label (a merged LoRA export is one such folder; the ``adapter/`` beside its weights is not read), or an
adapter-only LoRA export: a peft folder (``adapter_config.json``, task type ``SEQ_CLS``, the score head in its
``modules_to_save``), loaded on its base with ``peft.AutoPeftModelForSequenceClassification`` and merged.
Anything else is refused in one line (a causal LM, a classifier with other than one label).

``--data`` is a file of preference pairs: tokenized (``process_data.py``'s output folder or jsonl, or a
``.parquet`` / ``.arrow`` table of its columns: ``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``,
``rejected_labels``), or raw pairs in any format ``process_data.py`` reads, tokenized first with the model
folder's own tokenizer and chat template (the adapter's base's when the adapter folder has none) exactly as
``train.py --data-path`` tokenizes raw data: ``data/cache.py``'s ``tokenize_once`` into a cache folder under
``--tokenized-data-dir``, reused by the next run (the raw-data flags are ``train.py``'s). A file of SFT rows
or of unpaired feedback rows is refused.

Each side is scored as training reads it (``model/score_head.py``): cut right after its last learned token
(the last label other than -100 past the first token; the template's tail after the end of turn is never
read) and run through the model's own forward, ``model(input_ids, attention_mask).logits[:, 0]``.
``--batch-size 1`` (the default) runs each side alone, unpadded; a larger batch right-pads sides of similar
length with ``config.pad_token_id``, where transformers' pooling reads each row's last non-pad token (a
config with no pad token is refused above batch size 1). A side whose last token IS the pad token would be
pooled at an earlier token, at any batch size: such sides are scored alone through ``inputs_embeds`` (which
transformers pools at the last position, as training reads it), with a note on stderr.

Printed at the end, on stdout: ``pairs`` (those scored), ``accuracy`` (the fraction with chosen > rejected,
a tie counting wrong, as TRL counts it), ``margin`` (the mean of chosen - rejected), ``mean_reward`` (the
mean of every scored side), ``unscored`` and ``unscored_rows`` (pairs with a side that learns no token:
counted and named, never dropped unseen), ``model``, ``data``, ``device``, ``dtype``; a human line on
stderr. ``--output FILE.jsonl`` writes one line per pair, ``{"row", "chosen", "rejected", "margin"}``
(``row``: the pair's 0-based index in the tokenized file; an unscored pair has null scores and its reason).
``--dtype auto`` is the checkpoint's own dtype on a GPU and float32 on CPU.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.log import logger, setup_logging
from minitrainer.common.refusals import collect_errors
from minitrainer.data.tokenizing_flags import tokenizing_field

DTYPES = ("auto", "float32", "bfloat16", "float16")
ADAPTER_CONFIG = "adapter_config.json"
SHOWN_ROWS = 10
"""Unscored rows named in the human line (the JSON line names them all)."""


@dataclass
class ScorePairsConfig:
    model: str = config_field(help="the reward model: an export folder (*ForSequenceClassification, one label) "
                                   "or a peft adapter folder of one")
    data: str = config_field(help="preference pairs: tokenized (process_data.py's folder, jsonl, parquet or "
                                  "arrow) or raw, tokenized with --model's tokenizer")
    output: str | None = config_field(None, help="also write one JSON line per pair here: row, chosen, "
                                                 "rejected, margin")
    batch_size: int = config_field(1, help="sequences per forward; above 1, right-padded with the config's "
                                           "pad_token_id")
    device: str | None = config_field(None, help="torch device (default: cuda when a GPU is visible, else cpu)")
    dtype: str = config_field("auto", choices=DTYPES, help="the weights' dtype; auto: the checkpoint's own on "
                                                           "a GPU, float32 on CPU")
    # Raw data: train.py's flags of the same names (data/tokenizing_flags.py).
    tokenized_data_dir: str | None = config_field(
        None, help="raw data: the cache of its tokens (default: in the temp folder); a run's "
                   "<--output-dir>/tokenized_data shares it with train.py")
    chat_template: str | None = tokenizing_field("chat_template", run=True)
    end_of_turn_token: str | None = tokenizing_field("end_of_turn_token", run=True)
    mask_reasoning: bool = tokenizing_field("mask_reasoning", run=True)
    max_sample_num_tokens: int = tokenizing_field("max_sample_num_tokens", run=True)
    split_long_text: bool = tokenizing_field("split_long_text", run=True)
    input_format: str = tokenizing_field("input_format", run=True)
    columns: str | None = tokenizing_field("columns", run=True)
    data_split: str = tokenizing_field("data_split", run=True)
    data_subset: str | None = tokenizing_field("data_subset", run=True)
    text_sample_by: str = tokenizing_field("text_sample_by", run=True)
    sharegpt_roles: str | None = tokenizing_field("sharegpt_roles", run=True)

    def __post_init__(self) -> None:
        errors = []
        if self.batch_size < 1:
            errors.append(f"--batch-size must be positive, got {self.batch_size}")
        if self.dtype not in DTYPES:
            errors.append(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        collect_errors(errors)


# ---------------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class ModelFolder:
    """What ``--model`` holds, read from its config files alone (before any weight is loaded)."""

    path: Path
    adapter_base: str | None
    """An adapter-only folder's base model (``base_model_name_or_path``); None for a whole model."""
    tokenizer: str
    """Where its tokenizer is: the folder, or an adapter's base when the folder has none."""
    model_config: object = None
    """A whole model's config (an adapter's base is read when it loads)."""


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()


def model_folder(path: str) -> ModelFolder:
    """``--model`` judged from its config files: a one-label sequence classifier or an adapter of one.

    Raises:
        ValueError: one line saying what the folder is instead and what to do.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"--model {path}: no such folder (give the Hugging Face export folder of a reward model)")
    if (folder / ADAPTER_CONFIG).is_file():
        try:
            adapter = json.loads((folder / ADAPTER_CONFIG).read_text())
        except ValueError as err:
            raise ValueError(f"{folder / ADAPTER_CONFIG}: not JSON ({err})") from None
        task = adapter.get("task_type")
        if task != "SEQ_CLS":
            raise ValueError(f"{path} is a peft adapter of task type {task or 'unset'} "
                             f"({adapter.get('peft_type') or 'peft'}), not of a reward model (SEQ_CLS): train one "
                             "with --objective reward")
        base = adapter.get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{path}: {ADAPTER_CONFIG} names no base_model_name_or_path, so the adapter has no "
                             "model to load onto")
        return ModelFolder(folder, str(base), str(folder) if _has_tokenizer(folder) else str(base))
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {path}: no config.json, so it is no Hugging Face model folder (give a "
                         "--objective reward export: a samples_* folder of <output-dir>/hf_format)")
    from transformers import AutoConfig

    from minitrainer.model.heads import sequence_classification_class

    try:
        model_config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {folder / 'config.json'}: {str(err).splitlines()[0]}") from None
    found = sequence_classification_class(model_config)
    if found is None:
        architecture = (getattr(model_config, "architectures", None) or [model_config.model_type])[0]
        what = (f"a causal LM ({architecture})" if architecture.endswith("ForCausalLM")
                else f"a {architecture} checkpoint")
        raise ValueError(f"{path} is {what}, not a reward model: train one with --objective reward")
    if model_config.num_labels != 1:
        raise ValueError(f"{path} is a {found} with {model_config.num_labels} labels, not a reward model (one "
                         "label, one score per sequence): train one with --objective reward")
    return ModelFolder(folder, None, str(folder), model_config)


def resolve_device(name: str | None):
    """``--device``'s torch device: cuda when a GPU is visible, else cpu, by default."""
    import torch

    from minitrainer.common.device import device_type

    if name is None:
        return torch.device(device_type())
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r} is no torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no GPU is visible here; use --device cpu")
    return device


def load_dtype(name: str, device):
    """``--dtype`` as ``from_pretrained`` takes it: ``"auto"`` (the checkpoint's own) on a GPU, float32 on CPU."""
    import torch

    if name == "auto":
        return "auto" if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model(folder: ModelFolder, *, device, dtype: str):
    """The reward model, in eval mode on ``device``: the folder's ``*ForSequenceClassification``, or an adapter
    folder's base with the adapter loaded and merged into it.

    Raises:
        ValueError: one line when transformers or peft cannot load it.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    # Loading an adapter's base warns that its score head is new: the adapter's copy replaces it next.
    hf_logging.set_verbosity_error()
    try:
        if folder.adapter_base is None:
            from transformers import AutoModelForSequenceClassification

            model = AutoModelForSequenceClassification.from_pretrained(folder.path, dtype=load_dtype(dtype, device))
        else:
            from peft import AutoPeftModelForSequenceClassification

            model = AutoPeftModelForSequenceClassification.from_pretrained(
                folder.path, num_labels=1, dtype=load_dtype(dtype, device)).merge_and_unload()
    except (OSError, ValueError, RuntimeError) as err:
        where = "" if folder.adapter_base is None else f" on its base {folder.adapter_base}"
        raise ValueError(f"cannot load {folder.path}{where}: {str(err).strip().splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.num_labels != 1:
        raise ValueError(f"{folder.path} scores {model.config.num_labels} labels, not one: not a reward model")
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------------
# The pairs


def tokenized_table(path: Path):
    """A ``.parquet`` or ``.arrow`` file of ``process_data.py``'s columns, opened as the sampler opens its jsonl
    (``sampler.load_tokenized_dataset``); None when the table holds no tokenized column (raw rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        names = pq.read_schema(path).names
    elif suffix == ".arrow":
        with pa.memory_map(str(path)) as source:
            try:
                names = pa.ipc.open_stream(source).schema.names
            except pa.ArrowInvalid:
                names = pa.ipc.open_file(source).schema.names
    else:
        return None
    if not {"input_ids", "chosen_input_ids", "rejected_input_ids"} & set(names):
        return None
    import datasets

    from minitrainer.data.preference import PreferenceDataset, is_preference_table
    from minitrainer.data.sampler import TokenizedDataset

    dataset = datasets.load_dataset(suffix[1:], data_files=str(path), split="train")
    table = dataset.data.table
    if is_preference_table(table):
        return PreferenceDataset(str(path), table, lambda side: TokenizedDataset(str(path), side, dataset))
    return TokenizedDataset(str(path), table, dataset)


def _not_pairs(data: str, dataset) -> str:
    """The refusal of a tokenized file that holds no pairs."""
    from minitrainer.data.unpaired import UnpairedDataset

    if isinstance(dataset, UnpairedDataset):
        return (f"{data} holds unpaired feedback rows (one reply with a desirable label each), not preference "
                "pairs: a reward model is scored on pairs, chosen against rejected")
    return (f"{data} holds SFT rows (input_ids and labels), not preference pairs: a reward model is scored on "
            "pairs, chosen against rejected (rows with chosen and rejected replies)")


def raw_pairs_folder(config: ScorePairsConfig, tokenizer: str) -> Path:
    """Raw ``--data`` tokenized with ``tokenizer`` as ``train.py --data-path`` tokenizes it: its cache folder
    under ``--tokenized-data-dir``, made now unless a whole one exists (``data/cache.py``)."""
    from minitrainer.data import cache
    from minitrainer.data.process_data import OutputPaths, check_run, tokenizing_config

    cache_root = config.tokenized_data_dir or str(Path(tempfile.gettempdir()) / "minitrainer-tokenized_data")
    settings = SimpleNamespace(**asdict(config), model_name_or_path=tokenizer)
    # No masking preview on stderr: the scores are this run's output (it leaves the cache's bytes as they are).
    process_config = tokenizing_config(settings, config.data, output_dir=cache_root, num_printed_samples=0)
    # What the rows are, from the first ones, before a long tokenizing run of a file this tool would refuse.
    _, _, scan = check_run(process_config, OutputPaths.from_config(process_config))
    if scan.kind == "unpaired":
        raise ValueError(f"{config.data} holds unpaired feedback rows (prompt, completion and a label), not "
                         "preference pairs: a reward model is scored on pairs, chosen against rejected")
    if scan.kind != "preference":
        raise ValueError(f"{config.data} holds SFT rows, not preference pairs (its first convertible row has no "
                         "'chosen' and 'rejected'): a reward model is scored on pairs, chosen against rejected")
    return cache.tokenize_once(process_config)


def load_pairs(config: ScorePairsConfig, tokenizer: str):
    """``--data`` as a ``PreferenceDataset``: opened as the sampler opens tokenized pairs, raw pairs tokenized
    first (``raw_pairs_folder``).

    Raises:
        ValueError: one line: unreadable data, or rows that are not pairs.
    """
    from minitrainer.data import cache
    from minitrainer.data.preference import PreferenceDataset
    from minitrainer.data.sampler import load_tokenized_dataset
    from minitrainer.data.sources import is_table

    path = Path(config.data)
    dataset = None
    if cache.is_tokenized(path):
        dataset = load_tokenized_dataset(str(path))
    elif path.is_file() and is_table(path):
        dataset = tokenized_table(path)
    if dataset is None:
        folder = raw_pairs_folder(config, tokenizer)
        summary = json.loads((folder / "summary.json").read_text())
        if summary.get("num_rejected"):
            logger.warning("%s: %d rows were not tokenized (each listed with its reason in %s); rows are numbered "
                           "among the %d pairs kept, in input order", config.data, summary["num_rejected"],
                           folder / "rejected.jsonl", summary["num_written"])
        dataset = load_tokenized_dataset(str(folder))
    if not isinstance(dataset, PreferenceDataset):
        raise ValueError(_not_pairs(config.data, dataset))
    return dataset


def scored_part(input_ids: np.ndarray, labels: np.ndarray) -> np.ndarray | None:
    """A side cut right after its last learned token (labels unshifted: the last index past the first whose label
    is not -100, as the trainer's shifted targets count them); None when it learns no token."""
    from minitrainer.model.score_head import last_learned_index

    last = last_learned_index(labels)
    return None if last is None else input_ids[:last + 1]


# ---------------------------------------------------------------------------------------------------
# Scoring


def score_sequences(model, sequences: list[np.ndarray], *, batch_size: int, device) -> tuple[np.ndarray, list[int]]:
    """The model's own score of each sequence (float64 ``[len(sequences)]``), and the indices of those scored
    alone through ``inputs_embeds`` because their last token is the pad token (module docstring).

    ``batch_size`` sequences of similar length share a forward, right-padded with ``config.pad_token_id``.
    """
    import torch

    pad_id = getattr(model.config.get_text_config(), "pad_token_id", None)
    scores = np.zeros(len(sequences), np.float64)
    ends_in_pad = [i for i, ids in enumerate(sequences) if pad_id is not None and int(ids[-1]) == pad_id]
    alone = set(ends_in_pad)
    order = sorted((i for i in range(len(sequences)) if i not in alone), key=lambda i: len(sequences[i]))
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            width = max(len(sequences[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), pad_id if pad_id is not None else 0, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                input_ids[row, :len(sequences[i])] = torch.from_numpy(np.array(sequences[i], np.int64))
                attention_mask[row, :len(sequences[i])] = 1
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            scores[chunk] = logits[:, 0].float().cpu().numpy()
        if ends_in_pad:
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # "will not detect padding tokens in inputs_embeds": none are there
            try:
                embeddings = model.get_input_embeddings()
                for i in ends_in_pad:
                    input_ids = torch.from_numpy(np.array(sequences[i], np.int64)).unsqueeze(0).to(device)
                    logits = model(inputs_embeds=embeddings(input_ids),
                                   attention_mask=torch.ones_like(input_ids)).logits
                    scores[i] = float(logits[0, 0].float())
            finally:
                hf_logging.set_verbosity(verbosity)
    return scores, ends_in_pad


@dataclass(frozen=True)
class PairScores:
    summary: dict
    """The JSON line printed at the end (module docstring)."""
    rows: list[dict]
    """One record per pair, as ``--output`` writes them."""


def score_pairs(config: ScorePairsConfig) -> PairScores:
    """Score every pair of ``config.data`` with ``config.model``; write ``--output``; return the summary and rows.

    Raises:
        ValueError: one line a person can act on (module docstring).
    """
    folder = model_folder(config.model)
    device = resolve_device(config.device)
    if folder.model_config is not None:  # before a long tokenizing run; an adapter's base is checked once loaded
        _check_padding(config, folder.model_config)
    dataset = load_pairs(config, folder.tokenizer)
    model = load_model(folder, device=device, dtype=config.dtype)
    _check_padding(config, model.config)
    pad_id = getattr(model.config.get_text_config(), "pad_token_id", None)

    sequences, owners, unscored = [], [], {}
    for row in range(len(dataset)):
        parts = [scored_part(ids, labels) for ids, labels in dataset.sequences(row)]
        empty = [side for side, part in zip(("chosen", "rejected"), parts) if part is None]
        if empty:
            unscored[row] = "both sides learn no token" if len(empty) == 2 else f"the {empty[0]} side learns no token"
            continue
        sequences += parts
        owners.append(row)
    if not owners:
        raise ValueError(f"no pair of {config.data} can be scored: every pair has a side that learns no token "
                         f"(all labels -100), e.g. row {next(iter(unscored))}")
    scores, ends_in_pad = score_sequences(model, sequences, batch_size=config.batch_size, device=device)
    if ends_in_pad:
        rows_named = sorted({owners[i // 2] for i in ends_in_pad})
        logger.warning("note: %d sides end in the pad token (id %d), where transformers' pooling would read an "
                       "earlier token: each was scored alone at its last token, as training reads it (rows %s); a "
                       "pad token of its own avoids it", len(ends_in_pad), pad_id, _rows_text(rows_named))
    chosen, rejected = scores[0::2], scores[1::2]
    by_row = {row: (float(c), float(r)) for row, c, r in zip(owners, chosen, rejected)}
    rows = [{"row": row, "chosen": by_row[row][0], "rejected": by_row[row][1],
             "margin": by_row[row][0] - by_row[row][1]} if row in by_row else
            {"row": row, "chosen": None, "rejected": None, "margin": None, "unscored": unscored[row]}
            for row in range(len(dataset))]
    if config.output:
        output = Path(config.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        with output.open("w") as f:
            f.writelines(json.dumps(record) + "\n" for record in rows)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    summary = {"pairs": len(owners), "accuracy": float(np.mean(chosen > rejected)),
               "margin": float(np.mean(chosen - rejected)), "mean_reward": float(np.mean(scores)),
               "unscored": len(unscored), "unscored_rows": sorted(unscored), "model": config.model,
               "data": config.data, "device": str(device), "dtype": dtype}
    return PairScores(summary, rows)


def _check_padding(config: ScorePairsConfig, model_config) -> None:
    if config.batch_size > 1 and getattr(model_config.get_text_config(), "pad_token_id", None) is None:
        raise ValueError(f"--batch-size {config.batch_size} pads sides to one length, but {config.model}'s config "
                         "has no pad_token_id to tell padding from tokens: use --batch-size 1, or set pad_token_id "
                         "in its config.json")


def _rows_text(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:SHOWN_ROWS]))
    return shown + (f", ... ({len(rows)} in all)" if len(rows) > SHOWN_ROWS else "")


def human_line(summary: dict, unscored_reasons: list[str]) -> str:
    line = (f"{summary['pairs']} pairs of {summary['data']} scored by {summary['model']} ({summary['device']}, "
            f"{summary['dtype']}): accuracy {summary['accuracy']:.4f} (chosen above rejected), margin "
            f"{summary['margin']:.4f}, mean reward {summary['mean_reward']:.4f}")
    if summary["unscored"]:
        reasons = ", ".join(sorted(set(unscored_reasons)))
        line += (f"; {summary['unscored']} pairs not scored ({reasons}): rows "
                 f"{_rows_text(summary['unscored_rows'])}")
    return line


def main(argv: list[str] | None = None, *, prog: str = "score_pairs.py") -> dict:
    """Parse ``argv``, score, print the JSON line on stdout and the human line on stderr; return the summary."""
    config = parse_config(ScorePairsConfig, argv, description=__doc__.split("\n\n")[0])
    setup_logging()  # raw data: the tokenizing run's lines, as train.py shows them; the notes
    try:
        result = score_pairs(config)
    except ValueError as err:
        raise SystemExit(f"{prog}: error: {err}") from None
    print(json.dumps(result.summary), flush=True)
    reasons = [record["unscored"] for record in result.rows if record["chosen"] is None]
    print(human_line(result.summary, reasons), file=sys.stderr, flush=True)
    return result.summary


def cli() -> None:
    """The command line (``python -m minitrainer.tools.score_pairs``, ``minitrainer-score-pairs``): ``main``."""
    main(prog=Path(sys.argv[0]).name)


if __name__ == "__main__":
    cli()
