"""The package itself: imports, backend dispatch, input validation, the reference oracle."""
import math
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference


def test_kernels_installed_inside_the_package_only(tmp_path):
    """transformer_fast.kernels imports; a top-level `kernels` (a PyPI package has that name) does not
    come from us (another package of that name may be installed, even in a venv inside the checkout).
    Checked from another directory, so the checkout itself is not on sys.path."""
    code = ("import importlib.util, os, transformer_fast, transformer_fast.kernels\n"
            "assert importlib.util.find_spec('transformer_fast.kernels') is not None\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "ours = os.path.realpath(os.path.join(os.path.dirname(transformer_fast.kernels.__file__), '__init__.py'))\n"
            "assert spec is None or os.path.realpath(spec.origin or '') != ours, (spec, ours)\n"
            "print('OK')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_non_editable_install_has_no_top_level_kernels(tmp_path):
    """`pip install .` (not editable) installs kernels/ as transformer_fast.kernels and csrc/ beside it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = tmp_path / "site"
    env = dict(os.environ, TRANSFORMER_FAST_NO_BUILD="1")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                             "--no-compile", "--target", str(target), root],
                            env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["transformer_fast"]
    # The extension setup.py built, so that the import below does not JIT-build csrc/ again
    # (minutes): the layout is what is checked here.
    if os.path.basename(tf._C.__file__).startswith("_C."):
        shutil.copy(tf._C.__file__, target / "transformer_fast")
    code = ("import transformer_fast.kernels, transformer_fast._build as b, os; "
            "assert transformer_fast.kernels.__file__.startswith(os.environ['PYTHONPATH']); "
            "assert b._csrc_dir().startswith(os.environ['PYTHONPATH']); print('OK')")
    result = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(target)),
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _from_repo_root(code, tmp_path, pythonpath=None):
    """Runs `python -c code` from the repository root, which Python then puts first on sys.path
    (as `python -m pytest` and `python -m benchmarks.run` do)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_kernels_import_nothing_from_transformer_fast(tmp_path):
    """No import cycle between kernels/ and transformer_fast/: every module of kernels/, loaded as a
    package of another name, imports without loading a transformer_fast module (the launchers
    import transformer_fast._build inside the functions that use it)."""
    kernels = os.path.join(REPO, "kernels")
    code = ("import importlib, importlib.util, pkgutil, sys\n"
            f"path = {kernels!r}\n"
            "spec = importlib.util.spec_from_file_location('alone', path + '/__init__.py',\n"
            "                                              submodule_search_locations=[path])\n"
            "sys.modules['alone'] = package = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(package)\n"
            "names = [info.name for info in pkgutil.iter_modules([path])]\n"
            "for name in names:\n"
            "    importlib.import_module('alone.' + name)\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformer_fast')\n"
            "assert not loaded and 'attention' in names and 'compile_check' in names, (loaded, names)\n"
            "print('OK')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_an_installed_top_level_kernels_package_wins_over_the_folder(tmp_path):
    """From the repository root, `import kernels` gets whatever is installed under that name (here a
    stand-in placed after the root on sys.path), never the kernels/ folder; with nothing installed it
    fails as a missing module does. transformer_fast.kernels is unaffected."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    (site / "kernels" / "extra.py").write_text("VALUE = 7\n")
    code = ("import sys, kernels, kernels.extra, transformer_fast.kernels.attention as ours\n"
            "assert sys.path[0] in ('', '.') or sys.path[0] == __import__('os').getcwd(), sys.path[:2]\n"
            "assert kernels.WHO == 'installed' and kernels.extra.VALUE == 7, kernels.__file__\n"
            "assert ours.__name__ == 'transformer_fast.kernels.attention'\n"
            "print('OK')")
    result = _from_repo_root(code, tmp_path, pythonpath=site)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    code = ("import importlib.util, sys\n"
            "sys.path[:] = [p for p in sys.path if 'site-packages' not in p or 'transformer_fast' in p]\n"
            "try:\n    import kernels\nexcept ModuleNotFoundError as exc:\n    assert exc.name == 'kernels', exc\n"
            "    assert 'kernels' not in sys.modules\n    print('MISSING')\n"
            "else:\n    print('FOUND', kernels.__file__)")
    result = _from_repo_root(code, tmp_path)
    assert result.returncode == 0 and "MISSING" in result.stdout, (result.stdout, result.stderr[-3000:])


def test_transformers_and_the_integration_import_from_the_repository_root(tmp_path):
    """transformers >= 5.25 imports Hugging Face's `kernels` package; from the repository root the
    kernels/ folder shadowed it (ImportError: cannot import name 'CUDAProperties'). Checked in a
    process started there and in this one with the root first on sys.path."""
    pytest.importorskip("transformers")
    code = ("import transformers, transformers.integrations.hub_kernels\n"
            "from transformer_fast.integrations import huggingface\n"
            "assert huggingface.register() == 'transformer_fast'\n"
            "print('OK')")
    result = _from_repo_root(code, tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]

    saved = {name: mod for name, mod in sys.modules.items() if name == "kernels" or name.startswith("kernels.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, REPO)
    try:
        try:
            import kernels
        except ModuleNotFoundError:  # no package of that name installed: nothing shadowed it either
            pass
        else:
            assert not os.path.realpath(kernels.__file__).startswith(os.path.join(REPO, "kernels")), kernels.__file__
        from transformer_fast.integrations import huggingface
        assert huggingface.register() == "transformer_fast"
    finally:
        sys.path.remove(REPO)
        for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_integration_names_the_real_import_error(tmp_path):
    """An installed transformers whose import fails is not reported as missing: the ImportError says
    what failed and chains the original error."""
    site = tmp_path / "site"
    (site / "transformers").mkdir(parents=True)
    (site / "transformers" / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'CUDAProperties' from 'kernels'\")\n")
    code = ("from transformer_fast.integrations import huggingface\n"
            "try:\n    huggingface.register()\nexcept ImportError as exc:\n"
            "    assert 'installed, but importing it failed' in str(exc), exc\n"
            "    assert 'CUDAProperties' in str(exc) and isinstance(exc.__cause__, ImportError), exc\n"
            "    print('OK')\n")
    result = _from_repo_root(code, tmp_path, pythonpath=site)
    assert result.returncode == 0 and "OK" in result.stdout, (result.stdout, result.stderr[-3000:])


def test_loaded_extension_is_newer_than_its_sources(tmp_path):
    """The ops under test are the code in csrc/: an in-place build not redone after an edit would
    test the old code (the JIT build is rebuilt by ninja, so it passes by construction)."""
    from transformer_fast import _build

    assert _build.sources_newer_than(tf._C.__file__) == []
    # and the check can fail: a binary older than every source
    old_binary = tmp_path / "_C.so"
    old_binary.write_bytes(b"")
    os.utime(old_binary, (0, 0))
    assert "ops/schemas.cpp" in _build.sources_newer_than(str(old_binary))


def test_build_takes_every_source_of_csrc_folders(tmp_path):
    """setup.py and the JIT build compile every .cpp of csrc/'s cpu/, ops/ and launch/ (and .cu of
    cuda/) and bindings.cpp; two with one file name would share an object file in the JIT build, so
    that is refused."""
    from transformer_fast import _build, _build_config

    csrc = _build._csrc_dir()
    sources = {os.path.relpath(p, csrc) for p in _build_config.source_paths(csrc, cuda=True)}
    assert {"ops/schemas.cpp", "cpu/attention_forward.cpp", "launch/native_calls.cpp", "bindings.cpp",
            "cuda/attention_cuda.cu"} <= sources
    assert {name for name in _build_config.source_files(csrc) if name.endswith((".cpp", ".cu"))} == sources
    for folder in _build_config.CPP_FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "cpu" / "norm.cpp").write_text("")
    (tmp_path / "ops" / "norm.cpp").write_text("")
    with pytest.raises(RuntimeError, match=r"share a file name \(norm.cpp\)"):
        _build_config.source_paths(str(tmp_path))


def test_torch_older_than_the_sources_need_is_named():
    """torch 2.10 and older cannot compile csrc/ (ATen APIs they lack): the import says which torch
    it needs instead of quoting a compiler error; setup.py declares the same floor."""
    from transformer_fast import _build

    assert _build.torch_too_old(torch.__version__) is None
    for version in ("2.10.0+cu128", "2.4.1", "1.13.1"):
        assert _build.torch_too_old(version) == f"it needs torch >= 2.11, found {version}"
    for version in ("2.11.0", "2.15.0+cu132", "3.0.0a0"):
        assert _build.torch_too_old(version) is None
    setup = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")).read()
    assert '"torch>=2.11"' in setup


def test_available_backends_says_which_run_on_which_device():
    """{backend: {device: "ok" or why not}}; it said None for a working backend."""
    from transformer_fast import _backends
    backends = tf.available_backends()
    assert set(backends) == {"triton", "cpp", "reference"}
    assert backends["reference"]["cpu"] == "ok" and backends["cpp"]["cpu"] == "ok"  # this extension is built
    for status in backends.values():
        assert set(status) == {"cpu", "cuda"}
        assert all(isinstance(s, str) and s for s in status.values()), status
    if not torch.cuda.is_available():
        assert all("no CUDA device" in status["cuda"] for status in backends.values())
    expected = "ok" if _backends.triton_interpreting() else _backends.unavailable_reason("triton", torch.device("cpu"))
    assert backends["triton"]["cpu"] == expected


def test_jit_trace_records_the_op():
    """torch.jit.trace must record the op (without grad too), not bake its output into the graph."""
    def fn(x, w):
        return tf.layer_norm(x * 2, (16,), w)

    x, w = torch.randn(4, 16), torch.randn(16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer warns about Python values it cannot see
        traced = torch.jit.trace(fn, (x, w), check_trace=False)
        other = torch.randn(4, 16)
        torch.testing.assert_close(traced(other, w), fn(other, w))


def test_import_does_not_load_dynamo():
    """torch._dynamo is 2.3 s of import: the package loads it only when the user compiles."""
    code = "import sys, transformer_fast; assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_choice_is_marked_constant_as_torch_marks_it():
    """_backends marks unavailable_reason for torch.compile without importing torch._dynamo: by
    the attributes torch.compiler.assume_constant_result sets, which this reads from torch."""
    from transformer_fast import _backends

    def probe():
        pass

    torch.compiler.assume_constant_result(probe)
    marks = vars(probe)
    assert marks and all(getattr(_backends.unavailable_reason, k, None) == v for k, v in marks.items()), marks


def test_torch_compile_no_grad_keeps_the_op():
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: tf.layer_norm(x * 2, (16,), w) + 1, fullgraph=True, backend="aot_eager")
    x, w = torch.randn(4, 16), torch.randn(16)
    with torch.no_grad():
        torch.testing.assert_close(fn(x, w), F.layer_norm(x * 2, (16,), w) + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_attention_matches_torch(is_causal):
    q, k, v = (torch.randn(2, 3, 7, 16, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True  # every row keeps a key, so torch's output has no NaN
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=None if is_causal else mask, is_causal=is_causal)
    got = reference.scaled_dot_product_attention(q, k, v, None if is_causal else mask, is_causal)
    torch.testing.assert_close(got, expected)


def test_reference_attention_padding_and_fully_masked_rows():
    q, k, v = (torch.randn(2, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    pad = torch.tensor([[False, False, True, True], [True, True, True, True]])
    out = reference.scaled_dot_product_attention(q, k, v, key_padding_mask=pad)
    expected0 = F.scaled_dot_product_attention(q[:1, :, :, :], k[:1, :, :2], v[:1, :, :2])
    torch.testing.assert_close(out[:1], expected0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # every key padded -> 0, not NaN


def test_reference_layer_norm_matches_torch():
    x = torch.randn(3, 5, 12, dtype=torch.float64) + 1e4
    w, b = torch.randn(5, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(reference.layer_norm(x, (5, 12), w, b), F.layer_norm(x, (5, 12), w, b))
    torch.testing.assert_close(reference.rms_norm(x, (12,), w[0], 1e-6), F.rms_norm(x, (12,), w[0], 1e-6))


def test_reference_linear_attention_by_hand():
    q, k, v = (torch.randn(1, 1, 5, 3, dtype=torch.float64) for _ in range(3))
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    out = reference.linear_attention(q, k, v, is_causal=True)
    for i in range(5):
        num = sum(phi(q[0, 0, i]) @ phi(k[0, 0, j]) * v[0, 0, j] for j in range(i + 1))
        den = sum(phi(q[0, 0, i]) @ phi(k[0, 0, j]) for j in range(i + 1)) + 1e-6
        torch.testing.assert_close(out[0, 0, i], num / den)


# ------------------------------------------------------------------------------------------
# Bad inputs: each class of mistake raises TypeError/ValueError naming the argument.
# ------------------------------------------------------------------------------------------
def _qkv(B=2, H=2, N=5, D=8):
    return torch.randn(B, H, N, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)


@pytest.mark.parametrize("fn", [tf.scaled_dot_product_attention, tf.linear_attention])
def test_attention_rejects_bad_inputs(fn):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        fn(q.numpy(), k, v)
    with pytest.raises(ValueError, match="query must have"):
        fn(q[0, 0], k[0, 0], v[0, 0])
    with pytest.raises(TypeError, match="dtype"):
        fn(q, k.double(), v)
    with pytest.raises(TypeError, match="floating-point"):
        fn(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="batch"):
        fn(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="head dim"):
        fn(q, k[..., :4], v)
    with pytest.raises(ValueError, match="key length"):
        fn(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="head dim must be between"):
        fn(torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 300), torch.randn(1, 1, 2, 8))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, key_len\)"):
        fn(q, k, v, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool"):
        fn(q, k, v, key_padding_mask=torch.zeros(2, 5))


@pytest.mark.parametrize("backend", ["auto", "reference", "cpp"])
def test_non_tensor_optional_arguments_are_named(backend):
    """Not the dispatcher's schema error or pybind's list of signatures: TypeError naming it."""
    q, k, v = _qkv()
    for name, value in (("attn_mask", np.ones((5, 5), bool)), ("key_padding_mask", [[False] * 5] * 2),
                        ("alibi_slopes", [1.0, 1.0]), ("sinks", [0.0, 0.0])):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor or None, got {type(value).__name__}"):
            tf.scaled_dot_product_attention(q, k, v, backend=backend, **{name: value})
    qp, kp = torch.randn(4, 2, 8), torch.randn(6, 2, 8)
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    for name, value in (("cu_seq_k", [0, 6]), ("seqused_k", [6]), ("sinks", [0.0, 0.0])):
        args = {"cu_seq_k": cu_k, name: value}
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor or None, got {type(value).__name__}"):
            tf.varlen_attn(qp, kp, kp, cu_q, args.pop("cu_seq_k"), 4, 6, backend=backend, **args)


def test_sdpa_rejects_bad_masks_and_args():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="does not broadcast"):
        tf.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        tf.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.int32))
    # a float mask in the query's dtype or float32 (as torch's SDPA): float16 with bf16 refused
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(TypeError, match=f"query's dtype torch.bfloat16, got {dtype}"):
            tf.scaled_dot_product_attention(qb, kb, vb, attn_mask=torch.zeros(5, 5, dtype=dtype))
    with pytest.raises(ValueError, match="dropout_p"):
        tf.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    for p in ("0.1", None):  # named, not pybind's list of signatures
        with pytest.raises(TypeError, match=r"dropout_p must be a real scalar in \[0, 1\)"):
            tf.scaled_dot_product_attention(q, k, v, dropout_p=p)
    with pytest.raises(TypeError, match="dropout_p must be"):
        tf.varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                       torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 5, 5,
                       dropout_p="0.1")
    assert torch.equal(tf.scaled_dot_product_attention(q, k, v, dropout_p=0),  # an int 0, as torch takes it
                       tf.scaled_dot_product_attention(q, k, v))
    with pytest.raises(ValueError, match="enable_gqa"):
        tf.scaled_dot_product_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="enable_gqa"):
        tf.scaled_dot_product_attention(torch.randn(1, 3, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8),
                                        enable_gqa=True)


@pytest.mark.parametrize("value", ["False", 0, None, np.bool_(True), torch.tensor(True)])
def test_flags_must_be_bools(value):
    """As torch's functions require: bool("False") is True, so a string would silently run causal."""
    q, k, v = _qkv()
    name = type(value).__name__
    for flag in ("is_causal", "enable_gqa"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got {name}"):
            tf.scaled_dot_product_attention(q, k, v, **{flag: value})
    for flag in ("is_causal", "output_final_state"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got {name}"):
            tf.linear_attention(q, k, v, **{flag: value})
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match=f"enable_gqa must be a bool, got {name}"):
        tf.varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 5, 5,
                       enable_gqa=value)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_alibi_slopes_that_require_grad_are_refused(backend):
    """No kernel computes the slopes' gradient: asking for one is refused, not left at None."""
    q, k, v = _qkv()
    slopes = torch.ones(2, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"alibi_slopes requires grad.*alibi_slopes.detach\(\)"):
        tf.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, backend=backend)
    expected = tf.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes.detach(), backend=backend)
    with torch.no_grad():  # no gradient asked for
        assert torch.equal(tf.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, backend=backend), expected)


