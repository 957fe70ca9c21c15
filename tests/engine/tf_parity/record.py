"""Record TensorFlow's answers to the parity programs into reference.json.

Runs where TensorFlow is installed (not in CI), from the repository root:

    python3 -m venv /work/tfvenv && /work/tfvenv/bin/pip install tensorflow-cpu==2.21.0 numpy
    /work/tfvenv/bin/python tests/engine/tf_parity/record.py

Only this script imports TensorFlow; tests/engine/test_tf_parity.py reads the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.engine.tf_parity.programs import PROGRAMS
from tests.engine.tf_parity.serialize import to_json

OUT = Path(__file__).with_name("reference.json")

TF = SimpleNamespace(
    GradientTape=tf.GradientTape,
    ForwardAccumulator=tf.autodiff.ForwardAccumulator,
    UnconnectedGradients=tf.UnconnectedGradients,
    custom_gradient=tf.custom_gradient,
    Variable=tf.Variable,
    constant=tf.constant,
    reduce_sum=tf.reduce_sum,
    exact_variance=tf.math.reduce_variance,
    zeros_like=tf.zeros_like,
    ones_like=tf.ones_like,
    where=tf.where,
    exp=tf.exp,
    log=tf.math.log,
    sin=tf.sin,
    cos=tf.cos,
    sqrt=tf.sqrt,
    rsqrt=tf.math.rsqrt,
    reciprocal=tf.math.reciprocal,
    abs=tf.abs,
    sign=tf.sign,
    relu=tf.nn.relu,
    leaky_relu=tf.nn.leaky_relu,
    gelu=tf.nn.gelu,
    norm=tf.norm,
    identity=tf.identity,
    erf=tf.math.erf,
    xlogy=tf.math.xlogy,
    divide_no_nan=tf.math.divide_no_nan,
    gather_nd=tf.gather_nd,
    scatter_nd=tf.scatter_nd,
    cumsum=tf.math.cumsum,
    sort=tf.sort,
    top_k=tf.math.top_k,
    pad=tf.pad,
    tile=tf.tile,
    split=tf.split,
    unstack=tf.unstack,
    moments=tf.nn.moments,
    clip_by_global_norm=tf.clip_by_global_norm,
)


def main() -> None:
    rows: dict[str, Any] = {}
    for name, (item, fn, inputs) in PROGRAMS.items():
        args = [tf.constant(x) for x in inputs]
        rows[name] = {
            "item": item,
            "inputs": [x.tolist() for x in inputs],
            "answer": to_json(fn(TF, *args)),
        }
        print(f"{name}: recorded")
    document = {
        "tensorflow": tf.__version__,
        "numpy": np.__version__,
        "note": "written by tests/engine/tf_parity/record.py; do not edit by hand",
        "rows": rows,
    }
    OUT.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"{len(rows)} rows -> {OUT}")


if __name__ == "__main__":
    main()
