"""The public surface is deliberate: what mha and its public subpackages export, and no more."""

import subprocess
import sys

import pytest

import mha

ON_REQUEST = {"cli", "integrations", "tools"}  # public subpackages bound only once something imports them


def test_the_public_names_of_mha_are_its_all():
    """Internal modules are _-prefixed (mha._checks, mha._version): what dir(mha) shows without a _
    is the public surface."""
    public = {name for name in dir(mha) if not name.startswith("_")}
    assert public - ON_REQUEST == set(mha.__all__) - {"__version__"}
    assert {"layouts", "functional", "nn", "kernels", "efficient", "GeneralAttention", "KVCache",
            "RotaryEmbedding"} <= set(mha.__all__)


def test_every_public_module_names_its_exports_and_they_exist():
    for module in (mha, mha.nn, mha.kernels, mha.numpy, mha.functional, mha.efficient, mha.layouts, mha.masks,
                   mha.positions, mha.distributed, mha.modules, mha.explorer):
        assert module.__all__, module.__name__
        assert all(hasattr(module, name) for name in module.__all__), module.__name__


def test_every_public_class_and_function_has_a_docstring_of_its_own():
    """help(mha.KVCache) showed no docstring: every public class and function says what it is."""
    import inspect
    missing = []
    for module in (mha, mha.nn, mha.kernels, mha.functional, mha.efficient, mha.layouts, mha.masks, mha.positions,
                   mha.distributed, mha.modules, mha.explorer):
        for name in module.__all__:
            thing = getattr(module, name)
            own = thing.__dict__.get("__doc__") if inspect.isclass(thing) else getattr(thing, "__doc__", None)
            if (inspect.isclass(thing) or inspect.isfunction(thing)) and not (own or "").strip():
                missing.append(f"{module.__name__}.{name}")
    assert not missing, missing


def test_mha_nn_holds_torch_drop_ins_only():
    assert sorted(mha.nn.__all__) == ["MultiheadAttention", "TransformerDecoderLayer", "TransformerEncoderLayer"]
    assert not hasattr(mha.nn, "GeneralAttention")


def test_import_mha_loads_no_tool_dependency():
    code = "import sys, mha; print(sorted(m for m in ('rich', 'matplotlib', 'safetensors', 'mha.tools') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


@pytest.mark.slow
def test_the_command_without_the_cli_extra_says_what_to_install():
    code = "import sys; sys.modules['rich'] = None; from mha.cli import main"  # rich not installed
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert ran.returncode == 1 and "pip install 'mha[cli]'" in ran.stderr and "Traceback" not in ran.stderr
    no_matplotlib = "import sys; sys.modules['matplotlib'] = None; from mha.cli import main; sys.exit(main({}))"
    version = subprocess.run([sys.executable, "-c", no_matplotlib.format("['--version']")], capture_output=True, text=True)
    assert version.returncode == 0 and "mha" in version.stdout  # a command that needs no plot still runs
    plot = subprocess.run([sys.executable, "-c", no_matplotlib.format("['plot']")], capture_output=True, text=True)
    assert plot.returncode == 1 and "needs matplotlib" in plot.stderr and "Traceback" not in plot.stderr


def test_the_general_module_keeps_its_old_name_one_release_with_a_warning():
    """mha.MultiHeadAttention was one letter from mha.nn.MultiheadAttention (torch's drop-in): it is
    mha.GeneralAttention now, the old name a deprecated alias of the same class."""
    import pytest

    with pytest.warns(DeprecationWarning, match="mha.MultiHeadAttention is renamed mha.GeneralAttention"):
        old = mha.MultiHeadAttention
    assert old is mha.GeneralAttention
    assert "MultiHeadAttention" not in dir(mha)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        mha.NoSuchThing  # noqa: B018 (the access is the test)


def test_rope_moved_to_the_modules_layer_keeps_its_old_name_one_release_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"mha.rope is renamed mha.modules.rope"):
        old = mha.rope
    assert old is mha.modules.rope and old.apply_rope is mha.modules.apply_rope
    assert "rope" not in dir(mha)


def test_the_version_is_written_once_and_every_layer_reads_it():
    from mha import _version
    from mha.kernels import tuning

    assert mha.__version__ == _version.__version__
    assert tuning.__version__ is _version.__version__  # tuning's cache key reads the leaf, not the package


def test_every_module_names_its_exports():
    """A module whose dir() shows its imports says which names are its own (__all__); private
    modules (_checks, _shapes, ...) and the command's tools are exempt."""
    import importlib
    import pathlib

    root = pathlib.Path(mha.__file__).parent
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in ("tools", "cli") or any(p.startswith("_") and p != "__init__" for p in parts):
            continue
        name = ".".join(("mha", *(p for p in parts if p != "__init__")))
        if name == "mha.integrations.transformers":
            continue  # imported on request (the hf extra)
        module = importlib.import_module(name)
        assert hasattr(module, "__all__"), name
        assert all(hasattr(module, n) for n in module.__all__), name
