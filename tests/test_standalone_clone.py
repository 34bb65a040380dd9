"""A copy of the repository with nothing beside it works as a new user's clone would.

The working tree's files (tracked + untracked, not ignored: what a clone of this commit
holds) are copied into a temporary directory with nothing beside it (no workspace
``shared`` directory with the peer harness or the traces) and installed
NON-editable into a fresh virtual environment. Then, in that copy: the main job, a
replay of a generated trace, ``--help`` of every experiment, and the datasets module on
a local file. Nothing is downloaded: the new venv reaches the dev venv's third-party
packages through one path entry (a ``.pth`` line, which adds the directory without
running that venv's own ``.pth`` hooks, so the dev checkout's editable install of
prefixcache stays invisible), and pip builds the wheel offline (``--no-deps
--no-build-isolation``).
"""

import ast
import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(
    p.stem for p in (ROOT / "experiments").glob("*.py")
    if not p.name.startswith("_") and re.search(r"^def main\(", p.read_text(), re.M))


_NOT_SOURCE = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build",
               "dist", "prefixcache.egg-info"}


def _repo_files() -> list[str]:
    """What a clone holds: git's tracked + untracked-not-ignored files (else the tree
    minus caches and virtual environments, for a checkout without git metadata)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True).stdout
        return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not _NOT_SOURCE & set(p.relative_to(ROOT).parts)]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """(copy of the repository, python of a venv with it installed non-editable)."""
    base = tmp_path_factory.mktemp("standalone")
    repo = base / "prefixcache"  # base holds nothing else
    for rel in _repo_files():
        dest = repo / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = pathlib.Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (site / "dev-venv-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-compile", "--target", str(site), str(repo)],
                   check=True, capture_output=True, timeout=300)
    return repo, python


def _run(python, args, cwd, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(kw.pop("env", {}))
    return subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=kw.pop("timeout", 300), **kw)


# The workspace directory beside the checkout (spelled in parts: this file is checked too).
OUTSIDE = re.compile(r"\.\./" "shared|/work/" "shared")


def test_nothing_refers_to_the_workspace_outside_the_repo(clone):
    repo, _ = clone
    offenders = [
        f for f in _repo_files()
        if f.endswith((".py", ".md", ".sh", ".toml", ".ipynb", ".cfg", ".txt"))
        and f not in ("tests/conftest.py", "WORKSPACE_NOTES.md")  # the fixture; team notes
        and re.search(OUTSIDE, (repo / f).read_text(errors="replace"))]
    assert offenders == []


def test_only_the_libraries_are_installed(clone, tmp_path):
    repo, python = clone
    proc = _run(python, ["-c", (
        "import importlib.util as u, json, prefixcache, prefixcache_kernels as kernels, "
        "prefixcache.sim.datasets; "
        "print(json.dumps([prefixcache.__file__, kernels.__file__, "
        "u.find_spec('experiments') is None, u.find_spec('configs') is None]))")],
        cwd=tmp_path)  # outside the checkout
    assert proc.returncode == 0, proc.stderr
    pc, kn, no_experiments, no_configs = json.loads(proc.stdout)
    assert "site-packages" in pc and "site-packages" in kn and str(repo) not in pc
    assert no_experiments and no_configs


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_help_lists_the_scripts_own_flags_and_exits_0(clone, name):
    repo, python = clone
    source = (repo / "experiments" / f"{name}.py").read_text()
    tree = ast.parse(source)
    absl_flags = re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source)
    argparse_calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
                      and getattr(c.func, "attr", None) == "add_argument"]
    if "_common.run_cli(" in source:
        absl_flags += ["config", "workdir", "progress"]
        absl_flags += re.findall(r"^\s+\"(\w+)\": \(\"(?:string|integer)\"", source, re.M)
    assert absl_flags or argparse_calls, f"{name}: no flags found"
    # absl's --helpshort is --help's alias (both exited 1 before run_app): one script
    # of each kind (flags from run_cli / flags at module level) checks it too.
    for flag in ("--help", "--helpshort") if name in ("replay", "bench_metadata") else ("--help",):
        proc = _run(python, ["-m", f"experiments.{name}", flag], cwd=repo)
        assert proc.returncode == 0, (flag, proc.stderr[-2000:])
        for f in absl_flags:  # listed with a help text on its line
            assert re.search(rf"^\s+--(\[no\])?{f}: \S", proc.stdout, re.M), (name, flag, f)
    for call in argparse_calls:
        opt = call.args[0].value
        assert any(k.arg == "help" for k in call.keywords), f"{name}: {opt} has no help"
        assert opt in proc.stdout, (name, opt)


def test_quickstart_and_replay_from_the_clone(clone, tmp_path):
    repo, python = clone
    trace = tmp_path / "trace.jsonl"
    gen = _run(python, ["-c", (
        "import sys; from prefixcache.sim import workloads, trace; "
        "trace.write_trace(sys.argv[1], workloads.generate('multi_turn', seed=0, "
        "num_conversations=4, num_turns=3))"), str(trace)], cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        qs = pool.submit(_run, python, [
            "-m", "experiments.quickstart", f"--workdir={tmp_path / 'qs'}", "--noprogress",
            "--config.num_blocks=24", "--config.system_prompt_lens=(32, 48)",
            "--config.num_users=2", "--config.num_turns=2", "--config.user_msg_len=8",
            "--config.num_cold=1", "--config.cold_prompt_len=40", "--config.max_tokens=2",
            "--config.max_num_batched_tokens=64", "--config.max_model_len=128"], repo)
        rp = pool.submit(_run, python, [
            "-m", "experiments.replay", f"--trace={trace}", "--num_blocks=256",
            "--block_size=16", f"--workdir={tmp_path / 'rp'}"], repo)
        qs, rp = qs.result(), rp.result()
    assert rp.returncode == 0, rp.stderr[-3000:]
    summary = json.loads(rp.stdout.splitlines()[-1])
    assert summary["requests"] == 12 and summary["hit_tokens"] > 0
    assert "12/12" in rp.stderr  # the progress bar counted the file first
    assert (tmp_path / "rp" / "results.jsonl").is_file()
    assert qs.returncode == 0, qs.stderr[-3000:]
    summary = json.loads(qs.stdout.splitlines()[-1])
    assert summary["outputs_identical_cold_warm"] and summary["reused_tokens"] > 0
    assert (tmp_path / "qs" / "results.jsonl").is_file()


def test_datasets_module_with_a_local_file(clone, tmp_path):
    repo, python = clone
    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n')
    ok = _run(python, ["-m", "prefixcache.sim.datasets", "fetch", "mooncake_synthetic",
                       f"--path={good}"], cwd=tmp_path)
    assert ok.returncode == 1 and "has sha256" in ok.stderr  # verified: not the real trace
    offline = _run(python, ["-m", "prefixcache.sim.datasets", "fetch", "mooncake_synthetic",
                            "--noprogress"], cwd=tmp_path,
                   env={"PREFIXCACHE_DATA": str(tmp_path / "data"),
                        "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"})
    assert offline.returncode == 1
    assert "raw.githubusercontent.com" in offline.stderr and "PREFIXCACHE_DATA" in offline.stderr
    assert not (tmp_path / "data" / "mooncake_synthetic" / "synthetic_trace.jsonl").exists()


def test_dataset_local_copy_checksum_verified(clone, local_datasets, tmp_path):
    repo, python = clone
    path = local_datasets / "mooncake_synthetic" / "synthetic_trace.jsonl"
    proc = _run(python, ["-m", "prefixcache.sim.datasets", "fetch", "mooncake_synthetic",
                         f"--path={path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(path)
