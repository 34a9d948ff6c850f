"""Stores of computed arrays kept between runs (DPO's reference log-probabilities), checked before use.

A store is one ``NAME.npz``: the arrays, plus ``computed_from``, what their values were computed from (a
JSON-serialisable dict: the model's weights digest, the data's digests, ...), inside the same file, so the
two can never part. A store is used only when its ``computed_from`` equals the caller's; a file computed from
something else, or one that is unreadable (truncated, flipped bytes that fail the zip's CRC, an array missing
or of another shape than the caller expects), is one log line naming the file and why, and the values are
computed again. Never a traceback, never a wrong value used.

A write is whole or nothing: a temporary file named by its writer (``leftovers.temporary_name``), flushed and
fsynced, then renamed over ``NAME.npz``. A failed write (a full disk) is one warning: the values stay in
memory, the run goes on, the next run computes them again. Before each read and write, what dead writers left
in the store's folder (which holds stores only) is removed: the temporary files of ``leftovers`` and, of the
versions before this one, ``.NAME.npz.PID.tmp`` (when no process ``PID`` runs) and the ``NAME.json`` sidecar
they wrote beside each store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import zipfile
import zlib
from pathlib import Path

import numpy as np

from minitrainer.common.distributed import pid_alive
from minitrainer.common.leftovers import remove_dead_leftovers, temporary_name
from minitrainer.common.log import logger

COMPUTED_FROM = "computed_from"
"""The array of a store that holds its ``computed_from`` (a 0-d string array of JSON: no pickle needed)."""
_OLD_TEMPORARY = re.compile(r"^\.(?P<name>.+\.npz)\.(?P<pid>\d+)\.tmp$")  # the versions before leftovers.py's names
_NEW_TEMPORARY = re.compile(r"^\.(?P<name>.+\.npz)\.tmp-")
# What a damaged file raises while it is opened and read (every byte flipped in turn, every length cut, in
# writing this): a torn or flipped zip (BadZipFile, which is no OSError), a flipped compression method or
# version (NotImplementedError) or encryption flag (RuntimeError), a member cut short (EOFError), a header
# numpy rejects or a pickled array (ValueError).
_UNREADABLE = (OSError, ValueError, KeyError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile,
               zlib.error)


def read_store(path: Path, *, computed_from: dict, shapes: dict[str, tuple[int, ...]],
               what: str) -> dict[str, np.ndarray] | None:
    """The arrays of store ``path`` when it was computed from ``computed_from``; else None, after one line.

    Args:
        path: the ``.npz`` file (absent: None, silently).
        computed_from: what the caller's values would be computed from; compared as JSON reads it back.
        shapes: every array the caller needs, by name, with its shape.
        what: the values' name in the log lines (``"reference log-probabilities"``).

    Returns:
        ``{name: array}`` of the names in ``shapes``, or None when they must be computed again.
    """
    remove_leftovers(path)
    if not path.is_file():
        return None
    expected = json.loads(json.dumps(computed_from, sort_keys=True))
    try:
        # Every array is read here, inside the try: np.load is lazy, and a flipped byte's CRC error only
        # comes when the member is read to its end.
        with np.load(path, allow_pickle=False) as stored:
            names = set(stored.files)
            if COMPUTED_FROM not in names:
                return _again(what, f"{path} does not say what it was computed from (an older version wrote it)")
            found = json.loads(str(stored[COMPUTED_FROM][()]))
            arrays = {name: stored[name] for name in shapes if name in names}
    except _UNREADABLE as err:
        return _again(what, f"{path} is unreadable ({type(err).__name__}: {err})", level=logging.WARNING)
    if found != expected:
        if isinstance(found, dict):
            keys = [*computed_from, *(key for key in found if key not in computed_from)]  # the caller's order
            differ = [key for key in keys if expected.get(key) != found.get(key)]
        else:
            differ = ["everything"]
        return _again(what, f"{path} was computed from another {', '.join(differ)}", level=logging.WARNING)
    for name, shape in shapes.items():
        if name not in arrays:
            return _again(what, f"{path} is unreadable (it holds no array {name!r})", level=logging.WARNING)
        if arrays[name].shape != tuple(shape):
            return _again(what, f"{path} is unreadable (its {name!r} has shape {arrays[name].shape}, not "
                                f"{tuple(shape)})", level=logging.WARNING)
    return arrays


def write_store(path: Path, arrays: dict[str, np.ndarray], *, computed_from: dict, what: str) -> bool:
    """Store ``arrays`` and ``computed_from`` as ``path``, whole or not at all.

    Args:
        path: the ``.npz`` file; its folder is created.
        arrays: the values, by name (not ``computed_from``).
        computed_from: what they were computed from (JSON-serialisable), kept inside the file.
        what: the values' name in the warning a failed write logs.

    Returns:
        Whether the store was written; a failure (a full disk) logged one warning and left no partial file.
    """
    assert COMPUTED_FROM not in arrays, f"{COMPUTED_FROM!r} is the store's own array"
    remove_leftovers(path)
    temporary = temporary_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as file:
            np.savez(file, **arrays, **{COMPUTED_FROM: np.array(json.dumps(computed_from, sort_keys=True))})
            file.flush()
            os.fsync(file.fileno())  # on disk before the rename makes it the store
        os.replace(temporary, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)  # its space back
        logger.warning("%s not stored in %s (%s; they need %s): training goes on, and the next run computes them "
                       "again", what, path.parent, err, _size(sum(array.nbytes for array in arrays.values())))
        return False
    return True


def remove_leftovers(path: Path) -> None:
    """Remove what dead writers left in the folder of store ``path`` (the module docstring); a file that
    cannot be removed is one warning."""
    folder = path.parent
    if not folder.is_dir():
        return
    finals, old = {path}, []
    try:
        entries = list(folder.iterdir())
        for entry in entries:
            if (match := _NEW_TEMPORARY.match(entry.name)) is not None:
                finals.add(folder / match["name"])
            elif (match := _OLD_TEMPORARY.match(entry.name)) is not None and not pid_alive(int(match["pid"])):
                old.append(entry)
        stores = {entry.stem for entry in entries if entry.suffix == ".npz"} | {final.stem for final in finals}
        old += [entry for entry in entries if entry.suffix == ".json" and entry.stem in stores]
        for entry in old:
            entry.unlink(missing_ok=True)
        remove_dead_leftovers(tuple(sorted(finals)))
    except OSError as err:
        logger.warning("could not remove the leftovers of dead runs in %s (%s): they stay, and use space", folder,
                       err)
        return
    if old:
        logger.info("removed %d file(s) an older version left: %s", len(old), ", ".join(map(str, old)))


def _again(what: str, why: str, *, level: int = logging.INFO) -> None:
    """One line: why the store is not used (a warning when it is damaged or foreign, not merely old)."""
    logger.log(level, "%s: %s: computing them again", what, why)


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"
