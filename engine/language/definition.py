"""A definition as data: variables, inputs, program lines and user functions.

`as_definition` accepts the JSON-like form the service receives (after it has decoded
its tensors into NumPy arrays) or a `Definition`, and checks its *structure* only; the
language checks (names, ops, shapes) are in validate.py.

Values: a NumPy array keeps its dtype; a bare number or (nested) list takes the
definition's `dtype` (float32 unless it says "float16" or "float64"), as on the wire; an
engine Tensor keeps its dtype and device.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine import backend
from engine.language.errors import DefinitionError, Problem
from engine.language.limits import Limits
from engine.tensor import Tensor

# dtypes a tensor in a definition may have (the engine computes in these).
ALLOWED_DTYPES = frozenset(
    np.dtype(d)
    for d in (
        "float16", "float32", "float64", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "bool",
    )
)  # fmt: skip
FLOAT32 = np.dtype("float32")
# what `"dtype"` may make bare numbers and lists (the engine's floating-point dtypes)
DEFAULT_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class VariableDef:
    """A parameter: `trainable` ones are watched by default and are the default sources."""

    value: Any
    trainable: bool = True


@dataclass(frozen=True)
class FunctionDef:
    """A user function: a plain one (differentiated through, to any order) or, with a
    backward program, one with a custom gradient (the analogue of tf.custom_gradient).

    forward: lines over `params` (and the variables the function owns, `<name>.<var>`);
    the function's value is `output` (default: the name the last forward line assigns).
    backward (optional): lines that see the params, every forward name and `upstream`
    (the incoming gradient, shaped like the output) and assign `grad_<param>` for each
    floating-point param (an integer or bool param gets no gradient).
    """

    params: tuple[str, ...]
    forward: tuple[str, ...]
    backward: tuple[str, ...] | None = None
    output: str | None = None

    @property
    def plain(self) -> bool:
        return self.backward is None


@dataclass(frozen=True)
class ModelDef:
    """An imported (ONNX) model the program calls as a function, `logits = net(x)`.

    model: a loaded engine.onnx.OnnxModel. Its floating-point initializers are the
    definition's variables, named by their ONNX names (as_definition adds them; a
    variable of the same name given in `variables` replaces the initializer's value),
    trainable unless listed in `frozen` (which holds the model's frozen_by_default too:
    BatchNorm running statistics, initializers only shapes or comparisons read)."""

    model: Any
    frozen: tuple[str, ...] = ()


@dataclass(frozen=True)
class Definition:
    program: tuple[str, ...]
    variables: Mapping[str, VariableDef] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict)
    functions: Mapping[str, FunctionDef] = field(default_factory=dict)
    models: Mapping[str, ModelDef] = field(default_factory=dict)

    @property
    def model_params(self) -> dict[str, str]:
        """Every model parameter's name -> the model it belongs to."""
        return {p: name for name, m in self.models.items() for p in m.model.params}


# ----------------------------------------------------------------------------------------
# Coercion from the JSON-like form
# ----------------------------------------------------------------------------------------


FIELDS = ("program", "variables", "inputs", "functions", "models", "dtype")


