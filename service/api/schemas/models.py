"""Stored models (PUT/GET /v1/models): requests and answers."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
)
from typing_extensions import TypeAliasType

from service.api.schemas.base import ModelName, RequestModel, allow_nonfinite_field
from service.api.schemas.definitions import Definition

# Stored models --------------------------------------------------------------------------


class ModelCreateRequest(RequestModel):
    """Store a definition (with its custom-gradient functions) under a name; requests
    then name it with `"model"` instead of sending the definition."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "clipped-square",
                    "description": "a custom gradient that clips to norm 0.5",
                    "definition": {
                        "variables": {"v": 2.0},
                        "functions": {
                            "clipped": {
                                "params": ["x"],
                                "forward": ["y = x"],
                                "backward": ["grad_x = clip_by_norm(upstream, 0.5)"],
                            }
                        },
                        "program": ["output = clipped(v * v)"],
                    },
                }
            ]
        }
    )

    name: ModelName
    definition: Definition
    description: str | None = Field(None, max_length=1000)
    replace: StrictBool = Field(False, description="Replace a model of the same name.")
    allow_nonfinite: StrictBool | None = allow_nonfinite_field()


# Stored models --------------------------------------------------------------------------


class TypeInfo(BaseModel):
    dtype: str
    shape: list[int]


class VariableInfo(TypeInfo):
    trainable: bool


Types = TypeAliasType(
    "Types", Annotated[dict[str, TypeInfo], Field(description="Shape and dtype by name.")]
)


VariableTypes = TypeAliasType(
    "VariableTypes",
    Annotated[
        dict[str, VariableInfo], Field(description="Shape, dtype and trainable by variable name.")
    ],
)


class ModelInfo(BaseModel):
    """A stored model: what its program defines."""

    name: str
    description: str | None = None
    digest: str = Field(description="SHA-256 of the stored definition (values included).")
    created_at: datetime
    updated_at: datetime
    variables: VariableTypes
    inputs: Types
    names: Types = Field(description="Every program line's name, shape, dtype.")
    functions: list[str]
    trainable: list[str] = Field(description="The default sources.")


class ModelList(BaseModel):
    models: list[ModelInfo]
