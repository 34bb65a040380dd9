"""Layering: the cache core, the engine and the server import nothing from the
simulator (``prefixcache.sim``); miss accounting lives in ``prefixcache.core.misses``
and ``prefixcache.sim.misses`` is the same module under its old name."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("core", "engine", "serve")


def _sim_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``file:line: statement`` of each import of ``prefixcache.sim`` in ``path`` (at
    any depth: function-local imports count), and of each ``import_module`` /
    ``__import__`` call given a ``prefixcache.sim`` name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + (
                [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "prefixcache" else [])
        elif isinstance(node, ast.Call) and node.args and isinstance(
                node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__"):
                names = [node.args[0].value]
        for name in names:
            if name == "prefixcache.sim" or name.startswith("prefixcache.sim."):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_no_simulator_import(layer):
    files = sorted((ROOT / "prefixcache" / layer).rglob("*.py"))
    assert files
    bad = [b for f in files for b in _sim_imports(f)]
    assert not bad, "imports of prefixcache.sim where it does not belong:\n" + "\n".join(bad)


def test_the_check_finds_a_simulator_import(tmp_path):
    # (the test above can fail: each form it looks for is found, the new home is not)
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from prefixcache.sim.misses import REASONS\n"
                   "import prefixcache.sim\nfrom prefixcache import sim\n"
                   "importlib.import_module('prefixcache.sim.replay')\n"
                   "from prefixcache.core import misses\n")
    assert sorted(b.split(": ")[1] for b in _sim_imports(src, tmp_path)) == [
        "prefixcache.sim", "prefixcache.sim", "prefixcache.sim.misses",
        "prefixcache.sim.replay"]


def test_importing_the_core_loads_no_simulator_module():
    code = ("import sys, prefixcache.core, prefixcache.core.misses, prefixcache.core.radix, "
            "prefixcache.core.hybrid, prefixcache.core.radix_hybrid; "
            "print(sorted(m for m in sys.modules if m.startswith('prefixcache.sim')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]"


def test_old_name_is_the_same_module():
    import prefixcache.core.misses as core_misses
    import prefixcache.sim.misses as sim_misses
    from prefixcache.sim import misses

    assert sim_misses is core_misses and misses is core_misses
    from prefixcache.sim.misses import REASONS, MissAccountant  # noqa: F401
