"""prefixcache.sim.datasets: local copies, checksums, the download path (never the network)."""

import hashlib
import io
import urllib.error

import pytest

from prefixcache.sim import datasets
from prefixcache.sim.trace import read_trace

PAYLOAD = b'{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}\n'


def _registry(url="https://example.invalid/t.jsonl", payload=PAYLOAD):
    d = datasets.Dataset(name="tiny", url=url, sha256=hashlib.sha256(payload).hexdigest(),
                         filename="t.jsonl", trace_format="mooncake", num_requests=1,
                         description="one request")
    return {"tiny": d}


class _Resp(io.BytesIO):
    def __init__(self, data):
        super().__init__(data)
        self.headers = {"Content-Length": str(len(data))}


def test_registry_entries_are_pinned_and_checksummed():
    assert set(datasets.DATASETS) == {
        "mooncake_conversation", "mooncake_synthetic", "mooncake_toolagent", "bailian_to_c",
        "bailian_to_b", "bailian_thinking", "bailian_coder", "claude_code_subagents",
        "claude_code_no_subagents", "agentx", "agentx_256k", "tracelab"}
    for d in datasets.DATASETS.values():
        assert d.url.endswith("/" + d.filename)
        assert d.block_size == {"mooncake": 512, "bailian": 16, "claude_code": 64,
                                "agentx": 64, "tracelab": 64}[d.trace_format]
        if d.trace_format not in ("claude_code", "agentx"):  # (Hugging Face: main revision)
            assert "/main/" not in d.url  # pinned to a commit, not a moving branch
    for name in ("mooncake_conversation", "mooncake_synthetic", "bailian_thinking",
                 "bailian_coder", "tracelab"):
        assert datasets.DATASETS[name].sha256 is not None
    for name in ("mooncake_toolagent", "bailian_to_c", "bailian_to_b", "claude_code_subagents",
                 "agentx"):
        assert datasets.DATASETS[name].sha256 is None  # trust on first use
    with pytest.raises(TypeError):
        datasets.DATASETS["x"] = None  # read-only
    with pytest.raises(ValueError, match="64 lowercase hex"):
        datasets.Dataset("x", "u", "abc", "f", "mooncake", 1, "")
    assert datasets.Dataset("x", "u", None, "f", "jsonl", 1, "").block_size is None
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        datasets.Dataset("x", "u", None, "f", "bailian", 1, "", block_size=0)


def _tofu(url):
    return {"tofu": datasets.Dataset(name="tofu", url=url, sha256=None, filename="t.jsonl",
                                     trace_format="mooncake", num_requests=None,
                                     description="no checksum known")}


def test_trust_on_first_use_records_then_refuses_a_corrupted_copy(tmp_path):
    src = tmp_path / "upstream.jsonl"
    src.write_bytes(PAYLOAD)
    reg, root = _tofu(src.as_uri()), tmp_path / "data"
    path = datasets.path_of("tofu", root=root, registry=reg, progress=False)
    record = datasets.sum_path(path)
    assert record.read_text() == f"{hashlib.sha256(PAYLOAD).hexdigest()}  t.jsonl\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.jsonl", "t.jsonl.sha256"]
    assert datasets.path_of("tofu", root=root, registry=reg, download=False) == path
    path.write_bytes(PAYLOAD + b"\n")  # a damaged (second) copy
    with pytest.raises(datasets.DatasetError, match="recorded on first use"):
        datasets.path_of("tofu", root=root, registry=reg, download=False)
    # Upstream changed under the URL: the new download is refused, nothing is kept.
    path.unlink()
    src.write_bytes(b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [8]}\n')
    with pytest.raises(datasets.DatasetError, match="the download from .* expected .* recorded"):
        datasets.path_of("tofu", root=root, registry=reg, progress=False)
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.jsonl.sha256"]
    # A local path is verified against the record; a registered checksum wins over it.
    with pytest.raises(datasets.DatasetError, match="recorded on first use"):
        datasets.path_of("tofu", root=root, registry=reg, local_path=src)
    pinned = {"tofu": datasets.Dataset("tofu", src.as_uri(), hashlib.sha256(
        src.read_bytes()).hexdigest(), "t.jsonl", "mooncake", None, "")}
    assert datasets.path_of("tofu", root=root, registry=pinned, progress=False).is_file()
    record.write_text("not a checksum\n")
    with pytest.raises(datasets.DatasetError, match="not a checksum record"):
        datasets.path_of("tofu", root=root, registry=reg, download=False)


