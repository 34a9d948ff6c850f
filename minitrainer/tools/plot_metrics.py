"""Plot a run's metrics JSONL as PNG files.

    python -m minitrainer.tools.plot_metrics ./output                 # writes ./output/plots/*.png
    python -m minitrainer.tools.plot_metrics ./output --out-dir /tmp/plots --smoothing 0.9

Reads every ``training_metrics_*.jsonl`` in the output folder (rank 0 writes
``training_metrics_0.jsonl``) and writes:

  loss.png                 loss per optimizer step with a smoothed overlay, and
                           the validation loss (its own lines, with ``val_loss``)
                           as points; samples seen on the top axis
  metrics_by_step.png      loss, learning rate, grad norm, tokens/s, peak
                           memory, gradient-accumulation steps, tokens/s and
                           loss-counted tokens/s per GPU, and MFU over steps
  metrics_by_samples.png   the same panels over samples seen
  rewards.png              a preference run's only (DPO, CPO, SimPO, ORPO: its lines have
                           ``rewards/accuracies``): the chosen and rejected rewards, the
                           reward accuracy and the reward margin per step, with the
                           validation passes' as points; a KTO run's (``num_examples``):
                           the desirable and undesirable rows' rewards, the KL baseline
                           and the margin; a reward model's (``mean_reward``): the batch's
                           highest and lowest scores, the accuracy and the margin

A preference run's loss is the mean over each batch's pairs, and its samples are pairs (a KTO
run's: examples): the titles and axes say so. Needs matplotlib, an optional dependency:
``pip install matplotlib``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

PANELS = (
    ("loss", "loss (per-token mean)"),
    ("lr", "learning rate"),
    ("grad_norm", "grad norm (before clipping)"),
    ("tokens_per_second", "tokens / s (whole job)"),
    ("peak_memory_usage_GB", "peak memory (GB, rank 0)"),
    ("grad_accum", "grad-accumulation steps"),
    ("tokens_per_second_per_gpu", "tokens / s per GPU"),
    ("loss_tokens_per_second_per_gpu", "loss-counted tokens / s per GPU"),
    ("mfu", "MFU (model FLOPs / peak bf16; null on CPU)"),
)

REWARD_PANELS = (
    (("rewards/chosen", "rewards/rejected"), "rewards of the chosen and rejected sides (mean over pairs)"),
    (("rewards/accuracies",), "reward accuracy (share of pairs with chosen > rejected)"),
    (("rewards/margins",), "reward margin (chosen - rejected, mean over pairs)"),
)
"""The preference panels of ``rewards.png``: the fields each draws (TRL's names), its title."""

UNPAIRED_PANELS = (
    (("rewards/chosen", "rewards/rejected"), "rewards of the desirable and undesirable rows (mean over each)"),
    (("kl",), "KL baseline (the batch's mismatched rows, at least 0)"),
    (("rewards/margins",), "reward margin (desirable - undesirable)"),
)
"""``rewards.png``'s panels for a KTO run (unpaired feedback: its objective's metrics)."""

SCORE_PANELS = (
    (("max_reward", "min_reward"), "highest and lowest score of the batch"),
    (("accuracy",), "accuracy (share of pairs whose chosen side scores higher)"),
    (("margin",), "margin (chosen - rejected score, mean over pairs)"),
)
"""``rewards.png``'s panels for a reward model's run (``--objective reward``: TRL's RewardTrainer names)."""
SCORE_FIELDS = ("mean_reward",)
"""A step line with any of these is a reward model's: its rewards are the score head's outputs."""

PREFERENCE_FIELDS = ("rewards/accuracies", "num_pairs")
"""A step line with any of these is a preference run's (``objectives/pairs.py``'s metrics)."""
UNPAIRED_FIELDS = ("num_examples",)
"""A step line with any of these is a KTO run's: the loss is a mean over labelled examples."""


def is_preference_run(records: list[dict]) -> bool:
    """Whether these step lines are a preference objective's: the loss is a mean over pairs."""
    return any(field in record for record in records for field in PREFERENCE_FIELDS)


def is_unpaired_run(records: list[dict]) -> bool:
    """Whether these step lines are KTO's: the loss is a mean over labelled examples."""
    return any(field in record for record in records for field in UNPAIRED_FIELDS)


def read_metrics(path: Path) -> list[dict]:
    """One JSONL file's records; a torn last line (a run killed mid-write) is skipped."""
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                continue
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    return records


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Exponential moving average with bias correction (TensorBoard's smoothing), NaN-safe."""
    out = np.empty(len(values))
    average, total_weight = 0.0, 0.0
    for i, value in enumerate(values):
        if np.isfinite(value):
            average = weight * average + (1 - weight) * value
            total_weight = weight * total_weight + (1 - weight)
        out[i] = average / total_weight if total_weight else np.nan
    return out


def _series(records: list[dict], key: str) -> np.ndarray:
    return np.array([float(r[key]) if isinstance(r.get(key), (int, float)) else np.nan for r in records])


def _samples(records: list[dict]) -> np.ndarray:
    # samples_seen is the stream position; older logs only have total_samples_accumulated.
    key = "samples_seen" if all("samples_seen" in r for r in records) else "total_samples_accumulated"
    return _series(records, key)


def plot_metrics(output_dir: str | Path, *, out_dir: str | Path | None = None, smoothing: float = 0.6) -> list[Path]:
    """Render the PNGs for one run (``figures``), each written and closed.

    Args:
        output_dir: the training ``--output-dir`` holding ``training_metrics_*.jsonl``.
        out_dir: where to write the PNGs (default ``output_dir/plots``).
        smoothing: EMA weight of the smoothed loss overlay, in [0, 1).

    Returns:
        The written PNG paths.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: no metrics file, or a file with no records.
    """
    drawn = figures(output_dir, smoothing=smoothing)
    import matplotlib.pyplot as plt  # figures() imported it, or raised the ImportError that says how to install

    out_dir = Path(out_dir) if out_dir is not None else Path(output_dir) / "plots"
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for filename, fig in drawn.items():
            written.append(_save(fig, out_dir / filename))
    finally:
        for fig in drawn.values():
            plt.close(fig)
    return written


def figures(output_dir: str | Path, *, smoothing: float = 0.6) -> dict:
    """The run's figures by file name, not written: ``loss.png``, ``metrics_by_step.png``,
    ``metrics_by_samples.png``, and for a preference run ``rewards.png`` (the caller closes them).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: no metrics file, a file with no records, or a bad ``smoothing``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: works without a display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plot_metrics.py needs matplotlib (an optional dependency): pip install matplotlib") \
            from err
    if not 0 <= smoothing < 1:
        raise ValueError(f"--smoothing must be in [0, 1), got {smoothing}")
    output_dir = Path(output_dir)
    files = sorted(output_dir.glob("training_metrics_*.jsonl"))
    if not files:
        raise ValueError(f"{output_dir}: no training_metrics_*.jsonl (is this a train.py --output-dir?)")
    runs, val_runs = {}, {}
    for path in files:
        name = path.stem.removeprefix("training_metrics_")
        records = read_metrics(path)
        # Validation passes are their own lines (keyed by val_loss); step panels read the others.
        val_runs[name] = [r for r in records if "val_loss" in r]
        runs[name] = [r for r in records if "val_loss" not in r]
    runs = {name: records for name, records in runs.items() if records}
    if not runs:
        raise ValueError(f"{output_dir}: the metrics files are empty (no optimizer step finished yet)")
    preference = any(is_preference_run(records) for records in runs.values())
    unpaired = not preference and any(is_unpaired_run(records) for records in runs.values())
    unit = "pairs" if preference else "examples" if unpaired else None
    loss_label = f"loss (mean over {unit})" if unit else "loss (per-token mean)"
    seen_label = f"{unit} seen" if unit else "samples seen"
    label_ranks = len(runs) > 1
    drawn = {}

    fig, ax = plt.subplots(figsize=(9, 5))
    drawn["loss.png"] = fig
    for name, records in runs.items():
        steps, loss = _series(records, "step"), _series(records, "loss")
        suffix = f" (rank {name})" if label_ranks else ""
        ax.plot(steps, loss, color="tab:blue", alpha=0.35, linewidth=1, label="loss" + suffix)
        ax.plot(steps, smooth(loss, smoothing), color="tab:blue", linewidth=2,
                label=f"smoothed (EMA {smoothing:g})" + suffix)
        if val_runs.get(name):
            ax.plot(_series(val_runs[name], "step"), _series(val_runs[name], "val_loss"), color="tab:orange",
                    marker="o", linewidth=1.5, label="validation loss" + suffix)
    first = next(iter(runs.values()))
    _samples_axis(ax, _series(first, "step"), _samples(first), label=seen_label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(loss_label)
    ax.set_title(f"{'Training and validation' if any(val_runs.values()) else 'Training'} loss: "
                 f"{output_dir.resolve().name}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()

    for x_key, x_label, filename in (("step", "optimizer step", "metrics_by_step.png"),
                                     ("samples", seen_label, "metrics_by_samples.png")):
        fig, axes = plt.subplots(3, 3, figsize=(15, 11))
        drawn[filename] = fig
        for ax, (key, title) in zip(axes.flat, PANELS):
            for name, records in runs.items():
                x = _samples(records) if x_key == "samples" else _series(records, "step")
                y = _series(records, key)
                if np.isnan(y).all():
                    _not_available(ax)
                    continue
                label = f"rank {name}" if label_ranks else None
                if key == "loss":
                    ax.plot(x, y, color="tab:blue", alpha=0.35, linewidth=1)
                    ax.plot(x, smooth(y, smoothing), color="tab:blue", linewidth=2, label=label)
                elif key == "grad_accum":
                    ax.step(x, y, where="mid", label=label)
                    ax.yaxis.get_major_locator().set_params(integer=True)
                else:
                    ax.plot(x, y, marker="." if len(x) <= 50 else None, label=label)
            ax.set_title(loss_label if key == "loss" else title)
            ax.set_xlabel(x_label)
            ax.grid(True, alpha=0.3)
            if label_ranks:
                ax.legend()
        axes.flat[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        fig.suptitle(f"{output_dir.resolve().name}: metrics by {x_label}")
        fig.tight_layout()

    if unit:
        scores = any(field in record for records in runs.values() for record in records for field in SCORE_FIELDS)
        panels = SCORE_PANELS if scores else REWARD_PANELS if preference else UNPAIRED_PANELS
        drawn["rewards.png"] = _rewards_figure(runs, val_runs, panels,
                                               label_ranks=label_ranks,
                                               title=f"{output_dir.resolve().name}: "
                                                     + ("reward model scores by step" if scores
                                                        else "preference rewards by step"))
    return drawn


def _rewards_figure(runs: dict, val_runs: dict, panels: tuple, *, label_ranks: bool, title: str):
    """One panel per ``panels`` entry: each field per step, its validation points (``val_`` + field)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.8))
    colors = ("tab:green", "tab:red")
    for ax, (keys, panel_title) in zip(axes, panels):
        for name, records in runs.items():
            suffix = f" (rank {name})" if label_ranks else ""
            steps = _series(records, "step")
            for key, color in zip(keys, colors if len(keys) > 1 else ("tab:blue",)):
                y = _series(records, key)
                if np.isnan(y).all():
                    continue
                ax.plot(steps, y, color=color, marker="." if len(steps) <= 50 else None, label=key + suffix)
                val = [r for r in val_runs.get(name, []) if isinstance(r.get(f"val_{key}"), (int, float))]
                if val:
                    ax.plot(_series(val, "step"), _series(val, f"val_{key}"), color=color, marker="o",
                            linestyle="--", linewidth=1, markerfacecolor="white", label=f"val_{key}" + suffix)
        if not ax.lines:
            _not_available(ax)
        if keys in (("rewards/accuracies",), ("accuracy",)):
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(panel_title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(" / ".join(keys))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _not_available(ax) -> None:
    ax.text(0.5, 0.5, "n/a (null or not in the metrics file)", ha="center", va="center", transform=ax.transAxes)


def _samples_axis(ax, steps: np.ndarray, samples: np.ndarray, *, label: str) -> None:
    """Top x-axis in samples (or pairs) seen, when they grow strictly with steps (they do within one run)."""
    if len(steps) < 2 or np.isnan(samples).any() or not (np.diff(samples) > 0).all() \
            or not (np.diff(steps) > 0).all():
        return
    top = ax.secondary_xaxis("top", functions=(lambda s: np.interp(s, steps, samples),
                                               lambda n: np.interp(n, samples, steps)))
    top.set_xlabel(label)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("output_dir", help="train.py --output-dir holding training_metrics_*.jsonl")
    parser.add_argument("--out-dir", default=None, help="where to write the PNGs (default: OUTPUT_DIR/plots)")
    parser.add_argument("--smoothing", type=float, default=0.6, help="EMA weight of the smoothed loss, in [0, 1)")
    args = parser.parse_args(argv)
    try:
        paths = plot_metrics(args.output_dir, out_dir=args.out_dir, smoothing=args.smoothing)
    except (ImportError, ValueError) as err:
        raise SystemExit(f"{parser.prog}: error: {err}") from None
    for path in paths:
        print(path)


if __name__ == "__main__":
    sys.exit(main())
