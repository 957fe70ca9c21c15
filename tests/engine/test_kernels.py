"""engine/kernels: the loader every compiled kernel goes through (the kernels themselves
are tested beside the ops that call them, against their NumPy paths)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import kernels

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not installed")

KERNEL_MODULE = """
from engine.kernels import helper, kernel
from hmod import scaled

@helper
def half_of(v):
    return v / 2.0

@kernel
def halve_and_count_nans(x, out):
    nans = 0
    for i in range(x.size):
        out[i] = x[i] / 2.0
        if x[i] != x[i]:
            nans += 1
    return nans

@kernel
def divide(a, b, out):
    for i in range(a.size):
        out[i] = a[i] / b[i]

@kernel
def halve_and_scale(x, out):
    for i in range(x.size):
        out[i] = scaled(half_of(x[i]))
"""

# A helper in another file, as engine/kernels/exp.py's for gelu.py and softmax.py.
HELPER_MODULE = """
from engine.kernels import helper

FACTOR = {factor}

@helper
def offset(v):
    return v + 0.25

@helper
def scaled(v):
    return offset(v) * FACTOR
"""


def run_python(code: str, tmp_path: Path, **env: str) -> str:
    """`code` in a fresh interpreter with the kernel module above importable; its stdout."""
    (tmp_path / "kmod.py").write_text(KERNEL_MODULE)
    if not (tmp_path / "hmod.py").exists():
        (tmp_path / "hmod.py").write_text(HELPER_MODULE.format(factor=3.0))
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")
    }
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    full_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_kernel_compiles_at_first_use_and_keeps_numpys_arithmetic(tmp_path: Path) -> None:
    out = run_python(
        """
        import sys, numpy as np, kmod
        assert "numba" not in sys.modules  # not imported before a kernel is used
        k = kmod.halve_and_count_nans.compiled()
        x = np.array([1.0, np.nan, -3.0, np.inf])
        out = np.empty_like(x)
        print(k(x, out), out.tolist())
        # error_model="numpy": a division by zero is inf or NaN, as NumPy's, not an error
        a, b = np.array([1.0, -1.0, 0.0]), np.zeros(3)
        q = np.empty(3)
        kmod.divide.compiled()(a, b, q)
        with np.errstate(divide="ignore", invalid="ignore"):
            print(np.array_equal(q, a / b, equal_nan=True))
        """,
        tmp_path,
    )
    assert out.split("\n")[:2] == ["1 [0.5, nan, -1.5, inf]", "True"]


@pytest.mark.parametrize("value", ["numpy", "off", "0"])
def test_the_switch_runs_numpy_only(tmp_path: Path, value: str) -> None:
    out = run_python(
        """
        import sys, kmod
        from engine import kernels
        print(kernels.enabled(), kmod.divide.compiled(), "numba" in sys.modules)
        """,
        tmp_path,
        GRADTAPE_KERNELS=value,
    )
    assert out.strip() == "False None False"


def test_a_kernel_runs_where_numba_can_cache_nothing(tmp_path: Path) -> None:
    # Every place numba would cache in is blocked by a file where it wants a directory
    # (a read-only install with no home, for a root user too): the kernel compiles anew.
    (tmp_path / "__pycache__").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("")
    out = run_python(
        """
        import numpy as np, kmod
        k = kmod.divide.compiled()
        q = np.empty(2)
        k(np.array([1.0, 3.0]), np.array([2.0, 4.0]), q)
        print(type(kmod.divide.dispatcher._cache).__name__, q.tolist())
        """,
        tmp_path,
        HOME=str(home),
    )
    assert out.strip() == "NullCache [0.5, 0.75]"


def test_a_kernel_is_cached_for_the_next_process(tmp_path: Path) -> None:
    code = """
        import numpy as np, kmod
        kmod.divide.compiled()(np.ones(2), np.ones(2), np.empty(2))
        stats = kmod.divide.dispatcher.stats
        print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
        """
    cache = tmp_path / "cache"
    assert run_python(code, tmp_path, NUMBA_CACHE_DIR=str(cache)).split() == ["0", "1"]
    assert run_python(code, tmp_path, NUMBA_CACHE_DIR=str(cache)).split() == ["1", "0"]


def test_a_kernel_runs_when_its_cache_goes_bad_after_it_was_declared(tmp_path: Path) -> None:
    # numba opens its cache at every compilation: a directory removed (a volume full,
    # remounted read-only, replaced) after the kernel was declared raises OSError from the
    # call; the kernel compiles without the cache from then on (review r10).
    cache = tmp_path / "cache"
    out = run_python(
        f"""
        import shutil, numpy as np, kmod
        k = kmod.divide.compiled()
        shutil.rmtree({str(cache)!r}); open({str(cache)!r}, "w").close()
        q = np.empty(2)
        k(np.array([1.0, 3.0]), np.array([2.0, 4.0]), q)
        k(np.array([1.0, 3.0]), np.array([2.0, 4.0]), q)
        print(type(kmod.divide.dispatcher._cache).__name__, q.tolist())
        """,
        tmp_path,
        NUMBA_CACHE_DIR=str(cache),
    )
    assert out.strip() == "NullCache [0.5, 0.75]"


def test_helpers_run_compiled_in_kernels_and_as_python_outside(tmp_path: Path) -> None:
    out = run_python(
        """
        import sys, numpy as np, kmod, hmod
        assert "numba" not in sys.modules  # declaring helpers imports nothing
        x = np.array([1.0, -3.0, np.nan])
        print(kmod.half_of(1.0), hmod.scaled(1.0))  # plain Python: no numba
        assert "numba" not in sys.modules
        out = np.empty_like(x)
        kmod.halve_and_scale.compiled()(x, out)
        print(out.tolist(), type(hmod.scaled.dispatcher).__name__)
        kmod.halve_and_scale.py_func(x, out)  # the kernel as Python calls them as Python
        print(out.tolist())
        """,
        tmp_path,
    )
    # (x / 2 + 0.25) * 3
    assert out.split("\n")[:3] == [
        "0.5 3.75",
        "[2.25, -3.75, nan] CPUDispatcher",
        "[2.25, -3.75, nan]",
    ]


def test_a_changed_helper_in_another_file_recompiles_its_callers(tmp_path: Path) -> None:
    # numba's own cache knows only the kernel's file and would serve the old helper (and
    # its old constant) from the cache; the loader keys the kernel by the helper's file.
    code = """
        import numpy as np, kmod
        out = np.empty(1)
        kmod.halve_and_scale.compiled()(np.array([1.0]), out)
        stats = kmod.halve_and_scale.dispatcher.stats
        print(out[0], sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
        """
    cache = str(tmp_path / "cache")
    # (1 / 2 + 0.25) * FACTOR
    assert run_python(code, tmp_path, NUMBA_CACHE_DIR=cache).split() == ["2.25", "0", "1"]
    assert run_python(code, tmp_path, NUMBA_CACHE_DIR=cache).split() == ["2.25", "1", "0"]
    (tmp_path / "hmod.py").write_text(HELPER_MODULE.format(factor=5.0))
    assert run_python(code, tmp_path, NUMBA_CACHE_DIR=cache).split() == ["3.75", "0", "1"]
    assert run_python(code, tmp_path, NUMBA_CACHE_DIR=cache).split() == ["3.75", "1", "0"]
    (tmp_path / "hmod.py").write_text(HELPER_MODULE.format(factor=3.0))  # back: recompiled
    assert run_python(code, tmp_path, NUMBA_CACHE_DIR=cache).split()[0] == "2.25"


def test_changed_compile_options_recompile_a_cached_kernel(tmp_path: Path) -> None:
    # The options live in engine/kernels/__init__.py, not in the kernel's file, whose
    # stamp is all numba's own cache checks: the loader keys the code by them too.
    code = """
        import numpy as np, engine.kernels as k, kmod
        if {changed}:
            k._OPTIONS = {{**k._OPTIONS, "error_model": "python"}}
        q = np.empty(1)
        try:  # 1 / 0: inf under NumPy's error model, ZeroDivisionError under Python's
            kmod.divide.compiled()(np.ones(1), np.zeros(1), q)
        except ZeroDivisionError:
            q[0] = -1.0
        stats = kmod.divide.dispatcher.stats
        print(q[0], sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
        """
    cache = str(tmp_path / "cache")
    first = run_python(code.format(changed=False), tmp_path, NUMBA_CACHE_DIR=cache)
    assert first.split() == ["inf", "0", "1"]
    again = run_python(code.format(changed=False), tmp_path, NUMBA_CACHE_DIR=cache)
    assert again.split() == ["inf", "1", "0"]
    # compiled anew under the new options, not the cached code of the old ones
    changed = run_python(code.format(changed=True), tmp_path, NUMBA_CACHE_DIR=cache)
    assert changed.split() == ["-1.0", "0", "1"]


def test_a_kernel_module_takes_nothing_from_other_engine_modules() -> None:
    # numba's disk cache is keyed by the kernel's own file: a constant or function
    # imported from another file is frozen into the cached code and served stale after
    # that file changes (review r11). Only the loader may be imported: its decorator, the
    # argument types a kernel declares for warm-up (never part of compiled code), and
    # helpers, whose files the loader adds to their callers' cache keys.
    # (warmup.py is no kernel module: it compiles the others.)
    import ast
    import importlib

    from engine.kernels import Helper

    for path in sorted((ROOT / "engine" / "kernels").glob("*.py")):
        if path.name == "warmup.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                names = [a.name for a in node.names]
                if node.module == "engine.kernels":
                    assert set(names) <= {"helper", "kernel", "In", "Out", "Ints"}, (
                        f"{path.name}: {names}"
                    )
                else:
                    assert (node.module or "").startswith("engine.kernels."), path.name
                    module = importlib.import_module(node.module or "")
                    for name in names:
                        assert isinstance(getattr(module, name), Helper), f"{path.name}: {name}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("engine") for a in node.names), path.name


def test_the_erf_kernels_constants_are_erf_float32s() -> None:
    from engine import backend
    from engine.kernels import gelu

    assert (gelu.P0, gelu.P1, gelu.P2, gelu.P3, gelu.P4, gelu.P5, gelu.P6) == backend._ERF_P
    assert (gelu.Q0, gelu.Q1, gelu.Q2, gelu.Q3, gelu.Q4) == backend._ERF_Q
    assert gelu.CLAMP == backend._ERF_CLAMP


def test_only_kernels_free_of_a_numpy_paths_bits_contract_products_and_sums() -> None:
    # contract (an FMA: one rounding instead of two) and reassoc (a row's sum vectorized)
    # are the fastmath flags a kernel may ask; the kernels bit-identical to their NumPy
    # paths (erf, GELU, GELU's float64 slope, the convolution windows, normalize's
    # steps) ask none, and only layer norm with its affine reassociates.
    from engine.kernels import conv, gelu, layernorm, layernorm_affine, scatter, softmax

    reassociating = {
        layernorm_affine.affine_forward_kernel,
        layernorm_affine.affine_grad_kernel,
        layernorm_affine.scale_grad_kernel,
    }
    contracting = {gelu.gelu_slope_float32_kernel, softmax.softmax_rows_float32_kernel}
    contracting |= reassociating
    declared = [
        value
        for module in (conv, gelu, layernorm, layernorm_affine, scatter, softmax)
        for value in vars(module).values()
        if isinstance(value, kernels.Kernel)
    ]
    assert contracting < set(declared)
    for k in declared:
        assert k.contract == (k in contracting), k
        assert k.reassoc == (k in reassociating), k
        assert k.exact == (k not in contracting), k
    layernorm_affine.scale_grad_kernel.compiled()
    assert layernorm_affine.scale_grad_kernel.dispatcher.targetoptions["fastmath"] == {
        "contract",
        "reassoc",
    }
    slope = gelu.gelu_slope_float32_kernel
    slope.compiled()
    assert slope.dispatcher.targetoptions["fastmath"] == {"contract"}
    gelu.gelu_float32_kernel.compiled()
    assert gelu.gelu_float32_kernel.dispatcher.targetoptions["fastmath"] is False


def test_a_kernel_with_several_fastmath_flags_is_cached_across_hash_seeds(tmp_path: Path) -> None:
    # numba takes fastmath as a set of flags; a set of strings iterates in an order that
    # depends on the process's hash seed, so its repr may not key the cached code the same
    # way in the next process (a worker missing the Docker build's warmed cache).
    code = """
        import numpy as np, engine.kernels as k, kmod
        k._OPTIONS = {**k._OPTIONS, "fastmath": {"nsz", "arcp", "afn", "ninf", "nnan"}}
        q = np.empty(1)
        kmod.divide.compiled()(np.ones(1), np.full(1, 4.0), q)
        stats = kmod.divide.dispatcher.stats
        print(q[0], sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
        """
    cache = str(tmp_path / "cache")
    first = run_python(code, tmp_path, NUMBA_CACHE_DIR=cache, PYTHONHASHSEED="0")
    assert first.split() == ["0.25", "0", "1"]
    for seed in ("1", "2", "3"):
        again = run_python(code, tmp_path, NUMBA_CACHE_DIR=cache, PYTHONHASHSEED=seed)
        assert again.split() == ["0.25", "1", "0"], seed


def test_a_numba_without_the_cache_key_it_extends_compiles_uncached(tmp_path: Path) -> None:
    # The loader subclasses numba's private Cache._index_key to key cached code by helper
    # files and options; a numba release without it must compile uncached (never stale,
    # never failing), as pyproject.toml's bound on numba relies on.
    out = run_python(
        """
        import numpy as np, numba.core.caching as caching, kmod
        del caching.Cache._index_key
        k = kmod.divide.compiled()
        q = np.empty(2)
        k(np.array([1.0, 3.0]), np.array([2.0, 4.0]), q)
        print(type(kmod.divide.dispatcher._cache).__name__, q.tolist())
        """,
        tmp_path,
        NUMBA_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert out.strip() == "NullCache [0.5, 0.75]"


def test_the_options_key_is_the_same_in_every_process() -> None:
    """Two fastmath flags (layer norm's reassociating kernels) key the cached code alike
    whatever the string hashing of the process (PYTHONHASHSEED): else each worker would
    compile them anew."""
    code = (
        "from engine import kernels; "
        "print(kernels.options_key({'fastmath': {'contract', 'reassoc'}, 'nogil': True}))"
    )
    keys = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(8)
    }
    assert len(keys) == 1, keys
    assert "['contract', 'reassoc']" in keys.pop()
