"""Issue 27, item 6: a sharded tape's parts add up as the program says. Without
`shard_reduction`, a summed loss over three shards answered a third of its value (the
default was `mean`); now the reduction is read from the target's line (sum(...),
mean(...), a loss op's `reduction`, a mean plus a weight penalty), and where the program
does not say plainly, or says the opposite of the request, the answer is a 422 naming
shard_reduction: never a silently wrong total."""

from __future__ import annotations

import numpy as np
import pytest

from tests.service.test_tape_shards import SUM_PROGRAM, close, close_tensors, definition, record
from tests.service.wire import num, problem

MEAN_PENALTY = [
    "h = tanh(x @ w1 + b1)",
    "out = h @ w2",
    "loss = mean((out - y) ** 2) + 0.01 * sum(w1 ** 2)",
]
LOSS_OP_SUM = ["h = tanh(x @ w1 + b1)", "out = h @ w2", 'loss = mean_squared_error(out, y, "sum")']
UNCLEAR = ["h = tanh(x @ w1 + b1)", "out = h @ w2", "loss = sum((out - y) ** 2) + sum(w1 ** 2)"]


@pytest.mark.parametrize(
    "program, reduction",
    [(SUM_PROGRAM, "sum"), (MEAN_PENALTY, "mean"), (LOSS_OP_SUM, "sum")],
    ids=["sum", "mean-plus-penalty", "loss-op-sum"],
)
def test_the_reduction_is_read_from_the_program(client, program, reduction) -> None:
    plain = record(client, program=program)
    sharded = record(client, program=program, shards=3)
    info = client.get(f"/v1/tapes/{sharded['tape_id']}").json()
    assert info["shard_reduction"] == reduction
    close(num(sharded["value"]), num(plain["value"]))  # not a third of it
    close_tensors(sharded["gradients"], plain["gradients"])
    for tape in (plain, sharded):
        client.delete(f"/v1/tapes/{tape['tape_id']}")


def test_unclear_or_contradicted_reductions_are_refused(client) -> None:
    body = {"definition": definition(UNCLEAR), "target": "loss", "shards": 3}
    found = problem(client.post("/v1/tapes", json=body), 422)
    assert found["errors"][0]["field"] == "shard_reduction"
    assert "give 'mean'" in found["detail"] and "'sum'" in found["detail"]
    # Told, it is the client's word (the penalty then counts once per part, as documented).
    told = client.post("/v1/tapes", json={**body, "shard_reduction": "sum"})
    assert told.status_code == 201, told.text
    client.delete(f"/v1/tapes/{told.json()['tape_id']}")
    # The program says sum, the request mean: the silent third of issue 27, refused.
    body = {"definition": definition(SUM_PROGRAM), "target": "loss", "shards": 3}
    found = problem(client.post("/v1/tapes", json={**body, "shard_reduction": "mean"}), 422)
    assert "target is a sum over the batch" in found["detail"]
    # Stateless requests too.
    found = problem(client.post("/v1/gradient", json={**body, "shard_reduction": "mean"}), 422)
    assert found["errors"][0]["field"] == "shard_reduction"
    stateless = client.post("/v1/gradient", json=body)
    plain = client.post("/v1/gradient", json={k: v for k, v in body.items() if k != "shards"})
    assert np.isclose(num(stateless.json()["value"]), num(plain.json()["value"]), rtol=1e-12)
