"""Kronecker-factored curvature (KFAC, EKFAC) on the matmul and convolution layers of a
model, found in its recorded program (curvlinops' KFACLinearOperator, EKFACLinearOperator
and KFACInverseLinearOperator; Martens and Grosse 2015, George et al. 2018, Eschenhagen
et al. 2023 for weight sharing).

    curv = Curvature(model, loss, params, data, targets)
    K = kfac(curv, curvature="ggn", sharing="expand")     # a KFAC, its blocks, products
    K.operator()       # a HessianOperator: lanczos, traces, CG, influence run on it
    K.inverse_product(v, damping=1e-3)                    # (K + damping I)^-1 v, exact

A layer is an op where a parameter W (or a reshape of it: a convolution's kernel) meets
the data as a matrix product, x @ W or W @ x (engine/per_example.py finds them and the
example each row belongs to), with an optional bias b added to its output, entry j on
the output's column j, through ops that pass elements on unchanged (copies and moves:
what each op is, K-FAC asks its declaration, registry.LINEAR_FORM and ELEMENT_FLOW,
never its name). In the layer's own frame, rows a (the data's rows, with a
1 appended when there is a bias) times the matrix [W; b] (k + 1, m) give the output rows,
and the block of the curvature on [W; b] is approximated by A (x) G acting as
M -> A M G, with, for the examples' rows a_ip (example i, shared position p of P) and
the output rows' cotangents g_ip (one per column of the loss Hessian's square root for
the type-2 Fisher/GGN, per Monte-Carlo target draw for the MC Fisher, the targets'
gradient for the empirical Fisher):

    expand   A = (1 / (N P)) sum_ip a_ip a_ip^T        G = w sum_{col,ip} g g^T
    reduce   A = (1 / N) sum_i abar_i abar_i^T          G = w sum_{col,i} gsum_i gsum_i^T
             (abar_i the mean of a_ip over p, gsum_i the sum of g_ip over p)

with w = c for the GGN (c: the loss's per-example scale, curvature.py), 1 / (k S) for S
Monte-Carlo draws (k the likelihood's scale, seeds the batch loss's gradients), 1 / c for
the empirical Fisher: curvlinops' scaling, and KFAC is exact for a single linear layer
without weight sharing.

A loss with several terms per example (an output (N, T, C) under a softmax or a squared
error per position): the columns are those of the square root of example i's whole loss
Hessian, T C of them, each seeding one position (the Hessian is block-diagonal over the
positions). "expand" is then curvlinops' G; "reduce" is not: curvlinops backpropagates
column c of every position's own square root together, so its gsum gsum^T holds the
products S_p S_q^T of two positions' square roots (p != q), numbers that depend on which
square root is taken and that its own Monte-Carlo "reduce" (labels drawn per position,
gradients summed) does not estimate (a 5-6-3 tanh network, T = 3: its MC G at 20,000
draws within 0.6% of ours, its type-2 G about 3 times ours). tests/engine/
test_kfac_positions.py checks the convention against a dense reference, the exact
expectation over every label configuration, and curvlinops where installed. With one
term per example (an output (N, C)) the two are the same and equal curvlinops' recorded
factors (test_kfac_laplace.py). The empirical Fisher's G follows the engine's
per-example empirical Fisher (curvature.py: one gradient per example, of its loss as
written): with T terms per example averaged, G is curvlinops' (one gradient per term)
divided by T, in both modes (tested there too).

EKFAC keeps the eigenvectors of A and G and replaces the eigenvalues by the curvature's
diagonal in that basis, w sum_{col,i} ((Q_A^T X_i Q_G)^2) with X_i the per-example
gradient matrix sum_p a_ip g_ip^T.

Parameters outside such layers are never dropped: `others="refuse"` (the default) names
them and stops; `others="exact"` keeps the exact curvature block on them (its matrix,
from as many curvature products as they have entries), block-diagonal beside the layers.
A parameter the model's output does not depend on at all (one feeding only another of
the module's outputs) is neither: the curvature on it is exactly zero, and so is its
block here, listed in `unreached` (its products zero, its damped inverse v / damping).

The log-determinant is the sum of log(eigenvalue + damping) over every block's
eigenvalues: -inf (not NaN, as curvlinops answers) when a factor is singular and
damping is 0; a Laplace posterior always adds a positive prior precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import backend, trace, tree
from engine.curvature import CurvatureError, CurvatureOperator, _single_target
from engine.per_example import (
    MatmulLayout,
    Meeting,
    MixedExamplesError,
    PerExample,
    cotangent_rows,
    matmul_layout,
    per_example,
)
from engine.registry import ELEMENT_FLOW, LINEAR_FORM, impl_rules
from engine.tensor import Tensor
from engine.transforms import value_and_grad

SHARING = ("expand", "reduce")
OTHERS = ("refuse", "exact")
CURVATURES = ("ggn", "fisher", "empirical_fisher")
EXACT_OTHERS_MAX = 4096  # the entries an exact block may have (its matrix is held)


@dataclass
class Layer:
    """One Kronecker block: the weight's (and bias's) index among the flat parameters,
    how a weight vector maps to the layer's (k, m) frame, and its factors."""

    name: str
    weight: int
    bias: Any  # int, or None without a bias
    meeting: Meeting
    layout: MatmulLayout
    frame: tuple  # (the param-side shape of the matmul, swap): W's flat entries -> (k, m)
    kind: str  # "linear" or "conv" (the data went through im2col)
    # Set by KFAC once fitted (Any: always arrays by then).
    A: Any = None
    G: Any = None
    eig_a: Any = None  # (eigenvalues, eigenvectors)
    eig_g: Any = None
    corrected: Any = None  # EKFAC's eigenvalues, (k [+1], m)
    corrected_bias: Any = None  # (m,), a separate bias's
    joint: bool = False  # the bias is the ones row of [W; b] (else its own block, G)


