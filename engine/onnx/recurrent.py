"""ONNX's recurrent ops (RNN, GRU, LSTM) unrolled over the sequence into engine ops.

The sequence length is known at specialization, so each node becomes a fixed chain of
matmuls and activations: every derivative (VJP, JVP, second order) is the ops' own, and
backpropagation through time is the tape's ordinary sweep. Layouts, gate orders and
equations follow onnx/docs/Operators.md exactly:

- inputs X, W, R, B, sequence_lens, initial_h (, initial_c, P for LSTM); W is
  [num_directions, gates * hidden, input], R [num_directions, gates * hidden, hidden],
  B [num_directions, 2 * gates * hidden] (the W biases, then the R biases);
- gate order: LSTM i, o, f, c; GRU z, r, h; the RNN one gate;
- layout 0: X [seq, batch, input], Y [seq, num_directions, batch, hidden], states
  [num_directions, batch, hidden]; layout 1: X [batch, seq, input], Y [batch, seq,
  num_directions, hidden], states [batch, num_directions, hidden];
- GRU linear_before_reset: the reset gate multiplies (H Rh^T + Rbh) instead of H;
- sequence_lens (constant): a sequence's state stops at its length (its later outputs
  are zero), and in the reverse direction it starts at its last valid step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.onnx.ops import OP, REFUSALS, OpError, handler, shape_of

ACTIVATIONS = {"Sigmoid": "sigmoid", "Tanh": "tanh", "Relu": "relu"}
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTIVATIONS = {
    "RNN": ["Tanh"],
    "GRU": ["Sigmoid", "Tanh"],
    "LSTM": ["Sigmoid", "Tanh", "Tanh"],
}


def _refusal(op_type: str):
    def refuse(attrs: dict[str, Any]) -> str | None:
        names = attrs.get("activations")
        if names is not None:
            unknown = sorted({n for n in names if n not in ACTIVATIONS})
            if unknown:
                return f"activations {unknown} are not supported (only {sorted(ACTIVATIONS)})"
        if attrs.get("activation_alpha") or attrs.get("activation_beta"):
            return "activation_alpha/activation_beta are not supported"
        if attrs.get("direction", "forward") not in ("forward", "reverse", "bidirectional"):
            return f"direction {attrs['direction']!r} is not a valid value"
        if op_type == "LSTM" and attrs.get("input_forget", 0):
            return "input_forget=1 (coupled input and forget gates) is not supported"
        return None

    return refuse


def _activations(op_type: str, attrs: dict[str, Any], directions: int) -> list[list[Any]]:
    """The activation functions of each direction (the attribute lists the forward
    direction's, then the reverse's)."""
    names = list(attrs.get("activations") or DEFAULT_ACTIVATIONS[op_type] * directions)
    per = len(DEFAULT_ACTIVATIONS[op_type])
    if len(names) == per and directions == 2:
        names = names * 2
    return [[OP[ACTIVATIONS[n]] for n in names[d * per : (d + 1) * per]] for d in range(directions)]


def _slice_last(x: Any, start: int, stop: int | None) -> Any:
    return OP["getitem"](x, (Ellipsis, slice(start, stop)))


def _clipped(x: Any, clip: float | None) -> Any:
    if clip is None:
        return x
    bound = np.asarray(clip, dtype=x.dtype)
    return OP["minimum"](OP["maximum"](x, -bound), bound)


def _recurrent(op_type: str, ins: list[Any], attrs: dict[str, Any]) -> list[Any]:
    x, w, r = ins[0], ins[1], ins[2]
    b = ins[3] if len(ins) > 3 else None
    lengths = ins[4] if len(ins) > 4 else None
    h0 = ins[5] if len(ins) > 5 else None
    c0 = ins[6] if len(ins) > 6 and op_type == "LSTM" else None
    peep = ins[7] if len(ins) > 7 and op_type == "LSTM" else None
    layout = int(attrs.get("layout", 0))
    direction = attrs.get("direction", "forward")
    if layout:  # batch first: run time first, put the axes back at the end
        x = OP["swapaxes"](x, 0, 1)
        h0 = None if h0 is None else OP["swapaxes"](h0, 0, 1)
        c0 = None if c0 is None else OP["swapaxes"](c0, 0, 1)
    seq, batch = shape_of(x)[:2]
    directions, gates_n, hidden = shape_of(w)[0], GATES[op_type], shape_of(r)[-1]
    if directions != (2 if direction == "bidirectional" else 1):
        raise OpError(f"W has {directions} directions for direction={direction!r}")
    clip = attrs.get("clip")
    clip = None if clip is None else float(clip)
    masks = _length_masks(lengths, seq, batch)
    activations = _activations(op_type, attrs, directions)
    zero_state = np.zeros((batch, hidden), dtype=x.dtype)
    ys, hs, cs = [], [], []
    for d in range(directions):
        reverse = direction == "reverse" or d == 1
        wd, rd = OP["getitem"](w, d), OP["getitem"](r, d)
        # Every step's input projection at once: [seq, batch, gates * hidden].
        xw = OP["matmul"](x, OP["transpose"](wd))
        wb = rb = None
        if b is not None:
            bd = OP["getitem"](b, d)
            wb, rb = _slice_last(bd, 0, gates_n * hidden), _slice_last(bd, gates_n * hidden, None)
            xw = OP["add"](xw, wb)
        h = zero_state if h0 is None else OP["getitem"](h0, d)
        c = zero_state if c0 is None else OP["getitem"](c0, d)
        pd = None if peep is None else OP["getitem"](peep, d)
        steps = range(seq - 1, -1, -1) if reverse else range(seq)
        outs: dict[int, Any] = {}
        for t in steps:
            xt = OP["getitem"](xw, t)
            h_new, c_new = _STEP[op_type](xt, h, c, rd, rb, pd, activations[d], hidden, clip, attrs)
            if masks is not None:  # past its length a sequence keeps its state
                h_new = OP["where"](masks[t], h_new, h)
                if op_type == "LSTM":
                    c_new = OP["where"](masks[t], c_new, c)
                outs[t] = OP["where"](masks[t], h_new, np.zeros((), dtype=x.dtype))
            else:
                outs[t] = h_new
            h, c = h_new, c_new
        ys.append(OP["stack"]([outs[t] for t in range(seq)], axis=0))  # [seq, batch, hidden]
        hs.append(h)
        cs.append(c)
    y = OP["stack"](ys, axis=1)  # [seq, directions, batch, hidden]
    y_h, y_c = OP["stack"](hs, axis=0), OP["stack"](cs, axis=0)
    if layout:
        y = OP["transpose"](y, axes=(2, 0, 1, 3))
        y_h, y_c = OP["swapaxes"](y_h, 0, 1), OP["swapaxes"](y_c, 0, 1)
    return [y, y_h, y_c] if op_type == "LSTM" else [y, y_h]


def _length_masks(lengths: Any, seq: int, batch: int) -> list[np.ndarray] | None:
    """Per step, [batch, 1] true where the step is within the sequence; None when every
    sequence is full length (the common case: no masking)."""
    if lengths is None:
        return None
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lengths.shape != (batch,) or np.any(lengths < 0) or np.any(lengths > seq):
        raise OpError(f"sequence_lens {lengths.tolist()} do not fit {batch} sequences of {seq}")
    if np.all(lengths == seq):
        return None
    return [(t < lengths).reshape(batch, 1) for t in range(seq)]


def _rnn_step(xt, h, c, rd, rb, pd, act, hidden, clip, attrs):
    gates = OP["add"](xt, OP["matmul"](h, OP["transpose"](rd)))
    if rb is not None:
        gates = OP["add"](gates, rb)
    return act[0](_clipped(gates, clip)), c


def _gru_step(xt, h, c, rd, rb, pd, act, hidden, clip, attrs):
    f, g = act
    two = 2 * hidden
    r_zr, r_h = _slice_rows(rd, 0, two), _slice_rows(rd, two, 3 * hidden)
    hz = OP["add"](_slice_last(xt, 0, two), OP["matmul"](h, OP["transpose"](r_zr)))
    if rb is not None:
        hz = OP["add"](hz, _slice_last(rb, 0, two))
    hz = f(_clipped(hz, clip))
    z, reset = _slice_last(hz, 0, hidden), _slice_last(hz, hidden, two)
    rbh = None if rb is None else _slice_last(rb, two, 3 * hidden)
    if attrs.get("linear_before_reset", 0):
        recur = OP["matmul"](h, OP["transpose"](r_h))
        if rbh is not None:
            recur = OP["add"](recur, rbh)
        recur = OP["multiply"](reset, recur)
    else:
        recur = OP["matmul"](OP["multiply"](reset, h), OP["transpose"](r_h))
        if rbh is not None:
            recur = OP["add"](recur, rbh)
    candidate = g(_clipped(OP["add"](_slice_last(xt, two, 3 * hidden), recur), clip))
    # H = (1 - z) h~ + z H = h~ + z (H - h~)
    return OP["add"](candidate, OP["multiply"](z, OP["subtract"](h, candidate))), c


def _lstm_step(xt, h, c, rd, rb, pd, act, hidden, clip, attrs):
    f, g, hact = act
    gates = OP["add"](xt, OP["matmul"](h, OP["transpose"](rd)))
    if rb is not None:
        gates = OP["add"](gates, rb)
    i, o, fg, cand = (_slice_last(gates, k * hidden, (k + 1) * hidden) for k in range(4))
    if pd is not None:  # peepholes P = [Pi, Po, Pf]
        pi, po, pf = (_slice_last(pd, k * hidden, (k + 1) * hidden) for k in range(3))
        i = OP["add"](i, OP["multiply"](pi, c))
        fg = OP["add"](fg, OP["multiply"](pf, c))
    i, fg = f(_clipped(i, clip)), f(_clipped(fg, clip))
    c_new = OP["add"](OP["multiply"](fg, c), OP["multiply"](i, g(_clipped(cand, clip))))
    if pd is not None:
        o = OP["add"](o, OP["multiply"](po, c_new))
    o = f(_clipped(o, clip))
    return OP["multiply"](o, hact(c_new)), c_new


def _slice_rows(m: Any, start: int, stop: int) -> Any:
    return OP["getitem"](m, slice(start, stop))


_STEP = {"RNN": _rnn_step, "GRU": _gru_step, "LSTM": _lstm_step}


def _register(op_type: str) -> None:
    @handler(op_type, static=(4,))
    def run(ins, attrs, opset):
        return _recurrent(op_type, list(ins), attrs)

    REFUSALS[op_type] = _refusal(op_type)


for _op in GATES:
    _register(_op)
