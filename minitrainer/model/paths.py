"""Where a model comes from: a local folder or a hub id, checked before anything loads."""

from __future__ import annotations

from pathlib import Path


def model_path_error(name_or_path: str, *, flag: str = "--model-name-or-path") -> str | None:
    """A local model folder that is not there or holds no ``config.json``, in one line; None for a folder that
    does, and for a hub id (``name`` or ``namespace/name``), which only loading can check.

    A value is taken for a path when it exists or when it cannot be a hub id: it starts with ``/``, ``.`` or
    ``~`` or has more than one ``/``. Otherwise transformers answers a typo with "Repo id must be in the form
    'repo_name' or 'namespace/repo_name'".
    """
    path = Path(name_or_path).expanduser()
    if not path.exists():
        if name_or_path.startswith(("/", ".", "~")) or name_or_path.strip("/").count("/") > 1:
            return f"{flag} {name_or_path}: no such folder"
        return None
    if not path.is_dir():
        return f"{flag} {name_or_path}: a file, not a model folder"
    if not (path / "config.json").is_file():
        return (f"{flag} {name_or_path}: cannot load a model from this folder: it has no config.json "
                "(not a Hugging Face model folder)")
    return None