# K-FAC looks back from a layer's matmul to its weight, and from a bias's add to the
# matmul, through ops that pass elements on unchanged in value (a copy, a reshape, a
# transpose, ...): what each op is comes from its declaration (registry.ELEMENT_FLOW
# "moves", registry.LINEAR_FORM "copies"), and where it puts each element from running
# its impl on the elements' positions, never from its name.
LOOK_BACK = 16  # the ops followed back from one meeting


def _passes_on(rec: Any) -> bool:
    """The record hands its one input's elements on with their values unchanged: a copy
    (LINEAR_FORM "copies": identity, a float cast, a Variable's read) or a move
    (ELEMENT_FLOW "moves": reshape, transpose, getitem, pad, ...); _moved says where."""
    if rec.prim is None or len(rec.inputs) != 1 or len(rec.outputs) != 1:
        return False
    return LINEAR_FORM.get(rec.prim) == "copies" or ELEMENT_FLOW.get(rec.prim) == "moves"


def _moved(rec: Any, positions: np.ndarray) -> np.ndarray:
    """`positions` (ints in the record's input's shape, naming each input element) where
    the record puts the elements: its impl run on them, -1 where it fills in a value (a
    pad's)."""
    if LINEAR_FORM.get(rec.prim) == "copies":
        return positions
    params = {name: _on_host(value) for name, value in rec.params.items()}
    if "value" in params:
        params["value"] = -1
    return np.asarray(impl_rules[rec.prim](np, positions, **params))


def _on_host(value: Any) -> Any:
    """A record's parameter for its impl run on host positions: a device array (a GPU
    getitem's index) copied to the host, inside tuples and lists too."""
    if isinstance(value, tuple | list):
        return type(value)(_on_host(v) for v in value)
    return backend.to_host(value) if backend.is_array(value) else value


# Positions are int32 below 2^31 entries (half of int64's bytes for a large weight), and
# compared with the running count a block of this many entries at a time.
_COMPARE_BLOCK = 1 << 16


def _identity_positions(shape: tuple[int, ...]) -> np.ndarray:
    size = math.prod(shape)
    return np.arange(size, dtype=np.int32 if size < 2**31 else np.int64).reshape(shape)


