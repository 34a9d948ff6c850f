"""Sweep: every causal LM transformers ships, one packed 2-rank step each, against the model's own loss.

    python -m bench.bench_architectures                              # all of MODEL_FOR_CAUSAL_LM_MAPPING (CPU)
    python -m bench.bench_architectures --families llama,deepseek_v3,olmo_hybrid
    python -m bench.bench_architectures --nproc-per-node 1 --timeout 600
    python -m bench.bench_architectures --mapping image-text-to-text  # every image-text-to-text checkpoint

``--mapping image-text-to-text`` sweeps ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING`` instead: each
checkpoint is built whole and tiny (``fixtures.tiny_configs.tiny_multimodal_config``: text and
vision/audio towers shrunk), trained on text (its language model; ``multimodal.py``) and compared
with its own text forward; the export must hold every tensor of the source, the non-text ones
bit-identical, in the same class (else the row is ``wrong``). Its table has its own markers.

For each ``model_type`` of ``transformers.MODEL_FOR_CAUSAL_LM_MAPPING``:

1. build it tiny from its own config (``fixtures.tiny_configs.tiny_config``: every
   size shrunk, one layer of each kind kept) with random weights and the
   test chatml tokenizer, saved and loaded like any checkpoint;
   encoder-decoder entries are out of scope, and a config the generic
   shrinker cannot make consistent, or not small (``MAX_TINY_PARAMETERS``:
   a sub-model such as a vision or audio encoder kept its full size), is
   listed as "not built" with the reason;
2. train one step through the CLI's ``train.main`` under
   ``torchrun --nproc-per-node=2`` (the start-up self-check on, a token
   budget that forces several packed minibatches per rank), the same flags as
   ``tests/test_architectures.py`` (``fixtures.architectures.matrix_args``); all families run in one
   torchrun job (``fixtures/matrix_train.py``) so start-up is paid once, and a family that
   crashes the job is recorded and the rest go on in a new job;
3. compare the logged step-1 loss with the model's own
   ``forward(input_ids, labels=...)``, unpacked, one sample at a time.

``seconds`` is the family's build time plus the job's mean time per run.
Result per family: ``exact`` (relative error <= 1e-5), ``wrong`` (trained,
but not on its own loss), ``refused`` (the trainer stopped it at start-up
with a one-line reason), ``crash`` (anything else: a traceback), or
``not built`` / ``out of scope`` / ``no reference`` (the model's own
forward fails on the tiny config, so there is nothing to compare with). Writes ``bench/architectures_results.json``
(the families swept) and the table in ``docs/architectures.md`` (between its
``sweep`` markers): a sweep of some families replaces their rows only.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fixtures.architectures import PREPROCESSOR_CONFIG, export_differs, matrix_args, reference_step_one
from fixtures.e2e import ROOT, read_metrics, torchrun, write_tokenized_jsonl
from fixtures.matrix_train import RUN_MARKER
from fixtures.tiny_configs import tiny_config, tiny_multimodal_config
from minitrainer.tools.tiny_model import build_tiny_model

EXACT_RTOL = 1e-5
BUILD_SECONDS = 60
MAX_TINY_PARAMETERS = 100_000_000
"""16 bytes each in fp32 (weights, gradients, two AdamW moments): 1.6 GB per rank unsharded, what one sweep process
may hold on a shared machine. Tiny configs hold well under 20M; a config over this kept a sub-model full size."""
DOC = ROOT / "docs" / "architectures.md"
BEGIN, END = "<!-- sweep table: begin -->", "<!-- sweep table: end -->"
MULTIMODAL_BEGIN, MULTIMODAL_END = "<!-- multimodal sweep table: begin -->", "<!-- multimodal sweep table: end -->"
MAPPINGS = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING", "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING"}


def build(model_type: str, tokenizer_dir: Path, out: Path, *, multimodal: bool = False) -> str | None:
    """Save the tiny random ``model_type`` in ``out``; None, or why it is not built / out of scope."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

    from minitrainer.model.multimodal import auto_model_class, is_multimodal

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(BUILD_SECONDS)
    try:
        if multimodal:
            default = AutoConfig.for_model(model_type)
            if default.get_text_config() is default:
                return "out of scope: no text config of its own (a causal LM: see the causal-LM sweep)"
            config = tiny_multimodal_config(model_type, len(tokenizer), token_ids=ids)
            if not is_multimodal(config):
                return "out of scope: no text config of its own (a causal LM: see the causal-LM sweep)"
            if getattr(config.get_text_config(), "is_encoder_decoder", False) or config.is_encoder_decoder:
                return "out of scope: encoder-decoder"
        else:
            config = tiny_config(model_type, len(tokenizer), token_ids=ids)
        if getattr(config, "is_encoder_decoder", False):
            return "out of scope: encoder-decoder"
        model_class = auto_model_class(config) if multimodal else AutoModelForCausalLM
        with torch.device("meta"):  # counted without allocating: Phi-4-multimodal's untouched encoders took 11 GB
            num_params = sum(p.numel() for p in model_class.from_config(config).parameters())
        if num_params > MAX_TINY_PARAMETERS:
            subconfigs = [name for name, value in vars(config).items() if isinstance(value, PretrainedConfig)]
            return (f"not built: {num_params / 1e6:.0f}M parameters after shrinking, over the sweep's "
                    f"{MAX_TINY_PARAMETERS / 1e6:.0f}M" + (f" (sub-configs the shrinker leaves full size: "
                                                             f"{', '.join(subconfigs)})" if subconfigs else ""))
        torch.manual_seed(0)
        model = model_class.from_config(config, dtype=torch.float32)
        if multimodal:  # stored as released checkpoints are: bf16 (the export keeps the towers' bytes)
            model = model.to(torch.bfloat16)
            model.config.dtype = torch.bfloat16
        model.save_pretrained(out)
        if multimodal:
            (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG))
            # ShieldGemma-2 saves Gemma3ForConditionalGeneration under its own key layout, which the class
            # does not load back: every run would start from fresh random weights.
            _, info = model_class.from_pretrained(out, output_loading_info=True)
            if info["missing_keys"]:
                return (f"not built: the saved checkpoint does not load back into {type(model).__name__} "
                        f"({len(info['missing_keys'])} tensors missing, e.g. {sorted(info['missing_keys'])[0]})")
    except Exception as err:  # noqa: BLE001 - any failure to build is reported in the table, never raised
        return "not built: " + _one_line(f"{type(err).__name__}: {err}")
    finally:
        signal.alarm(0)
    tokenizer.save_pretrained(out)
    return None


