"""The whole tool in a few minutes on a CPU: data -> tokens -> training -> plots -> chat.

    make demo                                     # creates .venv, then runs this
    .venv/bin/python -m minitrainer.tools.demo --output-dir demo_output --nproc-per-node 2

Steps (all local, no downloads):
  1. build a small ChatML tokenizer (BPE trained on the demo data) and a random
     Qwen2-style model (``tiny_model.build_tiny_model``);
  2. ``process_data`` tokenizes ``demo_chat.jsonl`` (conversations and
     pretrain text that ship with the repo) with masked prompts;
  3. ``api.run_training`` launches ``torchrun --nproc-per-node=N train.py``
     (gloo on CPU, FSDP2 all the same) for ``--max-steps`` steps;
  4. ``plot_metrics`` renders the metrics JSONL as PNGs;
  5. the newest checkpoint under ``hf_format/`` is reloaded with transformers
     and answers a prompt through the chat template.

The model is tiny and trains for seconds, so its reply shows the pipeline
works (words and phrases from the data, the chat format), not that it is smart.
Every folder below ``--output-dir`` is rewritten on each run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from minitrainer.common.cli import config_field, parse_config
from minitrainer.common.commands import command
from minitrainer.common.log import logger, setup_logging
from minitrainer.common.refusals import collect_errors
from minitrainer.report.progress import announce_progress, resolve_progress

DEMO_DATA = Path(__file__).resolve().with_name("demo_chat.jsonl")  # package data: a wheel carries it


@dataclass
class DemoConfig:
    output_dir: str = config_field("demo_output", help="folder for the model, data, run and plots (rewritten)")
    nproc_per_node: int = config_field(2, help="training processes (gloo on CPU)")
    max_steps: int = config_field(80, help="optimizer steps")
    batch_size: int = config_field(16, help="samples per optimizer step")
    max_tokens_per_gpu: int = config_field(1024, help="token budget of one packed minibatch per process")
    learning_rate: float = config_field(3e-3, help="peak learning rate (high: a tiny random model, few steps)")
    seed: int = config_field(42, help="seed of the model init, data order and sampling")
    vocab_size: int = config_field(2048, help="BPE vocabulary of the demo tokenizer")
    hidden_size: int = config_field(128, help="model width")
    num_layers: int = config_field(4, help="decoder blocks")
    prompt: str = config_field("Why do stars twinkle?", help="user message the trained model answers")
    max_new_tokens: int = config_field(60, help="tokens to generate for the reply")

    def __post_init__(self) -> None:
        errors = [f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                  for name in ("nproc_per_node", "max_steps", "batch_size", "max_tokens_per_gpu", "vocab_size",
                               "hidden_size", "num_layers", "max_new_tokens") if getattr(self, name) < 1]
        if self.hidden_size % 4:
            errors.append(f"--hidden-size must be a multiple of 4 (4 attention heads), got {self.hidden_size}")
        collect_errors(errors)


def demo_texts(path: Path = DEMO_DATA) -> list[str]:
    """Every message's text from the demo jsonl: the tokenizer's training corpus."""
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        texts.extend(message["content"] for message in json.loads(line)["messages"])
    return texts


def build_demo_model(output_dir: Path, config: DemoConfig) -> Path:
    """ChatML tokenizer trained on the demo data, plus a random Qwen2-style model."""
    from minitrainer.tools.tiny_model import build_tiny_model

    return build_tiny_model("chatml", output_dir, vocab_size=config.vocab_size, corpus=demo_texts(),
                            hidden_size=config.hidden_size, num_layers=config.num_layers, num_heads=4,
                            num_kv_heads=2, intermediate_size=2 * config.hidden_size, seed=config.seed)


def latest_checkpoint(output_dir: str | Path) -> Path:
    """The ``hf_format/samples_N`` folder with the largest N."""
    folders = [p for p in (Path(output_dir) / "hf_format").glob("samples_*") if p.is_dir()]
    if not folders:
        raise ValueError(f"{output_dir}/hf_format: no checkpoint folders")
    return max(folders, key=lambda p: int(p.name.removeprefix("samples_")))


def generate_reply(checkpoint: str | Path, prompt: str, *, max_new_tokens: int, seed: int) -> str:
    """Reload a checkpoint with plain transformers and answer ``prompt`` through its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)  # saved bf16; fp32 on CPU
    model.eval()
    input_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                do_sample=True, temperature=0.7, top_k=40, repetition_penalty=1.2,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True).strip()