def _counts_up(frame: np.ndarray) -> bool:
    """Whether the matrix `frame` holds 0, 1, 2, ... in row-major order (the weight's
    entries in their own order), checked a block of rows at a time."""
    rows, cols = frame.shape
    step = max(1, _COMPARE_BLOCK // max(cols, 1))
    for r in range(0, rows, step):
        block = frame[r : r + step]
        if not np.array_equal(block.ravel(), np.arange(r * cols, r * cols + block.size)):
            return False
    return True


def _back_to(flow: Any, t: Tensor, found: Any) -> tuple[Any, list] | None:
    """Walk back from `t` through records that pass elements on until `found(tensor)`
    answers something: (that answer, the records walked, last first); None when another
    op is met first."""
    chain: list = []
    for _ in range(LOOK_BACK):
        hit = found(t)
        if hit is not None:
            return hit, chain
        rec = flow.made_by.get(id(t))
        if rec is None or not _passes_on(rec):
            return None
        chain.append(rec)
        t = rec.inputs[0]
    return None


def _carried(chain: list, positions: np.ndarray) -> np.ndarray:
    for rec in reversed(chain):
        positions = _moved(rec, positions)
    return positions


def _param_positions(flow: Any, params: list[Tensor], t: Tensor) -> tuple[int, np.ndarray] | None:
    """(i, positions): `t` is parameter i passed on unchanged in value (a reshape: a
    convolution's kernel; a copy or cast: a program's read of a variable; a transpose:
    ONNX's Gemm with transB), `positions` (t's shape) the flat index of i's entry at each
    element of t; None when t is not made so from one parameter."""
    index = {id(p): i for i, p in enumerate(params)}
    walked = _back_to(flow, t, lambda x: index.get(id(x)))
    if walked is None:
        return None
    i, chain = walked
    return i, _carried(chain, _identity_positions(params[i].shape))


def _frame(meeting: Meeting, positions: np.ndarray, size: int) -> tuple | None:
    """How the weight's flat entries make the layer's (k, m) matrix (its rows contracted
    with the data's, its columns the output's): (shape, swap), the matrix being the
    entries reshaped to `shape`, transposed when `swap` (Layer.frame); None when the
    matmul's operand is neither (a slice, a broadcast, a scrambled copy of the weight).
    `positions`: the weight's entry at each element of the operand, `size` its entries."""
    rec, j = meeting.record, meeting.argnum
    op = np.swapaxes(positions, -1, -2) if rec.params.get("tb" if j else "ta") else positions
    if op.ndim == 1:  # NumPy's vector operand: a column on the right, a row on the left
        op = op[:, None] if j == 1 else op[None, :]
    if op.size != size:
        return None
    op = op.reshape(op.shape[-2:])  # the batch axes are all 1 (find_layers checks)
    frame = op if j == 1 else op.T  # x @ P: P is the frame; P @ x = (x^T P^T)^T: P^T
    if _counts_up(frame):
        return frame.shape, False
    if _counts_up(frame.T):
        return frame.T.shape, True
    return None


def _columns(layer: Layer) -> np.ndarray:
    """The layer's output column (its frame's m index) of each element of the matmul's
    output (int32, the output's shape)."""
    out, layout = layer.meeting.record.outputs[0], layer.layout
    full = list(out.shape)
    if layout.vector is not None:  # NumPy drops a vector operand's axis (cotangent_rows)
        full.insert(len(full) + 1 + layout.vector, 1)
    axis = -2 if layout.swap else -1
    cols = np.arange(full[axis], dtype=np.int32).reshape((-1,) + (1,) * (-axis - 1))
    cols = np.broadcast_to(cols, full)
    return cols.reshape(out.shape)


def find_layers(
    engine: PerExample, params: list[Tensor], names: list[str]
) -> tuple[list[Layer], list[int]]:
    """The Kronecker layers of a recording and the indices of the parameters outside them."""
    flow = engine.flow
    layers: dict[int, Layer] = {}
    # A parameter that meets the data more than once (a tied weight: x @ W and h @ W^T,
    # or W also scaling elsewhere) is in no one layer's block: its curvature couples
    # the uses, so it stays outside the layers (refused, or its exact block).
    tied = _shared_parameters(flow, params)
    used: set[int] = set(tied)
    for m in flow.meetings:
        if m.kind != "matmul":
            continue
        found = _param_positions(flow, params, m.record.inputs[m.argnum])
        if found is None or found[0] in used:
            continue
        w, positions = found
        layout = flow.layouts.get(id(m.record)) or matmul_layout(flow, m)
        flow.layouts[id(m.record)] = layout
        if math.prod(layout.kept) != 1:
            continue  # grouped convolutions: one block per group is not built here
        # The weight as stored -> the layer's (k, m) frame: x @ W is W itself, W @ x its
        # transpose, a weight the program transposes first (ONNX's Gemm, transB) the
        # other way round.
        frame = _frame(m, positions, params[w].size)
        if frame is None:
            continue
        kind = "conv" if _through_windows(flow, m.record.inputs[1 - m.argnum]) else "linear"
        layers[id(m.record)] = Layer(names[w], w, None, m, layout, frame, kind)
        used.add(w)
    for m in flow.meetings:
        # A bias: added (LINEAR_FORM "sums") to a layer's output passed on unchanged in
        # value, entry j of the bias on every element of the output's column j (so that
        # its gradient is the column sums of the output's, the 1 appended to a).
        rec = m.record
        if m.kind != "elementwise" or rec.prim is None or LINEAR_FORM.get(rec.prim) != "sums":
            continue
        if len(rec.inputs) != 2:
            continue
        found = _param_positions(flow, params, rec.inputs[m.argnum])
        if found is None or found[0] in used:
            continue
        b, positions = found
        walked = _back_to(flow, rec.inputs[1 - m.argnum], lambda x: _layer_of(flow, layers, x))
        if walked is None:
            continue
        layer, chain = walked
        if layer.bias is not None or params[b].size != _out_width(layer):
            continue
        columns = _carried(chain, _columns(layer))
        shape = rec.outputs[0].shape
        if not np.array_equal(np.broadcast_to(positions, shape), np.broadcast_to(columns, shape)):
            continue  # the bias runs along another axis than the layer's columns
        layer.bias = b
        layer.name = f"{names[layer.weight]}+{names[b]}"
        used.add(b)
    others = [i for i in range(len(params)) if i not in used or i in tied]
    return list(layers.values()), others


def _layer_of(flow: Any, layers: dict[int, Layer], t: Tensor) -> Layer | None:
    """The layer whose matmul outputs `t`, if any."""
    rec = flow.made_by.get(id(t))
    return layers.get(id(rec)) if rec is not None else None


def _through_windows(flow: Any, t: Tensor) -> bool:
    """The matmul's data is a convolution's windows (LINEAR_FORM "windows": im2col),
    passed on unchanged in value (the unfused convolution's reshapes and transpose)."""
    return _back_to(flow, t, lambda x: _windows_made(flow, x)) is not None


def _windows_made(flow: Any, t: Tensor) -> bool | None:
    rec = flow.made_by.get(id(t))
    if rec is not None and rec.prim is not None and LINEAR_FORM.get(rec.prim) == "windows":
        return True
    return None


def _reaching(flow: Any, params: list[Tensor]) -> set[int]:
    """The indices of the parameters the model's output depends on: an input of a record
    on the walk from the parameters to the output (or the output itself)."""
    inputs = {id(x) for rec in flow.plan for x in rec.inputs} | {id(flow.output)}
    return {i for i, p in enumerate(params) if id(p) in inputs}


def _shared_parameters(flow: Any, params: list[Tensor]) -> set[int]:
    """The indices of the parameters that reach more than one meeting with the data
    (through parameter-only ops)."""
    index = {id(p): i for i, p in enumerate(params)}
    uses = [0] * len(params)
    for m in flow.meetings:
        reached: set[int] = set()
        stack, seen = [m.record.inputs[m.argnum]], set()
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) in index:
                reached.add(index[id(t)])
                continue
            rec = flow.made_by.get(id(t))
            if rec is not None:
                stack.extend(x for x in rec.inputs if id(x) in flow.param_only)
        for i in reached:
            uses[i] += 1
    return {i for i, count in enumerate(uses) if count > 1}


