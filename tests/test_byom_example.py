"""The bring-your-own-model example runs, reuses the shared prefix and matches cache off."""
import ast
import importlib.util
import pathlib

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "byom_decoder.py"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
    return names


def test_example_uses_only_the_library_pieces():
    imports = _imports(EXAMPLE)
    assert not {m for m in imports if m.startswith(("prefixcache.model", "prefixcache.engine"))}
    assert {"prefixcache", "prefixcache.metadata", "prefixcache_kernels"} <= imports


def test_example_cache_on_equals_cache_off():
    spec = importlib.util.spec_from_file_location("byom_decoder", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main()  # asserts hits, equal tokens and logits itself; checked here too
    on, off = result["on"], result["off"]
    assert on["hit_tokens"] == {"r0": 0, "r1": 12, "r2": 12}
    assert set(off["hit_tokens"].values()) == {0}
    assert on["tokens"] == off["tokens"]
    assert result["max_diff"] <= 1e-5
    assert all(logits.shape == (4, example.VOCAB) for logits in on["logits"].values())