def _too_slow(*_):
    raise TimeoutError(f"building took over {BUILD_SECONDS}s (the config is not tiny)")


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def train_all(names: list[str], models: dict[str, Path], data: Path, root: Path, *, nproc: int,
              timeout: float) -> dict[str, tuple[int, str]]:
    """``{name: (exit code, its log)}``: all runs in one torchrun job (``fixtures/matrix_train.py``: start-up paid
    once); when a run crashes the job, the runs after it go on in a new job."""
    outcomes: dict[str, tuple[int, str]] = {}
    pending = list(names)
    while pending:
        runs = [{"name": n, "args": matrix_args(models[n], data, root / "runs" / n)} for n in pending]
        results_file = root / "runs" / "results_0.json"
        results_file.unlink(missing_ok=True)
        try:
            proc = torchrun([json.dumps(run) for run in runs], nproc=nproc, module="fixtures.matrix_train",
                            timeout=timeout * len(runs))
            log = proc.stderr
        except subprocess.TimeoutExpired as err:
            log = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
            log += f"\nTimeoutExpired: no result within {timeout:.0f}s per run"
        exits = json.loads(results_file.read_text()) if results_file.exists() else {}
        pieces = _split_log(log)
        for name in pending:
            if name in exits:
                outcomes[name] = (exits[name], pieces.get(name, ""))
        done = [n for n in pending if n in exits]
        rest = [n for n in pending if n not in exits]
        if rest:  # the first run without a result ended the job: a crash (or a hang) of that family only
            outcomes[rest[0]] = (-1, pieces.get(rest[0], log[-3000:]))
            rest = rest[1:]
        pending = rest
        assert done or outcomes, "each job settles at least one run"
    return outcomes


