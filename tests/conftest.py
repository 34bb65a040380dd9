"""Test-wide setup.

Eight simulated CPU devices for the sharding tests; must be set before jax is imported.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

# The local copies of the public traces (prefixcache.sim.datasets) for tests that must
# never download: ../shared/traces beside the checkout (this workspace's layout), or
# ../../shared/traces from a worktree under <workspace>/wt/<name>.
_ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCAL_TRACES = next((p for p in (_ROOT.parent / "shared" / "traces",
                                 _ROOT.parent.parent / "shared" / "traces") if p.is_dir()),
                    _ROOT.parent / "shared" / "traces")
_LOCAL_DATASET_FILES = {"mooncake_conversation": "mooncake/conversation_trace.jsonl",
                        "mooncake_synthetic": "mooncake/synthetic_trace.jsonl"}


@pytest.fixture
def local_datasets(tmp_path_factory, monkeypatch):
    """``$PREFIXCACHE_DATA`` -> a temp data dir holding links to the local trace copies.

    The datasets module then finds them exactly where a download would have put them
    (``<data dir>/<name>/<file>``) and verifies their checksums: the same code path,
    no network. Skips when the local copies are absent (e.g. a bare clone).

    Returns:
      The data directory.
    """
    from prefixcache.sim import datasets  # noqa: PLC0415

    root = tmp_path_factory.mktemp("prefixcache-data")
    for name, rel in _LOCAL_DATASET_FILES.items():
        src = LOCAL_TRACES / rel
        if not src.is_file():
            pytest.skip(f"local copy of dataset {name} not present ({src})")
        dest = root / name / datasets.get(name).filename
        dest.parent.mkdir(parents=True)
        dest.symlink_to(src)
    monkeypatch.setenv(datasets.ENV_VAR, str(root))
    return root