def make_plots(run_dir: Path) -> list[Path]:
    """The run's PNGs, or none with one warning: plots are optional (matplotlib may be missing)."""
    from minitrainer.tools.plot_metrics import plot_metrics

    try:
        return plot_metrics(run_dir)
    except (ImportError, ValueError, OSError) as err:  # what plot_metrics documents, and a full disk
        logger.warning("[4/5] plots skipped (%s); the metrics are in %s", err, run_dir / "training_metrics_0.jsonl")
        return []


def run_demo(config: DemoConfig) -> dict[str, Path]:
    """Run every step; returns where the artefacts are."""
    from minitrainer.api import ProcessDataConfig, TorchrunArgs, TrainConfig, process_data, run_training

    root = Path(config.output_dir).resolve()
    model_dir, data_dir, run_dir = root / "tiny_model", root / "data", root / "run"
    for folder in (model_dir, data_dir, run_dir):
        if folder.exists():
            logger.info("removing %s from an earlier demo run", folder)
            shutil.rmtree(folder)
    timings = {}

    start = time.perf_counter()
    build_demo_model(model_dir, config)
    timings["model"] = time.perf_counter() - start
    logger.info("[1/5] tokenizer (BPE, %d tokens, trained on %s) and random %d-layer model: %s",
                config.vocab_size, DEMO_DATA.name, config.num_layers, model_dir)

    start = time.perf_counter()
    summary = process_data(ProcessDataConfig(input_file=str(DEMO_DATA), output_dir=str(data_dir),
                                             model_name_or_path=str(model_dir), num_proc=1, num_printed_samples=1))
    timings["process_data"] = time.perf_counter() - start
    logger.info("[2/5] process_data: %d samples (%d chat, %d pretrain), %d rejected -> %s",
                summary["num_written"], summary["num_chat"], summary["num_pretrain"], summary["num_rejected"],
                data_dir)

    start = time.perf_counter()
    # One intra-op thread per process: N processes on N cores, no oversubscription.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_training(
        TorchrunArgs(nproc_per_node=config.nproc_per_node),
        TrainConfig(output_dir=str(run_dir), data_path=str(data_dir), model_name_or_path=str(model_dir),
                    batch_size=config.batch_size, max_tokens_per_gpu=config.max_tokens_per_gpu,
                    learning_rate=config.learning_rate, num_warmup_steps=max(config.max_steps // 10, 1),
                    lr_scheduler="cosine", max_steps=config.max_steps, seed=config.seed,
                    min_samples_per_checkpoint=config.batch_size * config.max_steps // 2,
                    num_data_workers=0, activation_checkpointing=False))
    timings["train"] = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "training_metrics_0.jsonl").read_text().splitlines()]
    logger.info("[3/5] trained %d steps in %.0fs: loss %.3f -> %.3f", len(records), timings["train"],
                records[0]["loss"], records[-1]["loss"])

    start = time.perf_counter()
    plots = make_plots(run_dir)
    timings["plots"] = time.perf_counter() - start
    if plots:
        logger.info("[4/5] plots: %s", ", ".join(p.name for p in plots))

    start = time.perf_counter()
    checkpoint = latest_checkpoint(run_dir)
    reply = generate_reply(checkpoint, config.prompt, max_new_tokens=config.max_new_tokens, seed=config.seed)
    timings["generate"] = time.perf_counter() - start
    logger.info("[5/5] reloaded %s with transformers and asked:\n  user: %s\n  assistant: %s",
                checkpoint, config.prompt, reply)
    logger.info("step times: %s", ", ".join(f"{name} {seconds:.0f}s" for name, seconds in timings.items()))

    artefacts = {"model": model_dir, "data": data_dir / "data.jsonl", "data summary": data_dir / "summary.json",
                 "metrics": run_dir / "training_metrics_0.jsonl", "params": run_dir / "training_params.json",
                 "checkpoint": checkpoint, **({"plots": plots[0].parent} if plots else {})}
    width = max(len(name) for name in artefacts)
    print("\nWhere everything is:")
    for name, path in artefacts.items():
        print(f"  {name:<{width}}  {path}")
    print(f"\nNext: {f'open {plots[0]}, or ' if plots else ''}inspect the packing with\n"
          f"  {command('minitrainer.tools.inspect_data')} --data-path {data_dir} --batch-size {config.batch_size} "
          f"--max-tokens-per-gpu {config.max_tokens_per_gpu} --world-size {config.nproc_per_node}")
    return artefacts


def main(argv: list[str] | None = None) -> None:
    config = parse_config(DemoConfig, argv, description=__doc__.split("\n\n")[0])
    setup_logging("INFO")
    # The demo's own steps (the model's save, its reload to generate) draw the libraries' bars: lines in a log.
    announce_progress("auto", resolve_progress("auto"))
    run_demo(config)


if __name__ == "__main__":
    main()
