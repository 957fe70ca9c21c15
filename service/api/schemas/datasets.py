"""Stored datasets (PUT/GET /v1/datasets): answers."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import (
    BaseModel,
    Field,
)
from typing_extensions import TypeAliasType

from service.api.schemas.models import TypeInfo


class DatasetArrayInfo(TypeInfo):
    bytes: int


DatasetArrays = TypeAliasType(
    "DatasetArrays",
    Annotated[dict[str, DatasetArrayInfo], Field(description="The arrays by name.")],
)


class DatasetInfo(BaseModel):
    """A stored dataset: its arrays (name, dtype, shape, bytes)."""

    name: str
    version: str = Field(description="SHA-256 over its arrays: changes whenever they do.")
    bytes: int = Field(description="Bytes of all its arrays.")
    arrays: DatasetArrays
    created_at: datetime
    updated_at: datetime


class DatasetList(BaseModel):
    datasets: list[DatasetInfo]