def _out_width(layer: Layer) -> int:
    side, swap = layer.frame
    return side[0] if swap else side[1]


# ----------------------------------------------------------------------------------------
# The seeds: output cotangents whose layer cotangents make G
# ----------------------------------------------------------------------------------------


def loss_hessian_sqrt(curv: Any) -> np.ndarray:
    """S (N, R, R) with S_i S_i^T the Hessian of example i's loss l_i on its output row
    (R entries): R loss-Hessian products, one per output coordinate in every row at
    once, then an eigendecomposition per example (negative eigenvalues, which a convex
    loss has only from rounding, clipped to 0)."""
    out = curv.output
    n, r = out.shape[0], out.size // out.shape[0]
    xp = backend.array_module(out.value)
    units = xp.zeros((r, n, r), out.dtype)
    units[np.arange(r), :, np.arange(r)] = 1.0
    loss_op = curv._output_loss()
    cols = loss_op._apply((Tensor(units.reshape((r,) + out.shape)),), 1)[0].value
    h = np.asarray(backend.to_host(cols), np.float64).reshape(r, n, r).transpose(1, 2, 0)
    h = (h + np.swapaxes(h, 1, 2)) / (2 * curv.scale())
    vals, vecs = np.linalg.eigh(h)
    return vecs * np.sqrt(np.clip(vals, 0.0, None))[:, None, :]


def _seeds(
    curv: Any, curvature: str, samples: int | None, seed: int | None, sampled: Any
) -> tuple[np.ndarray, float]:
    """(seeds (C, *output.shape), w): the output cotangents and G's weight (module doc)."""
    out = curv.output
    if curvature == "empirical_fisher":
        return np.asarray(backend.to_host(curv.output_grad.value))[None], 1.0 / curv.scale()
    if curvature == "fisher" and (samples is not None or sampled is not None):
        likelihood = curv.likelihood()
        if sampled is not None:
            gs = _target_gradients(curv, sampled)
        else:
            gs = curv._sample_gradients(samples, seed)
        gs = np.asarray(backend.to_host(gs))
        return gs, 1.0 / (likelihood.scale * gs.shape[0])
    if curvature == "fisher":
        curv.likelihood()  # the exact Fisher is the GGN of a recognised likelihood
    s = loss_hessian_sqrt(curv)  # (N, R, R)
    r = s.shape[1]
    return np.ascontiguousarray(s.transpose(2, 0, 1)).reshape((r,) + out.shape), curv.scale()


