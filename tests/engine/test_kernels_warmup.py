"""Warm-up of the compiled kernels (engine/kernels/warmup.py): every kernel declares its
call sites' argument types, warm() compiles (or loads) exactly those, and the engine's
ops then run on them without compiling anything else: each in a fresh interpreter with
a cache directory of its own (NUMBA_CACHE_DIR), filled once for the module by the
warm-up process, `python -m engine.kernels.warmup`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import kernels
from engine.kernels import warmup

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")


def run_python(args: list[str], cache: Path, **env: str) -> str:
    """A fresh interpreter (`python ARGS`) with this checkout and `cache` as numba's
    cache directory; its stdout."""
    full_env = {k: v for k, v in os.environ.items() if k != "GRADTAPE_KERNELS"}
    full_env.update(PYTHONPATH=str(ROOT), NUMBA_CACHE_DIR=str(cache), **env)
    done = subprocess.run(
        [sys.executable, *args],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A cache directory the warm-up process filled from empty, and its report."""
    cache = tmp_path_factory.mktemp("numba-cache")
    report = json.loads(run_python(["-m", "engine.kernels.warmup", "--json"], cache))
    return cache, report


def test_every_kernel_declares_the_signatures_it_is_called_with() -> None:
    every = warmup.declared()
    names = {k.__name__ for k in every}
    assert {"gelu_float32_kernel", "softmax_rows_float32_kernel", "add_rows_kernel"} <= names
    assert {"center_kernel", "combine_kernel", "gather2d", "col2im2d"} <= names
    assert {"winograd_input", "winograd_output", "winograd_cotangent"} <= names
    for k in every:
        assert k.signatures, f"{k.__name__} declares no signature: warm-up would never ready it"


def test_the_warmup_process_compiles_each_declared_signature_into_the_cache(filled) -> None:
    cache, report = filled
    declared = sum(len(k.signatures) for k in warmup.declared())
    assert report["enabled"] and report["cache"]
    assert report["cache_dir"].startswith(str(cache))
    assert report["signatures"] == report["compiled"] == declared
    assert {s["source"] for s in report["each"]} == {"compiled"}
    assert any(cache.rglob("*.nbi")) and any(cache.rglob("*.nbc"))  # numba's index, code


WORKLOAD = """
import logging, json
import numpy as np
import engine as gt
from engine import kernels
from engine.kernels import warmup, gelu

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("gradtape.kernels").addHandler(Keep())

kernels.hold_until_warm()
assert gelu.gelu_float32_kernel.compiled() is None  # held: the NumPy path until warm
report = warmup.warm()
assert gelu.gelu_float32_kernel.compiled() is not None
before = {k.__name__: sorted(map(str, k.dispatcher.signatures)) for k in warmup.declared()}
calls = dict.fromkeys(before, 0)
for k in warmup.declared():  # count each kernel's calls (compiled() hands out k._call)
    def counted(*args, k=k, call=k._call):
        calls[k.__name__] += 1
        return call(*args)
    k._call = counted

rng = np.random.default_rng(0)
for dtype in (np.float32, np.float64):
    x = rng.standard_normal((4, 8, 16)).astype(dtype)
    frozen = x.copy()
    frozen.setflags(write=False)  # as a request's arrays may be
    gamma, beta = rng.standard_normal(16).astype(dtype), rng.standard_normal(16).astype(dtype)
    for a in (x, frozen, x[:, ::2], np.asfortranarray(x)):
        def loss(t):
            h = gt.layer_norm(gt.gelu(t), gt.constant(gamma), gt.constant(beta), eps=1e-5)
            return gt.sum(h * gt.softmax(t, -1) + gt.erf(t))
        gt.grad(loss)(gt.constant(a))
        gt.hvp(loss, [gt.constant(a)], [gt.constant(np.ones_like(a))])
    table = rng.standard_normal((10, 6)).astype(dtype)
    for tokens in (np.array([1, 3, 3, 9]), np.array([[0, 2], [2, 5]], np.int32),
                   np.array([1, 3, 3, 9, 0, 0])[::2], np.array([4, 4], np.uint8)):
        gt.grad(lambda t: gt.sum(t[tokens] * t[tokens]))(gt.constant(table))
    img = rng.standard_normal((2, 3, 9, 8)).astype(dtype)
    w1 = rng.standard_normal((6, 3, 3, 3)).astype(dtype)
    w2 = rng.standard_normal((4, 6, 3, 3)).astype(dtype)
    def net(i, a, b):
        h = gt.tanh(gt.conv(i, a, strides=(1, 1), pads=((1, 1), (1, 1))))
        return gt.sum(gt.conv(h, b, strides=(2, 2), pads=((1, 0), (0, 1)), dilations=(1, 2)) ** 2)
    args = [gt.constant(v) for v in (img, w1, w2)]
    gt.grad(net, argnums=(0, 1, 2))(*args)
    gt.hvp(net, args, [gt.constant(np.ones_like(v)) for v in (img, w1, w2)])
    def bias_and_scale(x, w, bias, scale):  # the replay's row kernels (engine/kernels/rows.py)
        h = gt.matmul(x, w) + bias
        h = bias + gt.tanh(h)
        return gt.sum(gt.tanh(h * scale) * (scale * h))
    jitted = gt.jit(bias_and_scale).value_and_grad((0, 1, 2, 3))
    for _ in range(4):  # dynamic, captured, replayed twice
        jitted(*[gt.constant(rng.standard_normal(s).astype(dtype))
                 for s in ((4, 5, 6), (6, 7), (7,), (7,))])
    frozen_img = img.copy()
    frozen_img.setflags(write=False)
    gt.grad(net, argnums=(0,))(gt.constant(frozen_img), *args[1:])
    # Winograd's shapes (engine/ops/conv.py, _winograd_pays: rows 32 wide, 8 channels)
    wide = rng.standard_normal((2, 8, 5, 32)).astype(dtype)
    w8 = rng.standard_normal((8, 8, 3, 3)).astype(dtype)
    def wino(i, a):
        return gt.sum(gt.tanh(gt.conv(i, a, pads=((1, 1), (1, 1)))) ** 2)
    wargs = [gt.constant(wide), gt.constant(w8)]
    gt.grad(wino, argnums=(0, 1))(*wargs)
    gt.hvp(wino, wargs, [gt.constant(np.ones_like(v)) for v in (wide, w8)])

after = {k.__name__: sorted(map(str, k.dispatcher.signatures)) for k in warmup.declared()}
print(json.dumps({"report": report.summary(), "before": before, "after": after,
                  "warnings": warnings, "warmed": [k.warmed for k in warmup.declared()],
                  "calls": calls}))
"""


