"""One batch split over workers: a sharded tape on a local Ray, answering as the
unsharded tape does.

`shards=n` on `client.tape(...)` splits the batch (here the inputs x and y, along their
first axis) over n workers; every request on the tape asks the parts and adds their
answers, so the loss, the gradient, Hessian-vector products and the algorithms
(eigenvalues here) equal the unsharded tape's up to float rounding. On Ray the workers
are actors, and the parts' answers move between them in Ray's object store: the same
code scales from one machine to a cluster (`GRADTAPE_RAY_ADDRESS`).

    gradtape serve --executor ray --workers 2        # in another terminal: a local Ray
    python examples/sharded_ray.py
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from gradtape.client import Client, Definition


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((args.examples, 10))
    y = np.sin(x[:, :2].sum(1, keepdims=True))
    definition = Definition(
        """
        h    = tanh(x @ W1 + b1)
        out  = h @ W2
        loss = mean((out - y) ** 2)
        """,
        variables={
            "W1": rng.standard_normal((10, 16)) * 0.3,
            "b1": np.zeros(16),
            "W2": rng.standard_normal((16, 1)) * 0.3,
        },
        inputs={"x": x, "y": y},
    )
    v = {"W1": rng.standard_normal((10, 16)), "b1": np.ones(16), "W2": rng.standard_normal((16, 1))}

    with Client(args.url) as client:
        answers = {}
        for shards in (None, args.shards):
            # "mean": the loss is a mean over the batch, so the parts weigh n_i / N.
            sharding = {"shards": shards, "shard_by": ["x", "y"], "shard_reduction": "mean"}
            with client.tape(definition, "loss", **(sharding if shards else {})) as tape:
                parts = tape.info().get("shards") or []
                answers[shards] = {
                    "loss": float(tape.value),
                    "gradient": tape.flatten(tape.gradients),
                    "hvp": tape.flatten(tape.hvp(v)),
                    "top": tape.eigenvalues(k=2, tol=1e-10).eigenvalues,
                }
            where = ", ".join(f"{p['rows']} rows on worker {p['worker']}" for p in parts)
            print(
                f"shards={shards}: loss {answers[shards]['loss']:.6f}"
                + (f" ({where})" if where else "")
            )

    whole, split = answers[None], answers[args.shards]
    differences = {
        name: float(
            np.max(np.abs(np.subtract(split[name], whole[name])) / (np.max(np.abs(whole[name]))))
        )
        for name in ("loss", "gradient", "hvp", "top")
    }
    print(
        "largest relative difference, sharded vs whole:",
        {k: f"{d:.1e}" for k, d in differences.items()},
    )
    print(json.dumps({"differences": differences, "top": whole["top"].tolist()}))


if __name__ == "__main__":
    main()
