"""An uploaded model is one self-contained file (issue 25): a tensor anywhere in it that
keeps its data in another file is refused by name, before the checker and before any array
is read. Each case puts a real file where the model's `location` points, in the working
directory the loader runs in: a loader that follows the location would read its bytes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine.onnx import ModelError, load_model

SECRET = np.arange(4, dtype=np.float32) + 1000.0  # what the file on "the server's disk" holds


def external(name: str, location: str, shape=(4,)) -> TensorProto:
    """A float tensor whose data lives in `location` (offset 0, the file's length)."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(SECRET.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def mul_model(nodes=None, initializers=(), sparse=(), opset: int = 17, functions=()) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])
    nodes = nodes or [helper.make_node("Mul", ["x", "w"], ["out"], name="mul")]
    graph = helper.make_graph(
        nodes, "g", [x], [out], list(initializers), sparse_initializer=list(sparse)
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], functions=list(functions)
    )
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture
def server_disk(tmp_path: Path, monkeypatch) -> Path:
    """A working directory holding the secret as a plain file, in a subdirectory, and
    behind a symlinked directory; the test runs there."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "elsewhere").mkdir()
    for path in ("secret.bin", "sub/secret.bin", "elsewhere/secret.bin"):
        (tmp_path / path).write_bytes(SECRET.tobytes())
    os.symlink(tmp_path / "elsewhere", tmp_path / "linked")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(data: bytes, tensor: str) -> str:
    with pytest.raises(ModelError) as info:
        load_model(data)
    problems = info.value.problems
    assert [p.tensor for p in problems] == [tensor], problems
    message = problems[0].message
    assert "self-contained" in message and "checker" not in message, message
    return message


@pytest.mark.parametrize(
    "location",
    ["secret.bin", "sub/secret.bin", "./sub/../sub/secret.bin", "linked/secret.bin"],
    ids=["relative-name", "subdirectory", "dot-dot-inside", "symlinked-directory"],
)
def test_an_initializer_with_external_data_is_refused_by_name(server_disk, location) -> None:
    # Each of these passes onnx.checker; before issue 25 the model loaded with the
    # secret's bytes as its parameter `w`.
    message = refused(mul_model(initializers=[external("w", location)]), "w")
    assert repr(location) in message


def test_the_store_file_in_the_working_directory_is_not_read(server_disk) -> None:
    # The Docker image's working directory is its data directory, with the SQLite store.
    (server_disk / "gradtape.sqlite3").write_bytes(SECRET.tobytes())
    refused(mul_model(initializers=[external("w", "gradtape.sqlite3")]), "w")


def test_a_constant_node_value_with_external_data_is_refused(server_disk) -> None:
    node = helper.make_node("Constant", [], ["w"], name="c", value=external("cw", "secret.bin"))
    nodes = [node, helper.make_node("Mul", ["x", "w"], ["out"], name="mul")]
    assert "'value' of node 'c' (Constant)" in refused(mul_model(nodes), "cw")


def test_a_sparse_initializer_with_external_data_is_refused(server_disk) -> None:
    values = external("sw", "secret.bin", shape=(1,))
    indices = numpy_helper.from_array(np.array([0], np.int64), "sw_indices")
    sparse = helper.make_sparse_tensor(values, indices, [4])
    assert "sparse initializer" in refused(mul_model(sparse=[sparse]), "sw")


def _branch(name: str, tensor: TensorProto) -> onnx.GraphProto:
    out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [4])
    node = helper.make_node("Constant", [], [f"{name}_out"], name=f"{name}_c", value=tensor)
    return helper.make_graph([node], name, [], [out])


def test_an_if_branch_constant_with_external_data_is_refused(server_disk) -> None:
    plain = numpy_helper.from_array(np.ones(4, np.float32), "ones")
    cond = numpy_helper.from_array(np.array(True), "cond")
    node = helper.make_node(
        "If",
        ["cond"],
        ["w"],
        name="if",
        then_branch=_branch("then", external("deep", "sub/secret.bin")),
        else_branch=_branch("else", plain),
    )
    nodes = [node, helper.make_node("Mul", ["x", "w"], ["out"], name="mul")]
    message = refused(mul_model(nodes, initializers=[cond]), "deep")
    assert "graph 'then'" in message and "node 'if' (If)" in message


def test_a_loop_body_initializer_nested_in_an_if_is_refused(server_disk) -> None:
    # A Loop body (with its own initializer) inside an If branch: any depth is walked.
    body_in = [
        helper.make_tensor_value_info("i", TensorProto.INT64, []),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        helper.make_tensor_value_info("acc", TensorProto.FLOAT, [4]),
    ]
    body_out = [
        helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [4]),
    ]
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c"], ["c_out"]),
            helper.make_node("Add", ["acc", "loop_w"], ["acc_out"]),
        ],
        "body",
        body_in,
        body_out,
        [external("loop_w", "linked/secret.bin")],
    )
    then_out = helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [4])
    then = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["t_out"], name="loop", body=body)],
        "then",
        [],
        [then_out],
    )
    node = helper.make_node(
        "If",
        ["cond"],
        ["out"],
        name="if",
        then_branch=then,
        else_branch=_branch("else", external("e", "secret.bin")),
    )
    consts = [
        numpy_helper.from_array(np.array(True), "cond"),
        numpy_helper.from_array(np.array(2, np.int64), "n"),
    ]
    with pytest.raises(ModelError) as info:
        load_model(mul_model([node], initializers=consts))
    assert sorted(p.tensor for p in info.value.problems) == ["e", "loop_w"]


def test_a_function_node_attribute_with_external_data_is_refused(server_disk) -> None:
    function = helper.make_function(
        "local",
        "f",
        ["a"],
        ["b"],
        [
            helper.make_node("Constant", [], ["k"], value=external("fk", "secret.bin")),
            helper.make_node("Mul", ["a", "k"], ["b"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    nodes = [helper.make_node("f", ["x"], ["out"], domain="local", name="call")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [out]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
        functions=[function],
    )
    model.ir_version = 8
    assert "function 'f'" in refused(model.SerializeToString(), "fk")


def test_a_self_contained_model_still_loads(server_disk) -> None:
    weights = numpy_helper.from_array(np.full(4, 2.0, np.float32), "w")
    model = load_model(mul_model(initializers=[weights]))
    np.testing.assert_array_equal(model.params["w"], np.full(4, 2.0, np.float32))