def test_linear_attention_rejects_causal_cross_attention():
    with pytest.raises(ValueError, match="equal query and key lengths"):
        tf.linear_attention(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), is_causal=True)


def test_layer_norm_rejects_bad_inputs():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="normalized_shape"):
        tf.layer_norm(x, (5,))
    with pytest.raises(ValueError, match="weight must have shape"):
        tf.layer_norm(x, (6,), weight=torch.ones(5))
    y, h = tf.layer_norm(x, (6,), residual=x.double())  # the add promotes, as x + r does
    assert y.dtype == h.dtype == torch.float64
    with pytest.raises(ValueError, match="residual must have the input's shape"):
        tf.layer_norm(x, (6,), residual=x[:2])
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        tf.layer_norm([1.0], (1,))
    # named, not the dispatcher's schema error or pybind's list of signatures
    for name, value in (("residual", 1.0), ("weight", [1.0] * 6), ("bias", 2)):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor or None, got {type(value).__name__}"):
            tf.layer_norm(x, (6,), **{name: value})
    with pytest.raises(TypeError, match="eps must be a real scalar or None, got str"):
        tf.rms_norm(x, (6,), eps="1e-5")
    for eps, words in (("1e-5", "got str"), (None, "got NoneType")):  # None: torch's layer_norm refuses it too
        with pytest.raises(TypeError, match=f"eps must be a real scalar, {words}"):
            tf.layer_norm(x, (6,), eps=eps)
    for fn in (tf.layer_norm, tf.rms_norm):
        # any integer or sequence of integers, as torch takes; else named (not pybind's signatures)
        expected = fn(x, (6,))
        for shape in (6, np.int64(6), [np.int32(6)], torch.Size([6])):
            assert torch.equal(fn(x, shape), expected)
        for shape, got in (((6.0,), "tuple of float"), (None, "NoneType"), ("6", "str"), (torch.tensor([6]), "Tensor"),
                           (True, "bool")):
            with pytest.raises(TypeError, match=f"{fn.__name__}: normalized_shape must be an int or a sequence of "
                                                f"ints, got {got}$"):
                fn(x, shape)
    q = torch.randn(1, 1, 3, 4)
    for eps, words in (("1e-6", "got str"), (None, "got NoneType")):
        with pytest.raises(TypeError, match=f"eps must be a real scalar, {words}"):
            tf.linear_attention(q, q, q, eps=eps)


