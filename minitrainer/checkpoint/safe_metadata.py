"""A torch.distributed.checkpoint reader that cannot run code: ``.metadata`` read with an allowlist.

DCP's ``.metadata`` is a pickle: left to ``pickle.load`` (as torch's own reader
does), a crafted checkpoint folder could run code at resume. It is made of a few
of torch's own dataclasses and enums, tensor sizes, dtypes and layouts, and the
folder path; nothing else may be loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_PATHS = ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def metadata_global(module: str, name: str) -> Any:
    """The object a DCP ``.metadata`` pickle may refer to as ``module.name``; UnpicklingError otherwise."""
    if module in _METADATA_MODULES:
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
            return found
    elif module == "torch":
        found = getattr(torch, name, None)
        if found is torch.Size or isinstance(found, torch.dtype):
            return found
    elif (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout  # a lookup of a layout by its name
    elif module in ("pathlib", "pathlib._local") and name in _METADATA_PATHS:  # 3.13 names the latter
        return getattr(pathlib, name)
    elif module in ("builtins", "__builtin__") and name == "getattr":
        return enum_member_by_name
    raise pickle.UnpicklingError(f"refusing {module}.{name}: not part of a checkpoint's metadata "
                                 "(a checkpoint folder must not be able to run code)")


def enum_member_by_name(owner: Any, name: Any) -> enum.Enum:
    """The only ``getattr`` a DCP ``.metadata`` pickle may call: some CPython patch releases (Debian 12's
    3.11.2 among them) pickle an enum member as ``getattr(EnumClass, 'MEMBER')`` where others pickle it by
    value. So the lookup is allowed for a member name of an enum class that is itself allowed, nothing else."""
    allowed = (isinstance(owner, type) and issubclass(owner, enum.Enum)
               and _is_allowed_global(owner.__module__, owner.__qualname__, owner))
    if allowed and isinstance(name, str) and name in owner.__members__:
        return owner[name]
    shown = owner.__qualname__ if isinstance(owner, type) else type(owner).__qualname__
    raise pickle.UnpicklingError(f"refusing getattr({shown}, {name!r}): only a member of an allowed enum may be "
                                 "looked up by name in a checkpoint's metadata")


def _is_allowed_global(module: str, name: str, expected: Any) -> bool:
    try:
        return metadata_global(module, name) is expected
    except pickle.UnpicklingError:
        return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return metadata_global(module, name)


class MetadataSafeReader(dcp.FileSystemReader):
    """torch's FileSystemReader, reading ``.metadata`` with an allowlist instead of plain pickle
    (the tensor files it reads already go through ``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        try:
            with open(Path(self.path) / name, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError) as err:
            # Kept for the warning: torch <= 2.11's dcp.load swallows this (then tries a per-rank
            # __<rank>.metadata, which is absent) and reports only "metadata is None".
            if rank is None:
                self.metadata_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
