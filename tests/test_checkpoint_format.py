"""DCP ``.metadata`` is read through an allowlist, in every form an honest interpreter writes it.

    .venv/bin/python -m pytest -q tests/test_checkpoint_format.py

How a pickle spells the same metadata depends on the interpreter that wrote it: Python 3.11.2
(Debian 12's) writes an enum member as ``getattr(EnumClass, 'NAME')`` where 3.10, 3.11.7 and 3.12+
write it by value, and 3.13 names path classes ``pathlib._local.PosixPath``. These tests write each
form explicitly, so they check the same things whichever interpreter runs them.
"""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
import pickletools

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fixtures.e2e import pickle_enums
from minitrainer.checkpoint.safe_metadata import MetadataSafeReader, _MetadataUnpickler, enum_member_by_name
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata


def _globals_named(data: bytes) -> str:
    listing = io.StringIO()
    pickletools.dis(data, out=listing)
    return listing.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    """A real DCP save with what a training state holds: bf16/fp32/int64 tensors and plain values."""
    folder = tmp_path_factory.mktemp("dcp")
    state = {"model": {"w": torch.randn(4, 3, dtype=torch.bfloat16), "b": torch.zeros(3)},
             "optim": {"step": torch.tensor(5), "lr": 1e-3, "names": ["a", "b"]}}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder


def _plain(folder: pathlib.Path) -> Metadata:
    with (folder / ".metadata").open("rb") as f:
        return pickle.load(f)


def test_real_metadata_reads_as_plain_pickle_does(saved):
    read = MetadataSafeReader(saved).read_metadata()
    assert read.state_dict_metadata == _plain(saved).state_dict_metadata


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("by_name", [False, True], ids=["enum_by_value", "enum_by_name"])
def test_either_enum_form_reads_the_same(saved, tmp_path, by_name, protocol):
    metadata = _plain(saved)
    data = pickle_enums(metadata, by_name=by_name, protocol=protocol)
    assert ("getattr" in _globals_named(data)) == by_name, "the form under test is the one written"
    (tmp_path / ".metadata").write_bytes(data)
    read = MetadataSafeReader(tmp_path).read_metadata()
    assert read.state_dict_metadata == metadata.state_dict_metadata
    formats = {p.properties.memory_format for p in read.state_dict_metadata.values() if hasattr(p, "properties")}
    assert formats == {torch.contiguous_format}


def test_paths_under_the_module_name_python_3_13_writes():
    path = pathlib.PurePosixPath("/ckpt/samples_48")
    as_313 = pickle.dumps(path, protocol=2).replace(b"cpathlib\n", b"cpathlib._local\n")
    assert b"cpathlib._local\n" in as_313
    assert _MetadataUnpickler(io.BytesIO(as_313)).load() == path


@pytest.mark.parametrize("value", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn,
                                   torch.strided, torch.Size([3, 4]), torch.Size([])])
def test_dtypes_layouts_sizes_round_trip(value):
    for protocol in (2, 4, 5):
        assert _MetadataUnpickler(io.BytesIO(pickle.dumps(value, protocol=protocol))).load() == value


def _refused(data: bytes) -> str:
    with pytest.raises(pickle.UnpicklingError) as err:
        _MetadataUnpickler(io.BytesIO(data)).load()
    return str(err.value)


def test_getattr_of_a_module_function_is_refused():
    # getattr(os, 'system')('touch x'): the module has to come from some global, and none is allowed.
    crafted = b"cbuiltins\ngetattr\n(cimportlib\nimport_module\n(Vos\ntRVsystem\ntR(Vtouch x\ntR."
    assert "refusing importlib.import_module" in _refused(crafted)
    with pytest.raises(pickle.UnpicklingError, match="refusing getattr"):
        import os

        enum_member_by_name(os, "system")


@pytest.mark.parametrize("owner,name", [
    (_MEM_FORMAT_ENCODING, "mro"), (_MEM_FORMAT_ENCODING, "__class__"), (_MEM_FORMAT_ENCODING, "_missing_"),
    (_MEM_FORMAT_ENCODING, "_value2member_map_"), (torch.Size, "__new__"), (Metadata, "__init__"),
    (pathlib.PosixPath, "write_text"), (enum.Enum, "__new__")])
def test_getattr_other_than_an_allowed_enum_member_is_refused(owner, name):
    with pytest.raises(pickle.UnpicklingError, match="refusing getattr"):
        enum_member_by_name(owner, name)
    assert "refusing" in _refused(pickle_enums(_Lookup(owner, name), by_name=False, protocol=4))


class _Foreign(enum.Enum):
    A = 1


def test_an_enum_outside_the_allowlist_is_refused_even_by_member_name():
    assert enum_member_by_name(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT") is \
        _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    with pytest.raises(pickle.UnpicklingError, match="refusing getattr"):
        enum_member_by_name(_Foreign, "A")
    assert "refusing" in _refused(pickle_enums(_Foreign.A, by_name=True, protocol=4))


class _Lookup:
    """Pickles as ``getattr(owner, name)``: the shape of a by-name enum member, with any owner and name."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)