def test_linear_attention_step_rejects_bad_state():
    q = torch.randn(2, 3, 4)
    _, state = tf.linear_attention_step(q, q, q)
    with pytest.raises(ValueError, match="state must hold"):
        tf.linear_attention_step(q[:1], q[:1], q[:1], state)


def test_gpu_compile_check_runs_every_config(background_compile):
    """Every Triton kernel config compiles to sm_80 and sm_90 cubins (no GPU needed). The check
    runs beside the other tests (conftest.py's BACKGROUND_COMMANDS); this test runs last."""
    pytest.importorskip("triton")
    returncode, printed, report = background_compile(timeout=2400)
    assert returncode == 0, printed[-8000:]
    cases = report["cases"]
    assert all(c["registers"] > 0 for c in cases)
    assert math.isfinite(sum(c["seconds"] for c in cases))


# ------------------------------------------------------------------------------------------
# Degraded environments: no Triton, no compiler. Run in subprocesses so this process keeps its backends.
# ------------------------------------------------------------------------------------------
def _run_python(code, tmp_path, extra_env=None):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)


def test_import_without_triton(tmp_path):
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, transformer_fast as tf\n"
            "reason = tf.available_backends()['triton']['cpu']\n"
            "assert reason and 'triton' in reason.lower(), reason\n"
            "q = torch.randn(1, 2, 3, 8)\n"
            "torch.testing.assert_close(tf.scaled_dot_product_attention(q, q, q),\n"
            "                           torch.nn.functional.scaled_dot_product_attention(q, q, q))\n"
            "print('OK')")
    result = _run_python(code, tmp_path)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