def as_definition(obj: Any) -> Definition:
    """A Definition from a Definition or a mapping with keys program, variables, inputs,
    functions, models. Raises DefinitionError listing every structural problem."""
    problems: list[Problem] = []
    expand = not isinstance(obj, Definition)  # a Definition has its models' variables
    if isinstance(obj, Definition):
        obj = {
            "program": obj.program,
            "variables": obj.variables,
            "inputs": obj.inputs,
            "functions": obj.functions,
            "models": obj.models,
        }
    if not _is_mapping(obj):
        raise DefinitionError([_problem("definition", "a definition must be a mapping")])
    for key in obj:
        if key not in FIELDS:
            problems.append(
                _problem(
                    "definition",
                    f"unknown field {key!r}; expected {', '.join(FIELDS)}",
                )
            )
    default = default_dtype(obj.get("dtype"), problems)
    # A dtype the definition asks for applies to its ONNX models too (a float32 model
    # runs in float64 when asked), never quietly ignored.
    explicit = None if obj.get("dtype") is None else default
    program = _lines(obj.get("program"), "program", problems, required=True)
    variables = {
        name: var
        for name, raw in _mapping(obj.get("variables"), "variables", problems).items()
        if (var := _variable(raw, f"variables.{name}", problems, default)) is not None
    }
    inputs = {
        name: value
        for name, raw in _mapping(obj.get("inputs"), "inputs", problems).items()
        if (value := to_array(raw, f"inputs.{name}", problems, default)) is not None
    }
    functions = {
        name: fn
        for name, raw in _mapping(obj.get("functions"), "functions", problems).items()
        if (fn := _function(raw, f"functions.{name}", problems)) is not None
    }
    models = {
        name: model
        for name, raw in _mapping(obj.get("models"), "models", problems).items()
        if (model := _model(raw, f"models.{name}", problems, explicit)) is not None
    }
    if expand:
        _add_model_variables(models, variables, problems)
    if problems:
        raise DefinitionError(problems)
    return Definition(program, variables, inputs, functions, models)


def default_dtype(raw: Any, problems: list[Problem]) -> np.dtype:
    """The dtype of bare numbers and lists: the definition's `dtype`, float32 without."""
    if raw is None:
        return FLOAT32
    name = raw.name if isinstance(raw, np.dtype) else raw
    if name not in DEFAULT_DTYPES:
        problems.append(
            _problem("dtype", f"dtype must be one of {', '.join(DEFAULT_DTYPES)}, got {raw!r}")
        )
        return FLOAT32
    return np.dtype(name)


def _is_mapping(raw: Any) -> bool:
    # A decoded body is dicts: the exact type first (the ABC check costs ~0.5 us, and a
    # worker coerces every request's definition).
    return type(raw) is dict or isinstance(raw, Mapping)


def _problem(section: str, message: str) -> Problem:
    return Problem(message, section=section, kind="value")


def _mapping(raw: Any, section: str, problems: list[Problem]) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not _is_mapping(raw):
        problems.append(_problem(section, f"{section} must map names to values"))
        return {}
    if type(raw) is dict and all(type(key) is str for key in raw):
        return raw  # (read, never changed)
    good = {}
    for key, value in raw.items():
        if isinstance(key, str):
            good[key] = value
        else:
            problems.append(_problem(section, f"name {key!r} is not a string"))
    return good


def _lines(raw: Any, section: str, problems: list[Problem], required: bool = False) -> tuple:
    """A list of lines; a single string is split at its line breaks."""
    if raw is None and not required:
        return ()
    if isinstance(raw, str):
        return tuple(raw.splitlines())
    if (type(raw) is list or isinstance(raw, Sequence)) and all(
        isinstance(line, str) for line in raw
    ):
        return tuple(raw)
    problems.append(_problem(section, f"{section} must be a list of strings (one line each)"))
    return ()


_VARIABLE_FIELDS = frozenset({"value", "trainable"})


def _variable(
    raw: Any, section: str, problems: list[Problem], default: np.dtype = FLOAT32
) -> VariableDef | None:
    if isinstance(raw, VariableDef):
        raw = {"value": raw.value, "trainable": raw.trainable}
    if not _is_mapping(raw):
        value = to_array(raw, section, problems, default)
        return None if value is None else VariableDef(value)
    unknown = sorted(set(raw) - _VARIABLE_FIELDS)
    if unknown:
        problems.append(_problem(section, f"unknown field(s) {unknown}; expected value, trainable"))
    if "value" not in raw:
        problems.append(_problem(section, "a variable needs a value"))
        return None
    trainable = raw.get("trainable", True)
    if not isinstance(trainable, (bool, np.bool_)):
        problems.append(_problem(section, f"trainable must be true or false, got {trainable!r}"))
        return None
    value = to_array(raw["value"], section, problems, default)
    return None if value is None else VariableDef(value, bool(trainable))


