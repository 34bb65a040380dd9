"""The kernels' import name does not collide with Hugging Face's `kernels` (issue 22 item
5): ours installs as `prefixcache_kernels`; with HF's package installed beside it (the
`test` extra does), both import, each from its own files, and nothing of ours claims the
top-level name `kernels`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ours_is_prefixcache_kernels_and_no_kernels_folder_shadows():
    import prefixcache_kernels

    assert pathlib.Path(prefixcache_kernels.__file__).parent.name == "prefixcache_kernels"
    assert hasattr(prefixcache_kernels, "paged_attention")
    assert not (ROOT / "kernels").exists()  # the checkout root cannot shadow HF's package
    top = importlib.metadata.distribution("prefixcache").read_text("top_level.txt")
    if top is not None:  # (editable installs may not write it)
        assert "kernels" not in top.split()


def test_hugging_face_kernels_imports_beside_ours():
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` is not installed (the test extra installs it)")
    # A fresh interpreter in the checkout root (cwd on sys.path, as `python -m pytest`):
    # `import kernels` must be HF's, and ours must still import.
    code = ("import kernels, prefixcache_kernels, json; "
            "print(json.dumps([kernels.__file__, hasattr(kernels, 'get_kernel'), "
            "prefixcache_kernels.__file__]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    hf_file, has_get_kernel, ours = json.loads(out.stdout)
    assert has_get_kernel and "site-packages" in hf_file, hf_file
    assert pathlib.Path(ours).parent.name == "prefixcache_kernels"
    assert dist.metadata["Name"].lower() == "kernels"