def _target_gradients(curv: Any, sampled: Any) -> Any:
    """d loss(output, y_s) / d output for given target draws y_s (in the targets' form):
    the Monte-Carlo seeds with draws made elsewhere (a reference's, in tests)."""
    _, rebuild = _single_target(curv.targets)
    detached = Tensor(curv.output.value)
    grads = []
    for y in sampled:
        target = rebuild(
            Tensor(backend.asarray(np.asarray(y), np.asarray(y).dtype, curv.output.device))
        )
        with trace.nothing_recording():
            _, g = value_and_grad(lambda o, t=target: curv._loss(o, t))(detached)
        grads.append(np.asarray(backend.to_host(g.value)))
    return np.stack(grads)


# ----------------------------------------------------------------------------------------
# KFAC
# ----------------------------------------------------------------------------------------


class KFAC:
    """Kronecker factors of one curvature of a Curvature recording (module doc)."""

    def __init__(
        self,
        curv: Any,
        curvature: str = "ggn",
        *,
        sharing: str = "expand",
        samples: int | None = None,
        seed: int | None = 0,
        others: str = "refuse",
        ekfac: bool = False,
        names: list[str] | None = None,
        sampled_targets: Any = None,
        separate_bias: bool = True,
        subset: list[int] | None = None,
    ):
        if curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {', '.join(CURVATURES)}, got {curvature!r}")
        if sharing not in SHARING:
            raise ValueError(f"sharing must be one of {', '.join(SHARING)}, got {sharing!r}")
        if others not in OTHERS:
            raise ValueError(f"others must be one of {', '.join(OTHERS)}, got {others!r}")
        if samples is not None and curvature != "fisher":
            raise ValueError("samples is for the Monte-Carlo Fisher (curvature 'fisher')")
        self.curv, self.curvature, self.sharing = curv, curvature, sharing
        self.samples, self.seed, self.ekfac = samples, seed, ekfac
        self.others_mode = others
        params = curv._flat
        if names is None:
            names = [f"param{i}" for i in range(len(params))]
        self.names = names
        try:
            curv.scale()
            engine = PerExample.of(curv)
        except MixedExamplesError as exc:
            raise CurvatureError(str(exc).replace("per-example:", "kfac:")) from None
        self.layers, self.others = find_layers(engine, params, names)
        if subset is not None:  # only these parameters' blocks (last-layer Laplace)
            self.layers = [
                layer
                for layer in self.layers
                if layer.weight in subset and (layer.bias is None or layer.bias in subset)
            ]
            inside = {i for layer in self.layers for i in (layer.weight, layer.bias)}
            self.others = [i for i in subset if i not in inside]
        self.subset = subset
        # Not reached by the output: their curvature is exactly zero (module doc), an
        # exact zero block rather than "in no layer".
        reached = _reaching(engine.flow, params)
        self.unreached = [i for i in self.others if i not in reached]
        self.others = [i for i in self.others if i in reached]
        for layer in self.layers:
            layer.joint = layer.bias is not None and not separate_bias
        if self.others and others == "refuse":
            listed = ", ".join(f"{names[i]} {list(params[i].shape)}" for i in self.others)
            raise CurvatureError(
                f"kfac: the parameters {listed} are in no matmul or convolution layer of their "
                "own (a weight meeting the data once, as x @ W or W @ x, its bias added to that "
                "output; a weight tied between layers is in none); ask for "
                "others='exact' to keep their exact curvature block beside the Kronecker blocks"
            )
        size = sum(params[i].size for i in self.others)
        if size > EXACT_OTHERS_MAX:
            raise CurvatureError(
                f"kfac: the parameters outside the layers have {size} entries; their exact "
                f"block is held as a matrix of at most {EXACT_OTHERS_MAX} entries a side"
            )
        seeds, self.weight = _seeds(curv, curvature, samples, seed, sampled_targets)
        self._factors(engine, seeds)
        self.other_block: Any = self._exact_others() if self.others else None
        for layer in self.layers:
            layer.eig_a = _eigh(layer.A)
            layer.eig_g = _eigh(layer.G)
        if ekfac:
            self._correct(engine, seeds)

    # Factors --------------------------------------------------------------------------
    def _rows(self, layer: Layer, cot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(a (N, P, k [+1]), g (N, P, m)) of one seed, in the layer's frame."""
        a = np.asarray(backend.to_host(layer.layout.data[0]), np.float64)
        if layer.joint:
            a = np.concatenate([a, np.ones(a.shape[:-1] + (1,))], axis=-1)
        g = np.asarray(
            backend.to_host(cotangent_rows(self._flow, layer.layout, cot)[0]), np.float64
        )
        return a, g

    def _factors(self, engine: PerExample, seeds: np.ndarray) -> None:
        out = self.curv.output
        cots = engine.meeting_cotangents(backend.asarray(seeds, out.dtype, out.device), 1)
        self._cotangents, self._flow = cots, engine.flow
        n = self.curv.examples
        for layer in self.layers:
            out = layer.meeting.record.outputs[0]
            a, _ = self._rows(layer, cots[id(out)][0])
            p = a.shape[1]
            if self.sharing == "expand":
                flat = a.reshape(-1, a.shape[-1])
                layer.A = flat.T @ flat / (n * p)
            else:
                mean = a.mean(axis=1)
                layer.A = mean.T @ mean / n
            m = _out_width(layer)
            g_sum = np.zeros((m, m))
            for c in range(seeds.shape[0]):
                _, g = self._rows(layer, cots[id(out)][c])
                rows = g.reshape(-1, m) if self.sharing == "expand" else g.sum(axis=1)
                g_sum += rows.T @ rows
            layer.G = self.weight * g_sum

    def _correct(self, engine: PerExample, seeds: np.ndarray) -> None:
        """EKFAC: the curvature's diagonal in each block's Kronecker eigenbasis."""
        for layer in self.layers:
            qa, qg = layer.eig_a[1], layer.eig_g[1]
            out = layer.meeting.record.outputs[0]
            total = np.zeros((qa.shape[0], qg.shape[0]))
            bias_total = np.zeros(qg.shape[0])
            for c in range(seeds.shape[0]):
                a, g = self._rows(layer, self._cotangents[id(out)][c])
                ra, rg = a @ qa, g @ qg  # (N, P, k), (N, P, m)
                total += (np.matmul(np.swapaxes(ra, 1, 2), rg) ** 2).sum(axis=0)
                if layer.bias is not None and not layer.joint:
                    bias_total += (rg.sum(axis=1) ** 2).sum(axis=0)
            layer.corrected = self.weight * total
            if layer.bias is not None and not layer.joint:
                layer.corrected_bias = self.weight * bias_total

    def _exact_others(self) -> np.ndarray:
        """The exact curvature's block on the parameters outside the layers (a matrix)."""
        op = self.curv.operator(self.curvature, samples=self.samples, seed=self.seed)
        return exact_block(self.curv, op, self.others)

    # Frames ---------------------------------------------------------------------------
    def to_frame(self, layer: Layer, flat: list[np.ndarray]) -> np.ndarray:
        """Vectors (K, *params) of a layer's parameters -> (K, k [+1], m)."""
        (side, swap), w = layer.frame, flat[layer.weight]
        k = w.shape[0]
        mat = w.reshape((k,) + side)
        if swap:
            mat = np.swapaxes(mat, -1, -2)
        if layer.joint:
            mat = np.concatenate([mat, flat[layer.bias].reshape(k, 1, -1)], axis=1)
        return mat

    def from_frame(
        self, layer: Layer, mat: np.ndarray, out: list[np.ndarray | None], shapes: list[tuple]
    ) -> None:
        (_, swap), k = layer.frame, mat.shape[0]
        if layer.joint:
            out[layer.bias] = mat[:, -1, :].reshape((k,) + shapes[layer.bias])
            mat = mat[:, :-1, :]
        if swap:
            mat = np.swapaxes(mat, -1, -2)
        out[layer.weight] = np.ascontiguousarray(mat).reshape((k,) + shapes[layer.weight])

    def bias_eigenvalues(self, layer: Layer) -> np.ndarray:
        """A separate bias block's eigenvalues (G's, or EKFAC's in G's eigenbasis)."""
        return layer.eig_g[0] if layer.corrected_bias is None else layer.corrected_bias

    def eigenvalues(self, layer: Layer) -> np.ndarray:
        """The block's eigenvalues in its Kronecker eigenbasis, (k [+1], m)."""
        if layer.corrected is not None:
            return layer.corrected
        return np.outer(layer.eig_a[0], layer.eig_g[0])

    def apply(
        self, flat: list[np.ndarray], power: float = 1.0, damping: float = 0.0
    ) -> list[np.ndarray]:
        """(K + damping I)^power V for V given per parameter with a leading axis: power 1
        the product, -1 the damped inverse (exact: through each block's eigenbasis)."""
        shapes = [tuple(p.shape) for p in self.curv._flat]
        out: list[np.ndarray | None] = [None] * len(shapes)
        for layer in self.layers:
            mat = self.to_frame(layer, flat)
            if power == 1.0 and damping == 0.0 and layer.corrected is None:
                res = layer.A @ mat @ layer.G
            else:
                qa, qg = layer.eig_a[1], layer.eig_g[1]
                lam = self.eigenvalues(layer) + damping
                with np.errstate(divide="ignore"):
                    scaled = (qa.T @ mat @ qg) * lam**power
                res = qa @ scaled @ qg.T
            self.from_frame(layer, res, out, shapes)
            if layer.bias is not None and not layer.joint:  # its own block, G
                b = flat[layer.bias].reshape(flat[layer.bias].shape[0], -1)
                if power == 1.0 and damping == 0.0 and layer.corrected_bias is None:
                    rb = b @ layer.G
                else:
                    qg = layer.eig_g[1]
                    lam = self.bias_eigenvalues(layer) + damping
                    with np.errstate(divide="ignore"):
                        rb = ((b @ qg) * lam**power) @ qg.T
                out[layer.bias] = rb.reshape(flat[layer.bias].shape)
        if self.others:
            k = flat[0].shape[0]
            v = np.concatenate([flat[i].reshape(k, -1) for i in self.others], axis=1)
            block = self.other_block + damping * np.eye(self.other_block.shape[0])
            if power == 1.0:
                res = v @ block
            else:
                vals, vecs = np.linalg.eigh(block)
                res = ((v @ vecs) * vals**power) @ vecs.T
            lo = 0
            for i in self.others:
                size = math.prod(shapes[i])
                out[i] = res[:, lo : lo + size].reshape((k,) + shapes[i])
                lo += size
        for i in self.unreached:  # a zero block: (0 + damping)^power v
            with np.errstate(divide="ignore", invalid="ignore"):  # (undamped inverse: inf)
                out[i] = flat[i] * np.float64(damping) ** power
        # Parameters outside `subset` (a last-layer KFAC) are outside the operator: zeros.
        return [np.zeros_like(v) if o is None else o for o, v in zip(out, flat, strict=True)]

    def all_eigenvalues(self, damping: float = 0.0) -> np.ndarray:
        parts = []
        for layer in self.layers:
            parts.append(self.eigenvalues(layer).ravel())
            if layer.bias is not None and not layer.joint:
                parts.append(self.bias_eigenvalues(layer))
        if self.others:
            parts.append(np.linalg.eigvalsh(self.other_block))
        params = self.curv._flat
        parts.append(np.zeros(sum(params[i].size for i in self.unreached)))  # zero blocks
        return np.concatenate(parts) + damping

    def trace(self) -> float:
        return float(self.all_eigenvalues().sum())

    def logdet(self, damping: float = 0.0) -> float:
        """sum log(eigenvalue + damping). Undamped, a block with an eigenvalue at the
        rounding level of its largest (below n * eps * max: a singular factor, as the
        softmax's G always is) answers -inf, where curvlinops answers NaN (a rounded
        negative eigenvalue's log) or a large finite number (a rounded positive one)."""
        vals = self.all_eigenvalues(damping)
        top = float(np.abs(vals).max()) if vals.size else 0.0
        floor = vals.size * np.finfo(np.float64).eps * top if damping == 0.0 else 0.0
        if (vals <= floor).any():
            return -math.inf
        return float(np.log(vals).sum())

    def preconditioner(self, damping: float) -> Any:
        """r -> (K + damping I)^-1 r on flat float64 vectors (the parameters' order),
        for preconditioned CG on the exact curvature (conjugate_gradient)."""
        shapes = [tuple(p.shape) for p in self.curv._flat]
        sizes = [math.prod(s) for s in shapes]
        if damping <= 0 and (self.all_eigenvalues() <= 0).any():
            raise CurvatureError("kfac: a singular KFAC preconditions only with damping > 0")

        def apply(r: np.ndarray) -> np.ndarray:
            parts, lo = [], 0
            for shape, size in zip(shapes, sizes, strict=True):
                parts.append(np.asarray(r[lo : lo + size]).reshape((1, *shape)))
                lo += size
            out = self.apply(parts, power=-1.0, damping=damping)
            return np.concatenate([o.reshape(-1) for o in out])

        return apply

    def operator(self) -> KFACOperator:
        return KFACOperator(self)


BLOCK_BYTES = 32 << 20  # the unit vectors (over every parameter) of one exact-block pass


def exact_block(curv: Any, op: Any, indices: list[int]) -> np.ndarray:
    """The block of the operator `op` on the parameters `indices` (a symmetric matrix),
    from as many products as they have entries, in passes whose unit vectors (each one
    the size of all the parameters, zeros outside the block) hold at most BLOCK_BYTES:
    a last-layer block of a large model never holds n copies of the whole model."""
    params = curv._flat
    sizes = [params[i].size for i in indices]
    offsets = dict(zip(indices, np.cumsum([0, *sizes])[:-1].tolist(), strict=True))
    total = sum(sizes)
    width = sum(p.size for p in params) * 8
    step = max(1, min(total, BLOCK_BYTES // max(width, 1)))
    rows = []
    for start in range(0, total, step):
        stop = min(total, start + step)
        vectors = []
        for i, p in enumerate(params):
            z = np.zeros((stop - start,) + p.shape)
            if i in offsets:  # the unit vectors start..stop that fall in parameter i
                lo, hi = max(start, offsets[i]), min(stop, offsets[i] + p.size)
                if lo < hi:
                    z.reshape(stop - start, -1)[
                        np.arange(lo - start, hi - start), np.arange(lo, hi) - offsets[i]
                    ] = 1.0
            vectors.append(Tensor(backend.asarray(z, p.dtype, p.device)))
        products = tree.flatten(op.hvp_many(tree.unflatten(curv._treedef, vectors)))[0]
        rows.append(
            np.concatenate(
                [
                    np.asarray(products[i].numpy(), np.float64).reshape(stop - start, -1)
                    for i in indices
                ],
                axis=1,
            )
        )
        del vectors, products
    block = np.concatenate(rows, axis=0)
    return (block + block.T) / 2


def _eigh(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vals, vecs = np.linalg.eigh((m + m.T) / 2)
    return vals, vecs


class KFACOperator(CurvatureOperator):
    """A KFAC as a HessianOperator over the recording's parameters: hvp, hvp_many,
    FlatOperator, lanczos, traces, conjugate_gradient and influence run on it."""

    def __init__(self, kfac: KFAC):
        super().__init__(kfac.curv, "kfac", None, None)
        self.kfac = kfac

    def _record(self, primals: tuple) -> None:
        raise CurvatureError("kfac: a KFAC is fitted at one point; fit another for a new point")

    def _product(self, flat_v: list[Tensor], batch_ndim: int, lead: tuple) -> list[Tensor]:
        k = math.prod(lead)
        host = [
            np.asarray(v.numpy(), np.float64).reshape((k,) + tuple(p.shape))
            for v, p in zip(flat_v, self.kfac.curv._flat, strict=True)
        ]
        res = self.kfac.apply(host)
        return [
            Tensor(backend.asarray(r.reshape(lead + tuple(p.shape)), p.dtype, p.device))
            for r, p in zip(res, self.kfac.curv._flat, strict=True)
        ]


def curvature_diagonal(
    curv: Any,
    curvature: str = "ggn",
    *,
    samples: int | None = None,
    seed: int | None = 0,
    max_bytes: int | None = None,
) -> list[np.ndarray]:
    """diag of the GGN (exact: one per-example pass per column of the loss Hessian's
    square root, BackPACK's DiagGGNExact), of the Monte-Carlo Fisher (`samples` draws,
    DiagGGNMC) or of the empirical Fisher, per parameter (float64 host arrays): the
    weighted sum over seeds and examples of the squared per-example shares (module doc's
    w). Exact in as many passes as the output has entries per example (MC: samples)."""
    total: list[np.ndarray] | None = None
    weight = 1.0
    for squares, w in _diagonal_columns(curv, curvature, samples, seed, max_bytes):
        weight = w  # the same for every seed
        total = squares if total is None else [t + s for t, s in zip(total, squares, strict=True)]
    assert total is not None
    return [weight * t for t in total]


def fisher_diagonal_draws(
    curv: Any, samples: int, seed: int | None = 0, max_bytes: int | None = None
) -> Iterator[list[np.ndarray]]:
    """The Monte-Carlo Fisher's diagonal one draw at a time (a generator, so that the
    caller may reduce them as they come): `samples` estimates of the Fisher's diagonal
    (per parameter, float64), whose mean is curvature_diagonal's answer for the same
    draws and whose spread is its Monte-Carlo error."""
    for squares, weight in _diagonal_columns(curv, "fisher", samples, seed, max_bytes):
        yield [weight * samples * s for s in squares]


def _diagonal_columns(
    curv: Any, curvature: str, samples: int | None, seed: int | None, max_bytes: int | None
) -> Iterator[tuple[list[np.ndarray], float]]:
    """(sum over examples of the squared per-example shares of one seed, w) per seed."""
    try:
        seeds, weight = _seeds(curv, curvature, samples, seed, None)
    except MixedExamplesError as exc:
        raise CurvatureError(str(exc)) from None
    out = curv.output
    for column in seeds:
        try:
            found = per_example(
                curv,
                keep_gradients=False,
                max_bytes=max_bytes,
                seed=backend.asarray(column, out.dtype, out.device),
            )
        except MixedExamplesError as exc:
            raise CurvatureError(str(exc)) from None
        yield tree.flatten(found.sum_squares)[0], weight


def kfac(curv: Any, curvature: str = "ggn", **options: Any) -> KFAC:
    """Fit KFAC (or, with ekfac=True, EKFAC) of `curvature` on a Curvature recording."""
    return KFAC(curv, curvature, **options)


__all__ = [
    "KFAC",
    "KFACOperator",
    "Layer",
    "curvature_diagonal",
    "exact_block",
    "find_layers",
    "fisher_diagonal_draws",
    "kfac",
    "loss_hessian_sqrt",
]