def _function(raw: Any, section: str, problems: list[Problem]) -> FunctionDef | None:
    if isinstance(raw, FunctionDef):
        return raw
    if not _is_mapping(raw):
        problems.append(_problem(section, "a function needs params and forward"))
        return None
    unknown = sorted(set(raw) - {"params", "forward", "backward", "output"})
    if unknown:
        problems.append(
            _problem(
                section, f"unknown field(s) {unknown}; expected params, forward, backward, output"
            )
        )
    count = len(problems)
    params = _lines(raw.get("params"), f"{section}.params", problems, required=True)
    forward = _lines(raw.get("forward"), f"{section}.forward", problems, required=True)
    backward = (
        None
        if raw.get("backward") is None
        else _lines(raw.get("backward"), f"{section}.backward", problems, required=True)
    )
    output = raw.get("output")
    if output is not None and not isinstance(output, str):
        problems.append(_problem(f"{section}.output", "output must be a name"))
    if len(problems) > count:
        return None
    return FunctionDef(params, forward, backward, output)


def _model(
    raw: Any, section: str, problems: list[Problem], dtype: np.dtype | None = None
) -> ModelDef | None:
    """{"onnx": bytes of an .onnx file, "frozen": [initializer names]} -> a loaded model;
    with the definition's `dtype` float64 a float32 model runs in float64."""
    if isinstance(raw, ModelDef):
        return raw
    if not isinstance(raw, Mapping):
        problems.append(_problem(section, "a model is {onnx: <bytes of an .onnx file>, frozen}"))
        return None
    unknown = sorted(set(raw) - {"onnx", "frozen"})
    if unknown:
        problems.append(_problem(section, f"unknown field(s) {unknown}; expected onnx, frozen"))
    frozen = raw.get("frozen") or ()
    if isinstance(frozen, str) or not all(isinstance(f, str) for f in frozen):
        problems.append(_problem(f"{section}.frozen", "frozen must be a list of names"))
        return None
    from engine.onnx import ModelError, load_model  # needs the onnx package
    from engine.onnx.errors import grouped, summary
    from engine.onnx.model import float_dtypes

    try:
        model = load_model(raw.get("onnx"), float64=dtype == np.float64)
    except ModelError as exc:
        # First the summary (op types, counts, what to do: the answer's detail), then one
        # problem per op type and reason, then the rest (shapes, modes, the file).
        found = grouped(exc.problems)
        lead = summary(found)
        if lead is not None:
            problems.append(Problem(lead, section, kind="op"))
        problems.extend(
            Problem(str(p), section, kind=_MODEL_KINDS.get(p.kind, "model")) for p in found
        )
        return None
    floats = float_dtypes(model)
    if dtype is not None and dtype != np.float64 and floats - {dtype}:
        listed = ", ".join(sorted(d.name for d in floats))
        problems.append(
            _problem(
                "dtype",
                f"dtype {dtype.name} is not applied to ONNX models: model {section[7:]!r} "
                f"computes in {listed} (a float32 model runs in float64 with dtype float64; "
                "it is never rounded down)",
            )
        )
        return None
    unknown = [f for f in frozen if f not in model.params]
    if unknown:
        problems.append(
            _problem(
                f"{section}.frozen",
                f"{unknown} are not floating-point initializers of the model",
            )
        )
        return None
    # BatchNorm's running statistics and initializers no gradient reaches the outputs
    # from (shape computations, comparisons, indices) are frozen whether listed or not.
    defaults = tuple(n for n in model.frozen_by_default if n not in frozen)
    return ModelDef(model, tuple(frozen) + defaults)


_MODEL_KINDS = {"op": "op", "shape": "shape", "mode": "model", "model": "model"}


