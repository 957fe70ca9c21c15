"""service/api/bodies.py on its own: the msgpack walk builds what msgpack.unpackb builds,
counts every list and map before building it, and refuses at exactly the limits; JSON
problems are raised where the body is parsed, with the position."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.bodies import BodyShape, parse_json, unpack_msgpack
from service.api.problems import ProblemError

LOOSE = BodyShape(max_depth=10_000, max_containers=10**9)

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=300),
)
documents = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20), st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=200,
)


@settings(max_examples=150, deadline=None)
@given(documents)
def test_the_walk_builds_what_unpackb_builds(document: Any) -> None:
    packed = msgpack.packb(document, use_bin_type=True)
    assert unpack_msgpack(packed, LOOSE) == msgpack.unpackb(packed, raw=False)


def test_long_headers_and_every_length_form() -> None:
    # fix/16/32-bit arrays, maps, strings and bins, and a list of scalars long enough to
    # take the walk's fast loop past a buffer refill
    document = {
        "a" * 40_000: [
            list(range(20)),
            list(range(70_000)),
            "x" * 70_000,
            b"y" * 300,
            {str(i): i for i in range(20)},
            {str(i): [i] for i in range(70_000)},
        ]
    }
    packed = msgpack.packb(document, use_bin_type=True)
    assert unpack_msgpack(packed, LOOSE) == document


def nested(depth: int) -> bytes:
    return b"\x91" * (depth - 1) + b"\x90"


def test_the_limits_are_exact() -> None:
    shape = BodyShape(max_depth=5, max_containers=7)
    assert unpack_msgpack(nested(5), shape) == [[[[[]]]]]
    with pytest.raises(ProblemError, match="more than 5 levels") as deep:
        unpack_msgpack(nested(6), shape)
    assert deep.value.slug == "malformed-body"
    seven = msgpack.packb([[], {}, [1], {"a": [2]}, []])  # 1 + 6 = 7 containers
    assert unpack_msgpack(seven[:1] + seven[1:], shape) == msgpack.unpackb(seven)
    with pytest.raises(ProblemError, match="more than 7 lists and objects") as many:
        unpack_msgpack(msgpack.packb([[], {}, [1], {"a": [2]}, [], []]), shape)
    assert many.value.slug == "too-large"


def test_json_problems_come_from_the_parse_with_the_position() -> None:
    with pytest.raises(ProblemError) as bad:
        parse_json(b'{"a": [1, 2,]}', LOOSE)
    assert bad.value.slug == "malformed-body"
    assert str(bad.value) == "the body is not valid JSON: Expecting value at character 12"
    with pytest.raises(ProblemError, match="not UTF-8 text"):
        parse_json(b'{"a": "\xff"}', LOOSE)
