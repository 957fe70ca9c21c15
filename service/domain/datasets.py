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
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from service.core.config import Settings
from service.core.errors import ServiceError
from service.core.store import DatasetRow, Store
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


def load_numpy(body: bytes, array: str) -> dict[str, np.ndarray]:
    """The arrays of a .npz (by their names) or a .npy (named `array`), never unpickling."""
    try:
        loaded = np.load(io.BytesIO(body), allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return {array: loaded}
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ServiceError(
            "validation",
            f"body: not a .npy or .npz file NumPy reads without pickle: {exc}",
            errors=[{"field": "body", "message": str(exc)}],
        ) from None


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
        s = self.settings
        if size > s.max_dataset_bytes:
            raise ServiceError(
                "dataset-too-large",
                f"the dataset holds {size:,} bytes; this server stores "
                f"at most {s.max_dataset_bytes:,} per dataset (max_dataset_bytes)",
            )
        existing = await asyncio.to_thread(self.store.get_dataset, owner, name)
        count, held = await asyncio.to_thread(self.store.dataset_usage, owner, name)
        if held + size > s.max_dataset_bytes_per_key:
            raise ServiceError(
                "dataset-too-large",
                f"this API key's datasets would hold {held + size:,} "
                f"bytes; its quota is {s.max_dataset_bytes_per_key:,} "
                "(max_dataset_bytes_per_key). DELETE datasets you no longer need",
            )
        if existing is None and count >= s.max_datasets_per_key:
            raise ServiceError(
                "dataset-too-large",
                f"this API key stores {count} dataset(s); the quota is "
                f"{s.max_datasets_per_key} (max_datasets_per_key)",
            )
        row = await asyncio.to_thread(self.store.put_dataset, owner, name, dict(arrays))
        return row, existing is None

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