def _add_model_variables(
    models: Mapping[str, ModelDef], variables: dict[str, VariableDef], problems: list[Problem]
) -> None:
    """Each model's floating-point initializers become variables named by their ONNX
    names; a variable given under that name supplies the value instead (same shape)."""
    owner: dict[str, str] = {}
    for name, m in models.items():
        for param, value in m.model.params.items():
            section = f"models.{name}"
            if param in owner:
                problems.append(
                    _problem(
                        section,
                        f"initializer {param!r} is also one of model {owner[param]!r}'s",
                    )
                )
                continue
            owner[param] = name
            given = variables.get(param)
            if given is None:
                variables[param] = VariableDef(value, param not in m.frozen)
            elif tuple(given.value.shape) != value.shape or given.value.dtype != value.dtype:
                problems.append(
                    _problem(
                        f"variables.{param}",
                        f"replaces initializer {param!r} of model {name!r}, which is "
                        f"{value.dtype}{list(value.shape)}; got "
                        f"{given.value.dtype}{list(given.value.shape)}",
                    )
                )
            elif given.trainable and param in m.frozen:  # frozen wins over a new value
                variables[param] = VariableDef(given.value, False)


def to_array(value: Any, section: str, problems: list[Problem], default: np.dtype = FLOAT32) -> Any:
    """A NumPy (or device) array for a value (a bare number or list: of dtype `default`),
    or None after recording a problem."""
    if type(value) is np.ndarray:  # the usual value (the service's wire tensors)
        array = value
    elif isinstance(value, Tensor):
        array = value.value
    elif backend.is_array(value) or isinstance(value, np.generic):
        array = value if backend.is_array(value) else np.asarray(value)
    else:
        try:
            array = np.asarray(value, dtype=default)
        except (TypeError, ValueError, OverflowError) as exc:
            problems.append(_problem(section, f"not a number or a (nested) list of numbers: {exc}"))
            return None
    if array.dtype not in ALLOWED_DTYPES:
        problems.append(_problem(section, f"unsupported dtype {array.dtype}"))
        return None
    return array


# ----------------------------------------------------------------------------------------
# Content hashes
# ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _limits_text(limits: Limits) -> str:
    # asdict is slow, and a service uses one Limits throughout
    return repr(sorted(limits.as_dict().items()))


def structure_key(defn: Definition, limits: Limits) -> str:
    """A hash of everything compilation depends on: lines, functions, the names, shapes,
    dtypes and trainable flags of the leaves (not their values), and the limits.

    The hashed text is the repr of tuples of strings, numbers and flags (unambiguous,
    and 3-4x cheaper than a sorted JSON document: this runs on every request)."""
    canonical = (
        tuple(defn.program),
        # Leaves in the definition's order: the order is part of the program, since the
        # default sources, flat answers and a flat `point` follow it; two definitions
        # that differ only in it must not share one compiled program.
        # (dtype.str: str(dtype) costs microseconds per leaf on every request)
        tuple(
            (name, tuple(v.value.shape), v.value.dtype.str, bool(v.trainable))
            for name, v in defn.variables.items()
        ),
        tuple((name, tuple(a.shape), a.dtype.str) for name, a in defn.inputs.items()),
        tuple(
            sorted(
                (
                    name,
                    tuple(f.params),
                    tuple(f.forward),
                    f.backward and tuple(f.backward),
                    f.output,
                )
                for name, f in defn.functions.items()
            )
        ),
        # the graph's own hash: its structure, not its weights
        tuple(
            sorted(
                (name, m.model.structure, tuple(sorted(m.frozen)))
                for name, m in defn.models.items()
            )
        ),
        _limits_text(limits),
    )
    key = _structure_keys.get(canonical)
    if key is None:
        text = repr(canonical)
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        if len(text) <= REMEMBERED_STRUCTURE_CHARS:
            if len(_structure_keys) >= STRUCTURE_KEYS_KEPT:
                _structure_keys.clear()
            _structure_keys[canonical] = key
    return key


# The hashes of the structures seen last, by the structure itself: a dict finds an equal
# tuple by comparing it whole (so no two structures share a key, whatever a client
# sends), which costs less than its repr and SHA-256 (~5 us a small definition).
STRUCTURE_KEYS_KEPT = 256
# Only a short structure is remembered (the saving matters for small requests alone): a
# client's long names or lines, in a definition that may yet be refused, are never kept
# (at most 256 x 4096 characters of structures held, whatever the requests).
REMEMBERED_STRUCTURE_CHARS = 4096
_structure_keys: dict[tuple[Any, ...], str] = {}