def test_after_warm_up_the_engines_ops_compile_nothing_more(filled) -> None:
    """warm() loads every signature from the filled cache, readies each kernel, and a
    workload of every kernel's ops (both dtypes; writable, read-only, strided and
    Fortran-ordered inputs; int64, int32, strided and uint8 token ids; convolutions
    strided, dilated and padded unevenly, gradients and HVPs) leaves each dispatcher
    with exactly the declared signatures: no call compiled one of its own."""
    cache, _ = filled
    out = json.loads(run_python(["-c", textwrap.dedent(WORKLOAD)], cache))
    declared = sum(len(k.signatures) for k in warmup.declared())
    assert out["report"]["loaded"] == declared and out["report"]["compiled"] == 0
    assert all(out["warmed"])
    assert out["after"] == out["before"], "a call compiled an undeclared signature"
    assert out["warnings"] == []
    assert sum(len(v) for v in out["before"].values()) == declared
    assert [k for k, n in out["calls"].items() if n == 0] == []  # every kernel ran


def test_a_call_with_undeclared_types_still_runs_and_says_so(filled) -> None:
    """A warmed kernel called with types no declaration covers (int32 into a float32
    kernel's array) compiles them once and logs a warning naming them, rather than fail."""
    cache, _ = filled
    code = """
    import logging, numpy as np
    from engine.kernels import warmup, gelu
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warmup.warm(compile=False)
    run = gelu.erf_float32_kernel.compiled()
    out = np.empty(3)
    run(np.zeros(3), out)  # float64: declared float32 only
    print(out.tolist(), len(gelu.erf_float32_kernel.dispatcher.signatures))
    """
    full_env = {k: v for k, v in os.environ.items() if k != "GRADTAPE_KERNELS"}
    full_env.update(PYTHONPATH=str(ROOT), NUMBA_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[0.0,", "0.0,", "0.0]", "2"]
    assert "erf_float32_kernel compiled for undeclared argument types" in done.stderr
    assert "array(float64, 1d, C)" in done.stderr


def test_load_only_warm_up_of_an_empty_cache_compiles_nothing(tmp_path: Path) -> None:
    code = """
    import json
    from engine.kernels import warmup, gelu
    report = warmup.warm(compile=False)
    print(json.dumps([report.summary(), gelu.gelu_float32_kernel.warmed,
                      len(gelu.gelu_float32_kernel.dispatcher.signatures)]))
    """
    summary, warmed, signatures = json.loads(
        run_python(["-c", textwrap.dedent(code)], tmp_path / "empty")
    )
    assert summary["missing"] == summary["signatures"] > 0
    assert summary["compiled"] == summary["loaded"] == 0
    assert not warmed and signatures == 0
    assert not list((tmp_path / "empty").rglob("*.nbc"))


@pytest.mark.parametrize("value", ["numpy", "off", "0"])
def test_switched_off_warm_up_does_nothing(tmp_path: Path, value: str) -> None:
    code = """
    import json, sys
    from engine.kernels import warmup
    report = warmup.warm()
    print(json.dumps([report.summary(), "numba" in sys.modules]))
    """
    summary, imported = json.loads(
        run_python(["-c", textwrap.dedent(code)], tmp_path / "c", GRADTAPE_KERNELS=value)
    )
    assert summary["enabled"] is False and summary["signatures"] == 0
    assert not imported  # not even numba's import
    assert not (tmp_path / "c").exists()


def test_a_modules_kernels_are_released_together(tmp_path: Path) -> None:
    """A worker holds its kernels until warm-up releases them, a module's at once: with
    the cache holding the convolution's gather but not its col2im, the gather is warm
    and still not handed out (the conv ops choose their route by the gather, then call
    col2im), and a convolution's gradient runs the NumPy route in between."""
    cache = tmp_path / "cache"
    gather_only = """
    from engine import kernels
    from engine.kernels import conv
    numba = kernels.numba_module()
    for declared in conv.gather2d.signatures:
        conv.gather2d.make_dispatcher().compile(kernels.numba_signature(numba, declared))
    """
    run_python(["-c", textwrap.dedent(gather_only)], cache)
    code = """
    import json
    import numpy as np
    import engine as gt
    from engine import kernels
    from engine.kernels import conv, warmup
    kernels.hold_until_warm()
    report = warmup.warm(compile=False)
    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    (g,) = gt.grad(lambda a: gt.sum(gt.conv(a, gt.constant(w), strides=(2, 2))))(
        gt.constant(x)
    )
    print(json.dumps([conv.gather2d.warmed, conv.col2im2d.warmed,
                      conv.gather2d.compiled() is None, report.missing, g.numpy().sum().item()]))
    """
    gather_warm, col2im_warm, held, missing, total = json.loads(
        run_python(["-c", textwrap.dedent(code)], cache)
    )
    assert gather_warm and not col2im_warm and held and missing > 0
    assert total == 4 * 9 * 2 * 3  # 2 x 2 outputs' 3 x 3 windows, 2 channels, 3 filters


HELD_INEXACT = """
import json, threading
import numpy as np
import engine as gt
from engine import kernels
from engine.kernels import softmax, warmup

kernels.hold_until_warm()
x = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
before = {}
def request():  # a request that needs softmax while warm-up has not readied it
    before["waited"] = not released.is_set()
    before["answer"] = gt.softmax(gt.constant(x), -1).numpy()
released = threading.Event()
t = threading.Thread(target=request)
t.start()
# (the request reaches compiled() and waits; warm-up then readies the kernels)
warmup.warm()
released.set()
kernels.settle()
t.join()
after = gt.softmax(gt.constant(x), -1).numpy()
print(json.dumps({"same": bool(np.array_equal(before["answer"], after)),
                  "waited": before["waited"]}))
"""


def test_a_held_kernel_not_bound_to_numpys_bits_waits_for_warm_up(filled) -> None:
    """softmax's kernel answers other last bits than its NumPy path (contract=True): a
    request that needs it while warm-up runs readies it (or waits for it), so the same request gets the
    same bits before and after warm-up (review r12); a kernel bound to NumPy's bits (the
    others) answers None at once, its NumPy path."""
    cache, _ = filled
    out = json.loads(run_python(["-c", textwrap.dedent(HELD_INEXACT)], cache))
    assert out["same"], out


def test_the_kernels_not_bound_to_numpys_bits_say_so() -> None:
    """Kernel.compiled makes a held kernel wait only where exact=False: the kernels whose
    NumPy paths give other bits must be exactly those (the contracting ones and
    Winograd's transforms, whose NumPy path is the windows' GEMM)."""
    from engine.kernels import gelu, softmax, winograd

    inexact = {k.__name__ for k in warmup.declared() if not k.exact}
    assert inexact == {
        softmax.softmax_rows_float32_kernel.__name__,
        gelu.gelu_slope_float32_kernel.__name__,
        winograd.winograd_input.__name__,
        winograd.winograd_output.__name__,
        winograd.winograd_cotangent.__name__,
    }


def test_a_held_kernel_bound_to_numpys_bits_runs_numpy_until_warm(tmp_path: Path) -> None:
    """Before warm-up readies them, the exact kernels answer None (the NumPy path) at
    once, and after settle() (warm-up ended without them) so do the contracting ones."""
    code = """
    from engine import kernels
    from engine.kernels import gelu, softmax
    kernels.hold_until_warm()
    assert gelu.gelu_float32_kernel.compiled() is None
    kernels.settle()
    assert softmax.softmax_rows_float32_kernel.compiled() is None
    print("ok")
    """
    assert run_python(["-c", textwrap.dedent(code)], tmp_path).strip() == "ok"


HELD_INEXACT_ON_DEMAND = """
import json
import numpy as np
import engine as gt
from engine import kernels
from engine.kernels import gelu, softmax

x = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
held = {held}
if held:
    kernels.hold_until_warm()  # and no warm-up: nothing would ever release softmax
y = gt.softmax(gt.constant(x), -1).numpy()
print(json.dumps({{"y": y.tobytes().hex(), "warmed": softmax.softmax_rows_float32_kernel.warmed,
                   "gelu": gelu.gelu_slope_float32_kernel.warmed}}))
"""


def test_a_held_kernel_not_bound_to_numpys_bits_is_readied_on_demand(tmp_path: Path) -> None:
    """A request needing a held exact=False kernel (softmax's) gets its module loaded or
    compiled at once in its own thread, rather than waiting for the whole warm-up
    (review r13: a cold cache made a fresh worker's first float32 softmax wait 23 s, for
    the compiling process to finish all 31 signatures, past a request's time limit; with
    no warm-up running it waited forever). Its answer is the kernel's bits, as in a
    process that does not hold kernels; other modules stay held."""
    free = json.loads(run_python(["-c", HELD_INEXACT_ON_DEMAND.format(held=False)], tmp_path))
    held = json.loads(run_python(["-c", HELD_INEXACT_ON_DEMAND.format(held=True)], tmp_path))
    assert held["y"] == free["y"]
    assert held["warmed"] and not held["gelu"]


RECAPTURED_AFTER_WARM_UP = """
import json
import numpy as np
import engine as gt
from engine import kernels
from engine.kernels import rows, warmup

kernels.hold_until_warm()  # a service worker: the row kernels held until warm-up
add_into = rows.add_rows_into
calls = [0]
call = add_into._call
def counted(*args):
    calls[0] += 1
    return call(*args)
add_into._call = counted

def layer(x, w, bias):  # x @ w + bias: the replay's row-vector add (rows.add_rows_into)
    return gt.sum(gt.tanh(gt.matmul(x, w) + bias))

rng = np.random.default_rng(0)
args = [gt.constant(rng.standard_normal(s).astype(np.float32)) for s in ((32, 6), (6, 7), (7,))]
compiled = gt.jit(layer)
jitted = compiled.value_and_grad((0, 1, 2))
answers, seen = [], []
for _ in range(4):  # dynamic, captured, replayed twice: the NumPy forms (held)
    answers.append([a.numpy().tobytes().hex() for a in gt.tree.flatten(jitted(*args))[0]])
seen.append(calls[0])
warmup.warm(compile=False)  # loads from the filled cache and releases the kernels
for _ in range(3):  # captured anew, then replayed with the kernels
    answers.append([a.numpy().tobytes().hex() for a in gt.tree.flatten(jitted(*args))[0]])
seen.append(calls[0])
print(json.dumps({"calls": seen, "same": all(a == answers[0] for a in answers),
                  "status": list(compiled.status().values())}))
"""


def test_a_pass_compiled_while_kernels_were_held_is_recaptured_once_they_are_ready(
    filled,
) -> None:
    """A compiled replay captured during a worker's warm-up chose NumPy's forms for the
    kernels then held; once warm-up releases them, the layout is captured anew and its
    replays run the kernels (a tape's passes would otherwise stay on NumPy's forms for
    the tape's lifetime). The answers keep their bits (held kernels are exact ones)."""
    cache, _ = filled
    out = json.loads(run_python(["-c", textwrap.dedent(RECAPTURED_AFTER_WARM_UP)], cache))
    before, after = out["calls"]
    assert before == 0  # held: the replays ran NumPy's add
    assert after - before >= 2  # the two replays after the recapture ran the kernel
    assert out["same"] and out["status"] == ["compiled"]