def test_trust_on_first_use_copies_placed_or_installed(tmp_path):
    reg, root = _tofu("https://example.invalid/t.jsonl"), tmp_path / "data"
    by_hand = root / "tofu" / "t.jsonl"
    by_hand.parent.mkdir(parents=True)
    by_hand.write_bytes(PAYLOAD)
    assert datasets.path_of("tofu", root=root, registry=reg, download=False) == by_hand
    assert datasets.recorded_sha256(by_hand) == hashlib.sha256(PAYLOAD).hexdigest()
    assert datasets.known_sha256("tofu", root=root, registry=reg) == datasets.recorded_sha256(
        by_hand)
    assert datasets.known_sha256("tofu", root=tmp_path / "none", registry=reg) is None
    other = tmp_path / "other.jsonl"
    other.write_bytes(PAYLOAD + b"\n")
    with pytest.raises(datasets.DatasetError, match="recorded on first use"):
        datasets.install("tofu", other, root=root, registry=reg)
    fresh = tmp_path / "fresh"
    dest = datasets.install("tofu", other, root=fresh, registry=reg)  # first use: recorded
    assert datasets.recorded_sha256(dest) == hashlib.sha256(PAYLOAD + b"\n").hexdigest()
    assert datasets.path_of("tofu", local_path=other, root=fresh, registry=reg) == other


def test_block_size_of_a_dataset():
    datasets.check_block_size("bailian_coder", 16)
    with pytest.raises(datasets.DatasetError, match="16-token blocks .* block_size=16, not 512"):
        datasets.check_block_size("bailian_to_c", 512)
    with pytest.raises(datasets.DatasetError, match="block_size=64"):
        datasets.check_block_size("claude_code_subagents", 16)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(datasets.DatasetError, match="unknown dataset 'mooncake'.*mooncake_conv"):
        datasets.path_of("mooncake", download=False)


def test_data_dir_env_var_and_default():
    assert str(datasets.data_dir({"PREFIXCACHE_DATA": "/d"})) == "/d"
    assert str(datasets.data_dir({"XDG_CACHE_HOME": "/c"})) == "/c/prefixcache"
    assert datasets.data_dir({}).parts[-2:] == (".cache", "prefixcache")


def test_local_copies_through_the_data_dir(local_datasets):
    for name in ("mooncake_conversation", "mooncake_synthetic"):  # (the local copies)
        d = datasets.DATASETS[name]
        path = datasets.path_of(name, download=False)  # verified against the registry
        assert path == local_datasets / name / d.filename
        with open(path, "rb") as f:
            assert sum(1 for line in f if line.strip()) == d.num_requests
    first = next(read_trace(datasets.path_of("mooncake_synthetic", download=False),
                            format="mooncake"))
    assert first.id == "mc-1" and len(first.prompt) > 0