def _split_log(log: str) -> dict[str, str]:
    pieces, name = {}, None
    for line in log.splitlines():
        if line.startswith(RUN_MARKER):
            name = line[len(RUN_MARKER):].strip()
            pieces[name] = ""
        elif name is not None:
            pieces[name] += line + "\n"
    return pieces


def judge(name: str, code: int, log: str, model_dir: Path, data: Path, root: Path) -> dict:
    record = {"architecture": name, "rel_err": None, "reason": ""}
    if code == 0:
        [metrics] = read_metrics(root / "runs" / name)
        ref = reference_step_one(model_dir, data, with_gradients=False)
        error = abs(metrics["loss"] - ref["loss"]) / ref["loss"]
        record.update(result="exact" if error <= EXACT_RTOL else "wrong", rel_err=error)
        export_problem = (export_differs(model_dir, root / "runs" / name)
                          if (model_dir / "preprocessor_config.json").exists() else None)
        if export_problem:
            record.update(result="wrong", reason=export_problem)
        return record
    refusal = [ln for ln in log.splitlines() if " ERROR " in ln]
    if refusal:  # the trainer's own one-line stop (a job it ends may report no exit code)
        record.update(result="refused", reason=_one_line(refusal[0].split(" ERROR ", 1)[-1], 400))
    else:
        try:
            reference_step_one(model_dir, data, with_gradients=False)
        except Exception as err:  # noqa: BLE001 - the tiny config breaks the model's own forward too
            record.update(result="no reference", reason="the model's own forward(labels=...) fails on the tiny "
                          "config: " + _one_line(f"{type(err).__name__}: {err}"))
            return record
        errors = [re.sub(r"^\[rank\d+\]:\s*", "", ln.strip()) for ln in log.splitlines()]
        errors = [ln for ln in errors if re.match(r"^[\w.]*(Error|Exception|Expired)\b", ln)
                  and not ln.startswith("torch.distributed.elastic")]
        record.update(result="crash", reason=_one_line(errors[-1] if errors else log[-300:], 300))
    return record


def sweep_chunk(families: list[str], tokenizer_dir: Path, data: Path, root: Path, args) -> list[dict]:
    records, models, built_seconds = [], {}, {}
    for model_type in families:
        began = time.perf_counter()
        why_not = build(model_type, tokenizer_dir, root / "models" / model_type,
                        multimodal=args.mapping == "image-text-to-text")
        built_seconds[model_type] = time.perf_counter() - began
        if why_not is None:
            models[model_type] = root / "models" / model_type
        else:
            result, reason = why_not.split(": ", 1)
            records.append({"architecture": model_type, "result": result, "reason": reason, "rel_err": None,
                            "seconds": round(built_seconds[model_type], 1)})
    began = time.perf_counter()
    outcomes = train_all(list(models), models, data, root, nproc=args.nproc_per_node, timeout=args.timeout)
    per_run = (time.perf_counter() - began) / max(len(models), 1)
    for name in models:
        code, log = outcomes[name]
        try:
            record = judge(name, code, log, models[name], data, root)
        except Exception as err:  # noqa: BLE001 - the model's own forward fails: no reference to compare with
            record = {"architecture": name, "result": "no reference", "rel_err": None,
                      "reason": "the model's own forward(labels=...) fails on the tiny config: "
                                + _one_line(f"{type(err).__name__}: {err}")}
        record["seconds"] = round(built_seconds[name] + per_run, 1)
        records.append(record)
    return records


