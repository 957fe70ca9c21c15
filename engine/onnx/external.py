"""An uploaded model is one self-contained file: no tensor in it may point at external data.

ONNX lets a tensor keep its bytes in another file (`data_location: EXTERNAL` with a
`location`, `offset` and `length`). Read by the server, that location is a path on the
server's disk chosen by the client: `onnx.checker` refuses absolute paths, `..` and a
symlinked file, but passes a relative name, a subdirectory, `./sub/../sub/x` and a path
through a symlinked directory, and the bytes would come back as the model's parameters.
So every tensor anywhere in the model is looked at before the checker runs and before
any array is made, and each one that names external data is refused by name.

Places a tensor can sit: a graph's initializers and sparse initializers, node attributes
(TENSOR, TENSORS, SPARSE_TENSOR(S), and the subgraphs of GRAPH(S): If/Loop/Scan bodies,
to any depth), the nodes of the model's local functions, and training-info graphs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.onnx.errors import ModelProblem


def external_data_problems(proto: Any) -> list[ModelProblem]:
    """One problem per tensor of the ModelProto that uses external data (empty if none)."""
    return [
        ModelProblem(
            f"tensor {name!r} ({where}) keeps its data outside the model file "
            f"({_describe(tensor)}); an uploaded model must be one self-contained file: "
            "save it with its data inside (onnx.save_model(model, path, "
            "save_as_external_data=False), or torch.onnx.export(..., external_data=False))",
            "model",
            tensor=name,
        )
        for name, where, tensor in _tensors_of_model(proto)
        if _uses_external_data(tensor)
    ]


def _uses_external_data(tensor: Any) -> bool:
    from onnx import TensorProto

    # numpy_helper.to_array reads the file when data_location is EXTERNAL; a tensor that
    # only lists external_data entries is refused too (it says it lives elsewhere).
    return tensor.data_location == TensorProto.EXTERNAL or len(tensor.external_data) > 0


def _describe(tensor: Any) -> str:
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries.get("location")
    if location is None:
        return "data_location EXTERNAL"
    shown = location if len(location) <= 80 else location[:77] + "..."
    return f"location {shown!r}"


def _tensors_of_model(proto: Any) -> Iterator[tuple[str, str, Any]]:
    yield from _tensors_of_graph(proto.graph, "graph")
    for function in proto.functions:
        yield from _tensors_of_nodes(function.node, f"function {function.name!r}")
    for i, info in enumerate(proto.training_info):
        yield from _tensors_of_graph(info.initialization, f"training_info[{i}].initialization")
        yield from _tensors_of_graph(info.algorithm, f"training_info[{i}].algorithm")


def _tensors_of_graph(graph: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    for tensor in graph.initializer:
        yield tensor.name, f"initializer of {where}", tensor
    for sparse in graph.sparse_initializer:
        name = sparse.values.name or sparse.indices.name
        yield name, f"sparse initializer of {where}", sparse.values
        yield name, f"sparse initializer of {where} (indices)", sparse.indices
    yield from _tensors_of_nodes(graph.node, where)


def _tensors_of_nodes(nodes: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    for index, node in enumerate(nodes):
        node_name = node.name or f"#{index}"
        for attr in node.attribute:
            here = f"attribute {attr.name!r} of node {node_name!r} ({node.op_type}) in {where}"
            # The value's field is looked at whatever `type` says: a reader that trusts
            # `type` would miss a tensor hidden in the other fields.
            if attr.HasField("t"):
                yield attr.t.name or attr.name, here, attr.t
            for t in attr.tensors:
                yield t.name or attr.name, here, t
            sparse_values = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
            for sparse in [*sparse_values, *attr.sparse_tensors]:
                name = sparse.values.name or attr.name
                yield name, here, sparse.values
                yield name, here + " (indices)", sparse.indices
            if attr.HasField("g"):
                yield from _tensors_of_graph(attr.g, f"graph {attr.g.name!r} of {here}")
            for g in attr.graphs:
                yield from _tensors_of_graph(g, f"graph {g.name!r} of {here}")