def test_local_path_is_verified(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_bytes(PAYLOAD)
    reg = _registry()
    assert datasets.path_of("tiny", local_path=good, registry=reg) == good
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(PAYLOAD + b"\n")
    with pytest.raises(datasets.DatasetError, match=r"bad.jsonl.*has sha256 .*expected .*"
                                                    r"example.invalid"):
        datasets.path_of("tiny", local_path=bad, registry=reg)
    with pytest.raises(FileNotFoundError, match="no file"):
        datasets.path_of("tiny", local_path=tmp_path / "none", registry=reg)


def test_download_once_with_progress_then_cached(tmp_path, capsys):
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return _Resp(PAYLOAD)

    reg = _registry()
    path = datasets.path_of("tiny", root=tmp_path, registry=reg, urlopen=opener)
    assert path == tmp_path / "tiny" / "t.jsonl" and path.read_bytes() == PAYLOAD
    assert calls == ["https://example.invalid/t.jsonl"]
    assert "download tiny" in capsys.readouterr().err  # the progress bar
    datasets.path_of("tiny", root=tmp_path, registry=reg, urlopen=opener)
    assert len(calls) == 1  # reused, not downloaded again
    assert list((tmp_path / "tiny").iterdir()) == [path]  # no temp file left


def test_file_url_download(tmp_path):
    src = tmp_path / "upstream.jsonl"
    src.write_bytes(PAYLOAD)
    reg = _registry(url=src.as_uri())
    path = datasets.path_of("tiny", root=tmp_path / "data", registry=reg, progress=False)
    assert path.read_bytes() == PAYLOAD


def test_corrupt_download_keeps_nothing(tmp_path):
    reg = _registry()
    with pytest.raises(datasets.DatasetError, match="the download from .* has sha256"):
        datasets.path_of("tiny", root=tmp_path, registry=reg, progress=False,
                         urlopen=lambda url, timeout: _Resp(b"truncated"))
    assert list((tmp_path / "tiny").iterdir()) == []


def test_no_network_and_no_copy_names_url_and_env_var(tmp_path):
    def offline(url, timeout):
        raise urllib.error.URLError("Name or service not known")

    with pytest.raises(datasets.DatasetError) as e:
        datasets.path_of("tiny", root=tmp_path, registry=_registry(), urlopen=offline)
    msg = str(e.value)
    assert "https://example.invalid/t.jsonl" in msg and "PREFIXCACHE_DATA" in msg
    assert "Name or service not known" in msg
    with pytest.raises(datasets.DatasetError, match="not present locally.*PREFIXCACHE_DATA"):
        datasets.path_of("tiny", root=tmp_path, registry=_registry(), download=False)


def test_cli_fetch_verifies_a_local_path(local_datasets, capsys):
    path = local_datasets / "mooncake_synthetic" / "synthetic_trace.jsonl"
    assert datasets.main(["fetch", "mooncake_synthetic", "--path", str(path)]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert datasets.main(["fetch", "mooncake_conversation", "--path", str(path)]) == 1
    assert "has sha256" in capsys.readouterr().err
    assert datasets.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in datasets.DATASETS) and str(local_datasets) in out


def test_no_jax_import():
    import subprocess
    import sys

    code = ("import sys, prefixcache.sim.datasets; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)




def test_cli_fetch_path_installs_the_verified_copy(local_datasets, tmp_path, monkeypatch,
                                                   capsys):
    src = (local_datasets / "mooncake_synthetic" / "synthetic_trace.jsonl").resolve()
    empty = tmp_path / "data"
    monkeypatch.setenv(datasets.ENV_VAR, str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(src.read_bytes()[:-10])
    assert datasets.main(["fetch", "mooncake_synthetic", "--path", str(bad)]) == 1
    assert not empty.exists()  # a bad copy installs nothing
    capsys.readouterr()
    assert datasets.main(["fetch", "mooncake_synthetic", "--path", str(src)]) == 0
    dest = empty / "mooncake_synthetic" / "synthetic_trace.jsonl"
    assert capsys.readouterr().out.strip() == str(dest)
    assert dest.is_file() and not dest.is_symlink() and dest.read_bytes() == src.read_bytes()
    assert datasets.path_of("mooncake_synthetic", download=False) == dest
    assert not [p for p in dest.parent.iterdir() if p.name.endswith(".partial")]
