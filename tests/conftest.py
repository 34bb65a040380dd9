"""Test-wide setup.

Eight simulated CPU devices for the sharding tests; must be set before jax is imported.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Converted GGUF weights (`load_pretrained` keeps them by default) go to a directory of
# this run, never the user's ~/.cache.
if "PREFIXCACHE_CACHE_DIR" not in os.environ:
    os.environ["PREFIXCACHE_CACHE_DIR"] = tempfile.mkdtemp(prefix="prefixcache-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PREFIXCACHE_CACHE_DIR"], True)

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


# -- LoRA adapters written the way PEFT saves them (tests/model, tests/engine) --------------

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_PARENT = {m: "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else "mlp" for m in LORA_MODULES}


def write_peft_adapter(path, config, *, rank=4, alpha=8.0, targets=LORA_MODULES, seed=0,
                       layers=None, use_rslora=False, config_changes=None, drop=(),
                       extra_tensors=None):
    """Writes a PEFT LoRA adapter directory (adapter_config.json +
    adapter_model.safetensors, PEFT key names) for a model of `config` (a ModelConfig).

    Random A [r, in] and B [out, r] (B is not zero as at PEFT's init, so the adapter
    changes the outputs). `layers`: the layers that get tensors (default all; sets
    layers_to_transform when given). `drop`: keys to leave out; `extra_tensors`: keys
    to add; `config_changes`: adapter_config.json entries to set (None values delete).

    Returns:
      The written tensors {key: f32 array}.
    """
    import json

    import numpy as np
    import safetensors.numpy

    D, F = config.d_model, config.mlp_dim
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    dims = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in (range(config.num_layers) if layers is None else layers):
        for m in targets:
            fan_in, fan_out = dims[m]
            p = f"base_model.model.model.layers.{i}.{_LORA_PARENT[m]}.{m}"
            tensors[p + ".lora_A.weight"] = (rng.standard_normal((rank, fan_in))
                                             / np.sqrt(fan_in)).astype(np.float32)
            tensors[p + ".lora_B.weight"] = (rng.standard_normal((fan_out, rank))
                                             * 0.3 / np.sqrt(rank)).astype(np.float32)
    for k in drop:
        del tensors[k]
    tensors.update(extra_tensors or {})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
           "use_rslora": use_rslora, "use_dora": False, "modules_to_save": None,
           "fan_in_fan_out": False, "base_model_name_or_path": "test"}
    if layers is not None:
        cfg["layers_to_transform"] = list(layers)
    for k, v in (config_changes or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    safetensors.numpy.save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return tensors


def merge_lora(hf_weights: dict, tensors: dict, scaling: float) -> dict:
    """HF weights (torch [out, in]) with the adapter merged: W + scaling * B @ A (f64)."""
    import numpy as np

    out = {k: np.asarray(v, np.float64) for k, v in hf_weights.items()}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        b = tensors[key.replace("lora_A", "lora_B")]
        w = key.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
        out[w] = out[w] + scaling * (np.asarray(b, np.float64) @ np.asarray(a, np.float64))
    return out


@pytest.fixture(scope="session")
def lora_helpers():
    """`write_peft_adapter`, `merge_lora` and `LORA_MODULES`, as a namespace."""
    import types
    return types.SimpleNamespace(write_peft_adapter=write_peft_adapter,
                                 merge_lora=merge_lora, LORA_MODULES=LORA_MODULES)
