"""Property-based tests of the live server against its own OpenAPI document: requests
generated from the schema (valid and invalid, JSON and msgpack) never get a server error
or an answer that breaks the schema. Bounded: a fixed number of examples per operation,
derandomized, no time-based runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance


def _msgpack_ints(value: Any) -> Any:
    """msgpack carries integers within 64 bits; JSON's bigger ones travel as floats."""
    if isinstance(value, dict):
        return {k: _msgpack_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_msgpack_ints(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return float(value)
    return value


@schemathesis.serializer("application/msgpack")
def _pack(ctx: Any, value: Any) -> bytes:
    return msgpack.packb(_msgpack_ints(value), use_bin_type=True)


def _bytes_as_lists(value: Any) -> Any:
    """A msgpack answer as its JSON form: raw tensor bytes become data lists."""
    if isinstance(value, dict):
        data = value.get("data")
        if isinstance(data, bytes) and "dtype" in value:
            array = np.frombuffer(data, np.dtype(value["dtype"]).newbyteorder("<"))
            return {**value, "data": array.astype(np.float64).tolist()}
        return {k: _bytes_as_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bytes_as_lists(v) for v in value]
    return value


@schemathesis.deserializer("application/msgpack")
def _unpack(ctx: Any, response: Any) -> Any:
    return _bytes_as_lists(msgpack.unpackb(response.content, raw=False))


# The published contract, loaded at import (test_openapi.py keeps it equal to the app's).
# Loaded eagerly rather than through `schemathesis.pytest.from_fixture`: the lazy loader
# reads pytest's private `Item._nodeid`, which pytest 9.2 removed.
CONTRACT = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
schema = schemathesis.openapi.from_path(CONTRACT)


@schema.parametrize()
@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api(case, server) -> None:
    # Every check but "schema-valid data is accepted": a definition can satisfy the schema
    # and still not run (an undefined name), which is a 422, not a failure.
    case.call_and_validate(base_url=server.base_url, excluded_checks=[positive_data_acceptance])
