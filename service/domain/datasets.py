"""Datasets on the server, on the HTTP side: named maps of arrays per API key, stored
in the store beside models, and the binding of a definition's inputs to them.

A binding is looked up here (the dataset, its array, the blob holding it) and travels to
the worker as a reference (store.is_ref); the worker reads the array from the store once
and keeps it hot (service/worker/datasets.py), and takes the rows. No array work here.
"""

from __future__ import annotations

import asyncio
import builtins  # `list` is also a method of DatasetCatalog below
import io
import math
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.config import Settings
from service.core.errors import ServiceError
from service.core.store import DatasetRow, Store, rows_problem
from service.core.wire import DTYPES
from service.domain.requests import Binding, Prepared
from service.domain.sessions import iso


def dataset_info(row: DatasetRow) -> dict[str, Any]:
    return {
        "name": row.name,
        "version": row.version,
        "bytes": row.bytes,
        "arrays": {
            a.name: {"dtype": a.dtype, "shape": a.shape, "bytes": a.bytes} for a in row.arrays
        },
        "created_at": iso(row.created),
        "updated_at": iso(row.updated),
    }


# An .npz is a zip of .npy members: each member's header declares its dtype and shape,
# and the zip's directory its size. Both are read, and the declared bytes checked against
# the limits, before any member's data is decompressed; then each member is inflated in
# bounded chunks into an array of exactly its declared size (a zip bomb of zeros never
# becomes more than what was allowed).
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
MAX_NPZ_MEMBERS = 1024  # arrays in one .npz (each costs a header read and a row)
READ_CHUNK = 2**20  # bytes inflated at a time
MAX_NPY_HEADER = 10_000  # NumPy's own default bound on a header's length


def _invalid(field: str, message: str) -> ServiceError:
    return ServiceError(
        "validation", f"{field}: {message}", errors=[{"field": field, "message": message}]
    )


def _no_limit(size: int) -> None:
    return None


