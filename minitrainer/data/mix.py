"""Weighted mixing of several datasets (tokenized, or raw for train.py to tokenize) into one seeded sample stream.

    --data-path ./data/chat_tkns                              one dataset (unchanged behaviour)
    --data-path ./data/chat_tkns:0.7,./data/code_tkns:0.3     weights inline
    --data-path ./mix.yaml                                    a mix file (.yaml, .yml or .json)

A mix file maps paths to weights, or lists sources; relative paths are read
from the mix file's folder::

    sources:
      - {path: chat_tkns, weight: 0.7}
      - {path: code_tkns, weight: 0.3}

Weights are normalised to sum to 1. Stream position ``p`` (the same
``samples_seen`` that names checkpoints and resumes) is drawn from source
``choice(weights)`` of block ``p // BLOCK``'s generator, seeded by
``(seed, block)``: a pure function of the seed and the position, so every
rank sees the same stream and a resume at any position continues it exactly.
The ``k``-th draw from source ``s`` is row ``k mod N_s`` of that source's
epoch ``k // N_s`` permutation, seeded by ``(seed, s, epoch)``.

An epoch is per source: source ``s`` has finished ``draws_s / N_s`` passes
(the metrics line reports both per source). ``--num-epochs`` counts passes over
the sum of all sources' rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 1024
"""Stream positions whose sources one generator call draws (resume cost: one call per block)."""
MIX_SALT = 0x313


@dataclass(frozen=True)
class Source:
    path: str
    weight: float


def parse_data_spec(text: str) -> list[Source] | None:
    """Sources of a ``--data-path`` value, or None for a single dataset.

    Raises:
        ValueError: a malformed weight or mix file, naming the problem.
    """
    path = Path(text)
    if path.suffix.lower() in (".yaml", ".yml", ".json") and path.is_file() and not _json_rows(path):
        return _normalise(_read_mix_file(path), str(path))
    if "," not in text and not _weighted(text):
        return None
    sources = []
    for part in text.split(","):
        part = part.strip()
        if not _weighted(part):
            raise ValueError(f"--data-path {text!r}: {part!r} has no ':WEIGHT' (write path:0.5,path:0.5)")
        name, weight = part.rsplit(":", 1)
        sources.append(Source(name, float(weight)))
    return _normalise(sources, text)


MAX_MIX_FILE_BYTES = 1 << 20


def _json_rows(path: Path) -> bool:
    """A ``.json`` file of data rows (JSON lines, or an array of rows), not a mix file: raw data that
    train.py tokenizes. A mix file is small and holds one mapping, or a list of ``{path, weight}``."""
    if path.suffix.lower() != ".json":
        return False
    if path.stat().st_size > MAX_MIX_FILE_BYTES:
        return True
    try:
        data = json.loads(path.read_text())
    except ValueError:  # several values: JSON lines
        return True
    if isinstance(data, dict):
        return "sources" not in data and not all(isinstance(w, (int, float)) for w in data.values())
    return isinstance(data, list) and not all(isinstance(d, dict) and {"path", "weight"} <= set(d) for d in data)


def _weighted(part: str) -> bool:
    if ":" not in part:
        return False
    try:
        float(part.rsplit(":", 1)[1])
    except ValueError:
        return False
    return True


def _read_mix_file(path: Path) -> list[Source]:
    text = path.read_text()
    if path.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if isinstance(data, dict) and "sources" in data:
        data = data["sources"]
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list) and all(isinstance(d, dict) and {"path", "weight"} <= set(d) for d in data):
        items = [(d["path"], d["weight"]) for d in data]
    else:
        raise ValueError(f"{path}: expected a mapping path -> weight, or 'sources: [{{path, weight}}, ...]'")
    return [Source(str(path.parent / name) if not Path(name).is_absolute() else str(name), float(weight))
            for name, weight in items]


def _normalise(sources: list[Source], where: str) -> list[Source]:
    if not sources:
        raise ValueError(f"{where}: no sources")
    bad = [s for s in sources if not s.weight > 0]
    if bad:
        raise ValueError(f"{where}: weights must be positive, got {[s.weight for s in bad]}")
    total = sum(s.weight for s in sources)
    return [Source(s.path, s.weight / total) for s in sources]


def data_paths(text: str) -> list[str]:
    """Every dataset path a ``--data-path`` value names."""
    sources = parse_data_spec(text)
    return [text] if sources is None else [s.path for s in sources]


class MixedStream:
    """Stream position -> row of the concatenated sources; drop-in for ``sampler.InfiniteSampler``."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int, position: int = 0) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes)))[:-1]
        self.seed = seed
        self.position = position
        self._block_counts = [np.zeros(len(sizes), dtype=np.int64)]  # draws per source before block b

    def _block_sources(self, block: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, MIX_SALT, block))
        return rng.choice(len(self.sizes), size=BLOCK, p=self.weights)

    def sources(self, start: int, stop: int) -> np.ndarray:
        """Source of each stream position in ``[start, stop)``."""
        blocks = range(start // BLOCK, (stop - 1) // BLOCK + 1) if stop > start else range(0)
        parts = [self._block_sources(b) for b in blocks]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        drawn = np.concatenate(parts)
        first = blocks[0] * BLOCK
        return drawn[start - first: stop - first]

    def draws_before(self, position: int) -> np.ndarray:
        """How many samples each source gave to positions ``[0, position)``."""
        block = position // BLOCK
        while len(self._block_counts) <= block:
            b = len(self._block_counts) - 1
            self._block_counts.append(self._block_counts[-1]
                                      + np.bincount(self._block_sources(b), minlength=len(self.sizes)))
        partial = self.sources(block * BLOCK, position)
        return self._block_counts[block] + np.bincount(partial, minlength=len(self.sizes))

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` rows (indices into the concatenation); advances ``position``."""
        start, stop = self.position, self.position + n
        sources = self.sources(start, stop)
        before = self.draws_before(start)
        rows = np.empty(n, dtype=np.int64)
        for s in range(len(self.sizes)):
            where = np.flatnonzero(sources == s)
            if not where.size:
                continue
            draws = before[s] + np.arange(where.size)
            epochs, offsets = np.divmod(draws, self.sizes[s])
            for epoch in np.unique(epochs):
                permutation = np.random.default_rng((self.seed, s, int(epoch))).permutation(int(self.sizes[s]))
                mask = epochs == epoch
                rows[where[mask]] = self.offsets[s] + permutation[offsets[mask]]
        self.position = stop
        return rows


class MixedDataset:
    """Several TokenizedDatasets behind the interface the sampler reads (rows concatenated in order)."""

    sequences_per_unit = 1  # data/rows.py: SampleRows

    def __init__(self, sources: list[Source], datasets: list) -> None:
        self.sources = sources
        self.datasets = datasets
        self.path = ",".join(f"{s.path}:{s.weight:g}" for s in sources)
        self.lengths = np.concatenate([d.lengths for d in datasets])
        self.num_loss_counted_tokens = np.concatenate([d.num_loss_counted_tokens for d in datasets])
        self.offsets = np.concatenate(([0], np.cumsum([len(d) for d in datasets])))
        self._counter: MixedStream | None = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, index: int) -> tuple[object, int]:
        s = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.datasets[s], index - int(self.offsets[s])

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        dataset, local = self._locate(index)
        return dataset.sample(local)

    def sample_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        dataset, local = self._locate(index)
        return dataset.sample_arrays(local)

    def content_digest(self) -> str:
        """Every source's content hash, in order."""
        import xxhash

        return xxhash.xxh3_128(",".join(d.content_digest() for d in self.datasets).encode()).hexdigest()

    def describe(self) -> str:
        listed = ", ".join(f"{s.path} ({len(d)} samples, weight {s.weight:.3g})"
                           for s, d in zip(self.sources, self.datasets, strict=True))
        return f"data mix of {len(self.sources)} sources: {listed}; an epoch is counted per source"

    def stream(self, seed: int) -> MixedStream:
        """The sample stream ``sampler.py`` draws batches from."""
        return MixedStream([len(d) for d in self.datasets], [s.weight for s in self.sources], seed)

    def source_metrics(self, seed: int, samples_seen: int) -> dict:
        """Samples drawn from each source so far, and its (fractional) epochs."""
        if self._counter is None or self._counter.seed != seed:
            self._counter = self.stream(seed)  # keeps its per-block counts: O(1 block) per step
        draws = self._counter.draws_before(samples_seen)
        names = [Path(s.path).name or s.path for s in self.sources]
        return {"samples_seen_per_source": dict(zip(names, draws.tolist(), strict=True)),
                "epoch_per_source": {name: int(n) / len(d) for name, n, d in zip(names, draws, self.datasets,
                                                                                 strict=True)}}


def load_data(text: str, load):
    """A TokenizedDataset (one path) or a MixedDataset; ``load`` opens one path."""
    sources = parse_data_spec(text)
    if sources is None:
        return load(text)
    return MixedDataset(sources, [load(s.path) for s in sources])