def table_records(begin: str = BEGIN, end: str = END) -> list[dict]:
    """The rows of a table in ``docs/architectures.md``, as records (empty when there is none)."""
    if not DOC.exists() or begin not in DOC.read_text():
        return []
    table = DOC.read_text().split(begin, 1)[1].split(end, 1)[0]
    records = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and line.startswith("|") and cells[0] != "architecture" and not cells[0].startswith("-"):
            name, result, err, seconds, reason = cells
            records.append({"architecture": name, "result": result, "rel_err": float(err) if err else None,
                            "seconds": float(seconds), "reason": reason})
    return records


def write_table(records: list[dict], *, mapping: str = "causal-lm") -> str:
    begin, end = (BEGIN, END) if mapping == "causal-lm" else (MULTIMODAL_BEGIN, MULTIMODAL_END)
    counts = {}
    for r in records:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    lines = [f"transformers {_transformers_version()}, {len(records)} entries of {MAPPINGS[mapping]}: "
             + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), "",
             "| architecture | result | relative error | seconds | reason |", "|---|---|---|---|---|"]
    for r in records:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        lines.append(f"| {r['architecture']} | {r['result']} | {err} | {r['seconds']} | "
                     f"{r['reason'].replace('|', '/')} |")
    table = "\n".join(lines)
    if DOC.exists():
        text = DOC.read_text()
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            DOC.write_text(head + begin + "\n" + table + "\n" + end + rest.split(end, 1)[1])
    return table


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    from transformers import AutoTokenizer
    from transformers.models.auto import modeling_auto

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="", help="comma-separated model_types (default: every entry)")
    parser.add_argument("--mapping", choices=sorted(MAPPINGS), default="causal-lm",
                        help="which auto mapping to sweep (image-text-to-text: whole checkpoints, text trained)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120, help="seconds per family's training run")
    parser.add_argument("--chunk", type=int, default=25, help="families per torchrun job and per table update")
    parser.add_argument("--output", default=None,
                        help="results file (default: bench/architectures_results.json, or "
                             "bench/architectures_multimodal_results.json for image-text-to-text)")
    args = parser.parse_args()
    multimodal = args.mapping == "image-text-to-text"
    args.output = args.output or str(ROOT / "bench" / ("architectures_multimodal_results.json" if multimodal
                                                       else "architectures_results.json"))
    names = getattr(modeling_auto, MAPPINGS[args.mapping] + "_NAMES")
    families = [f for f in args.families.split(",") if f] or sorted(names)
    # A sweep of some families replaces their rows and keeps the others' (a full sweep replaces them all).
    markers = (MULTIMODAL_BEGIN, MULTIMODAL_END) if multimodal else (BEGIN, END)
    kept = [r for r in table_records(*markers) if r["architecture"] not in families]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer_dir = build_tiny_model("chatml", root / "tokenizer")
        vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
        data = write_tokenized_jsonl(root / "data.jsonl", num_samples=40, vocab_size=vocab, seed=3)
        # Chunks: results reach the file as the sweep goes, so an interrupted sweep still leaves a table.
        for first in range(0, len(families), args.chunk):
            records += sweep_chunk(families[first:first + args.chunk], tokenizer_dir, data, root, args)
            records.sort(key=lambda r: r["architecture"])
            Path(args.output).write_text(json.dumps(records, indent=1))
            write_table(sorted(kept + records, key=lambda r: r["architecture"]), mapping=args.mapping)
    for record in records:
        print(f"{record['architecture']:28s} {record['result']:12s} "
              f"{'' if record['rel_err'] is None else format(record['rel_err'], '.1e'):8s} "
              f"{record['seconds']:6.1f}s {record['reason']}")
    print(write_table(sorted(kept + records, key=lambda r: r["architecture"]), mapping=args.mapping).split("\n")[0])


if __name__ == "__main__":
    main()