@dataclass(frozen=True)
class _Member:
    """One array as its header declares it, before its data is read."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    offset: int  # where its data starts (the header's length)
    nbytes: int

    def array(self, data: np.ndarray) -> np.ndarray:
        return data.view(self.dtype).reshape(self.shape, order="F" if self.fortran else "C")


def _npy_header(stream: Any, name: str) -> _Member:
    """The header of an .npy at the stream's position: dtype, shape, order, data bytes
    (Python integers: a declared size never overflows). Refuses what could not be stored."""
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream, MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream, MAX_NPY_HEADER)
        else:
            raise ValueError(f".npy format version {version} is not supported (1.0 or 2.0)")
    except (ValueError, OSError, EOFError, SyntaxError, zipfile.BadZipFile) as exc:
        raise _invalid(name, f"not an .npy header NumPy reads without pickle: {exc}") from None
    if dtype.hasobject:
        raise _invalid(
            name,
            f"dtype {dtype} holds Python objects: reading it would unpickle, which is never done",
        )
    if dtype.name not in DTYPES:
        raise _invalid(name, f"dtype {dtype} is not one of {', '.join(DTYPES)}")
    # NumPy's header reader takes any integers: two negative dimensions multiply to a
    # positive size that the data can match, and only the reshape would fail (a 500).
    if any(d < 0 for d in shape):
        raise _invalid(name, f"the .npy header declares shape {list(shape)}: a negative dimension")
    nbytes = math.prod(shape) * dtype.itemsize
    return _Member(name, dtype, tuple(shape), bool(fortran), stream.tell(), nbytes)


def load_numpy(
    body: bytes, array: str, check_size: Callable[[int], None] = _no_limit
) -> dict[str, np.ndarray]:
    """The arrays of a .npz (by their names) or a .npy (named `array`), never unpickling.
    `check_size(bytes)` raises when the arrays, as their headers declare them, may not be
    stored; it runs before any data is decompressed or allocated."""
    head = bytes(body[:6])
    if head.startswith(ZIP_MAGICS):
        return _load_npz(body, check_size)
    if head != NPY_MAGIC:
        raise _invalid("body", "not a .npy or .npz file (neither magic number starts it)")
    stream = io.BytesIO(body)
    member = _npy_header(stream, array)
    check_size(member.nbytes)
    held = len(body) - member.offset
    if held != member.nbytes:
        raise _invalid(
            array,
            f"the .npy header declares {member.dtype} {list(member.shape)} "
            f"({member.nbytes:,} bytes), but {held:,} bytes of data follow it",
        )
    data = np.frombuffer(body, np.uint8, member.nbytes, member.offset).copy()
    return {array: member.array(data)}


def _zip_entries(body: bytes) -> int | None:
    """The number of members the zip's end record declares (None: no end record found),
    read before zipfile builds one object per member."""
    end = body.rfind(b"PK\x05\x06", max(0, len(body) - 22 - 0xFFFF))
    if end < 0 or end + 22 > len(body):
        return None
    return int.from_bytes(body[end + 10 : end + 12], "little")


def _load_npz(body: bytes, check_size: Callable[[int], None]) -> dict[str, np.ndarray]:
    entries = _zip_entries(body)
    if entries is not None and entries > MAX_NPZ_MEMBERS:
        raise _invalid(
            "body", f"the .npz declares {entries:,} members; at most {MAX_NPZ_MEMBERS} arrays"
        )
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise _invalid("body", f"not a .npz (zip) file: {exc}") from None
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_NPZ_MEMBERS:
            raise _invalid(
                "body", f"the .npz holds {len(infos):,} members; at most {MAX_NPZ_MEMBERS}"
            )
        members: list[tuple[zipfile.ZipInfo, _Member]] = []
        for info in infos:
            if not info.filename.endswith(".npy"):
                raise _invalid(info.filename, "an .npz member must be an .npy file (name.npy)")
            name = info.filename.removesuffix(".npy")
            try:
                with archive.open(info) as stream:
                    member = _npy_header(stream, name)
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError) as exc:
                raise _invalid(name, f"the member cannot be read: {exc}") from None
            # The directory's size and the header's must agree: zipfile inflates no more
            # than the directory says, and the header says what is allocated.
            if info.file_size != member.offset + member.nbytes:
                raise _invalid(
                    name,
                    f"the zip directory says the member holds {info.file_size:,} bytes, its "
                    f".npy header declares {member.dtype} {list(member.shape)} "
                    f"({member.offset + member.nbytes:,} bytes with the header)",
                )
            members.append((info, member))
        check_size(sum(m.nbytes for _, m in members))
        return {m.name: m.array(_inflate(archive, info, m)) for info, m in members}


def _inflate(archive: zipfile.ZipFile, info: zipfile.ZipInfo, member: _Member) -> np.ndarray:
    """The member's data, READ_CHUNK bytes at a time, into its declared size exactly."""
    out = np.empty(member.nbytes, np.uint8)
    view = out.data  # a memoryview of its bytes
    try:
        with archive.open(info) as stream:
            stream.read(member.offset)  # the header, read already
            filled = 0
            while filled < member.nbytes:
                chunk = stream.read(min(READ_CHUNK, member.nbytes - filled))
                if not chunk:
                    raise EOFError(f"the data ends after {filled:,} of {member.nbytes:,} bytes")
                view[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
            if stream.read(1):  # also where zipfile checks the CRC
                raise EOFError("more data follows what the header declares")
    except (zipfile.BadZipFile, EOFError, OSError, RuntimeError) as exc:
        raise _invalid(member.name, f"the member cannot be read: {exc}") from None
    return out


class DatasetCatalog:
    def __init__(self, settings: Settings, store: Store):
        self.settings = settings
        self.store = store

    async def put(
        self, owner: str, name: str, arrays: Mapping[str, np.ndarray]
    ) -> tuple[DatasetRow, bool]:
        """Store (or replace) a dataset within the limits; (row, created)."""
        if not arrays:
            raise ServiceError(
                "validation",
                "body: a dataset needs at least one array",
                errors=[{"field": "body", "message": "no arrays"}],
            )
        for array_name, array in arrays.items():
            if array.dtype.name not in DTYPES or array.dtype.hasobject:
                raise ServiceError(
                    "validation",
                    f"{array_name}: dtype {array.dtype} is not one of {', '.join(DTYPES)}",
                    errors=[{"field": array_name, "message": f"dtype {array.dtype}"}],
                )
        size = sum(int(a.nbytes) for a in arrays.values())
        existing = await asyncio.to_thread(self.store.get_dataset, owner, name)
        count, held = await asyncio.to_thread(self.store.dataset_usage, owner, name)
        self._check_size(size, held)
        s = self.settings
        if existing is None and count >= s.max_datasets_per_key:
            raise ServiceError(
                "dataset-too-large",
                f"this API key stores {count} dataset(s); the quota is "
                f"{s.max_datasets_per_key} (max_datasets_per_key)",
            )
        row = await asyncio.to_thread(self.store.put_dataset, owner, name, dict(arrays))
        return row, existing is None

    def _check_size(self, size: int, held: int) -> None:
        """Raise when a dataset of `size` bytes may not be stored beside `held` bytes."""
        s = self.settings
        if size > s.max_dataset_bytes:
            raise ServiceError(
                "dataset-too-large",
                f"the dataset holds {size:,} bytes; this server stores "
                f"at most {s.max_dataset_bytes:,} per dataset (max_dataset_bytes)",
            )
        if held + size > s.max_dataset_bytes_per_key:
            raise ServiceError(
                "dataset-too-large",
                f"this API key's datasets would hold {held + size:,} "
                f"bytes; its quota is {s.max_dataset_bytes_per_key:,} "
                "(max_dataset_bytes_per_key). DELETE datasets you no longer need",
            )

    async def size_check(self, owner: str, name: str) -> Callable[[int], None]:
        """The check an upload's declared size passes before it is decompressed: the
        per-dataset limit and this key's quota (leaving out the dataset it replaces)."""
        _, held = await asyncio.to_thread(self.store.dataset_usage, owner, name)
        return lambda size: self._check_size(size, held)

    async def get(self, owner: str, name: str, field: str | None = None) -> DatasetRow:
        row = await asyncio.to_thread(self.store.get_dataset, owner, name)
        if row is None:
            where = f"{field}: " if field else ""
            raise ServiceError(
                "dataset-not-found",
                f"{where}no stored dataset {name!r} (PUT /v1/datasets/{name} stores one; "
                "GET /v1/datasets lists yours)",
            )
        return row

    async def list(self, owner: str) -> list[DatasetRow]:
        return await asyncio.to_thread(self.store.list_datasets, owner)

    async def delete(self, owner: str, name: str) -> None:
        if not await asyncio.to_thread(self.store.delete_dataset, owner, name):
            await self.get(owner, name)  # the 404

    async def bind(
        self, owner: str, inputs: dict[str, Any], bindings: builtins.list[Binding]
    ) -> None:
        """Replace the dataset inputs (of a definition, or an influence request's test
        points) by references to the arrays."""
        for b in bindings:
            row = await self.get(owner, b.dataset, b.field)
            arrays = {a.name: a for a in row.arrays}
            names = list(arrays) if b.array is None else [b.array]
            for array_name in names:
                a = arrays.get(array_name)
                if a is None:
                    raise ServiceError(
                        "validation",
                        f"{b.field}.array: the dataset {b.dataset!r} has no "
                        f"array {array_name!r} (its arrays: {', '.join(arrays)})",
                        errors=[{"field": f"{b.field}.array", "message": "unknown array"}],
                    )
                # (Checked here, not only in the worker: the field as the client wrote it.)
                what = f"array {array_name!r} of dataset {b.dataset!r}"
                problem = rows_problem(b.rows, a.shape, what)
                if problem is not None:
                    raise _invalid(f"{b.field}.rows", problem)
                input_name = array_name if b.name is None else b.name
                if b.name is None and input_name in inputs:
                    raise ServiceError(
                        "validation",
                        f"{b.field}: the dataset's array {input_name!r} is an input already",
                        errors=[{"field": b.field, "message": "twice"}],
                    )
                inputs[input_name] = await asyncio.to_thread(
                    self.store.attach,
                    {
                        "dataset": b.dataset,
                        "array": array_name,
                        "blob": a.blob,
                        "dtype": a.dtype,
                        "shape": a.shape,
                        "rows": b.rows,
                    },
                )

    async def bind_prepared(self, owner: str, prepared: Prepared) -> Prepared:
        if prepared.bindings:
            payload = prepared.payload
            inputs = (
                payload["definition"]["inputs"]
                if "definition" in payload
                else payload["test_inputs"]
            )
            await self.bind(owner, inputs, prepared.bindings)
        return prepared
