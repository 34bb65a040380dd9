"""The user documentation holds together: links resolve, commands exist, the API reference
builds.

- every relative link (and `#anchor`) in README.md, docs/*.md and
  experiments/results/*.md names a file (and a heading) that exists;
- every command the README shows names a module, script and config that exist: each
  `python -m experiments.X` / `experiments/X.py` a script (whose `--help` runs: from a
  bare clone in tests/test_standalone_clone.py for the scripts with a `main()`, here for
  the others), each `--config=configs/F.py[:variant]` a config whose `get_config` builds,
  each `prefixcache serve ...` line parses with the server's own parser, each
  `python -m prefixcache...` module imports;
- the README's test command is the one `.ci/run` runs;
- the README's pdoc command builds the API reference offline and the pages name the
  public surface.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").glob("*.md"),
               *(ROOT / "experiments" / "results").glob("*.md")])

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _without_code(text: str) -> str:
    """The markdown outside fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r" ", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(path: pathlib.Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def test_the_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/DESIGN.md", "docs/ARCHITECTURE.md"} <= names
    assert any(n.startswith("experiments/results/") for n in names)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(_without_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


def _commands(page: pathlib.Path = README) -> list[str]:
    """Command lines of a page (code blocks and inline code), continuations joined."""
    text = page.read_text().replace("\\\n", " ")
    spans = re.findall(r"^(?:```|~~~)[^\n]*\n(.*?)^(?:```|~~~)", text, re.M | re.S)
    spans += re.findall(r"`([^`\n]+)`", text)
    return [line.strip() for span in spans for line in span.splitlines() if line.strip()]


def _main_scripts() -> set[str]:
    """The scripts whose --help tests/test_standalone_clone.py runs (the same rule)."""
    return {p.stem for p in (ROOT / "experiments").glob("*.py")
            if not p.name.startswith("_") and re.search(r"^def main\(", p.read_text(), re.M)}


def _scripts(lines: list[str]) -> set[str]:
    found = {m for line in lines for m in re.findall(r"-m experiments\.(\w+)", line)}
    return found | {m for line in lines for m in re.findall(r"\bexperiments/(\w+)\.py\b", line)}


def test_experiment_commands_exist():
    for page in DOCS:
        missing = sorted(s for s in _scripts(_commands(page))
                         if not (ROOT / "experiments" / f"{s}.py").is_file())
        assert missing == [], page.relative_to(ROOT)
    scripts = _scripts(_commands())
    assert {"quickstart", "replay", "compare_policies"} <= scripts
    # Every script in experiments/ is in the README's index.
    listed = scripts | set(re.findall(r"^\| `(\w+)` \|", README.read_text(), re.M))
    unlisted = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                      if not p.name.startswith("_") and p.stem not in listed)
    assert unlisted == [], "experiments without a line in the README's index"


def test_configs_named_in_commands_build():
    configs = sorted({(f, v) for page in DOCS for line in _commands(page)
                      for f, v in re.findall(r"--config=configs/(\w+)\.py(?::(\w+))?", line)})
    assert len(configs) >= 10
    sys.path.insert(0, str(ROOT))
    try:
        for name, variant in configs:
            assert (ROOT / "configs" / f"{name}.py").is_file(), name
            module = importlib.import_module(f"configs.{name}")
            cfg = module.get_config(variant) if variant else module.get_config()
            assert cfg is not None, (name, variant)
    finally:
        sys.path.remove(str(ROOT))


def test_readme_help_of_scripts_not_checked_elsewhere():
    scripts = {m for line in _commands() for m in re.findall(r"-m experiments\.(\w+)", line)}
    others = sorted(scripts - _main_scripts())
    procs = [subprocess.Popen([sys.executable, "-m", f"experiments.{s}", "--help"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in others]
    for name, proc in zip(others, procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "--workdir" in out, (name, err[-2000:])


def test_readme_server_commands_parse():
    from prefixcache.serve.cli import parse_args

    lines = [line for line in _commands() if line.startswith("prefixcache serve ")]
    argvs = [shlex.split(line.split("#")[0])[1:] for line in lines]
    argvs = [a for a in argvs if not a[1].isupper()]  # `prefixcache serve MODEL`: a placeholder
    assert argvs
    for argv in argvs:
        args = parse_args(argv)
        assert args.model == argv[1], argv


def test_library_modules_in_commands_import():
    modules = {m for page in DOCS for line in _commands(page)
               for m in re.findall(r"python -m (prefixcache[\w.]*)", line)}
    assert "prefixcache.serve" in modules
    assert [m for m in modules if importlib.util.find_spec(m) is None] == []


def test_readme_test_command_is_what_ci_runs():
    def norm(s):
        return s.replace("python -m pip", "pip").replace(" -q", "")

    ci = norm((ROOT / ".ci" / "run").read_text())
    [command] = [line for line in _commands()
                 if "python -m pytest" in line and "pip install" in line]
    steps = [norm(s.strip()) for s in command.split("&&")
             if s.strip().startswith(("pip install", "python -m pytest"))]
    assert len(steps) >= 3, command
    assert [s for s in steps if s not in ci] == [], ".ci/run differs from the README"


# ---------------------------------------------------------------- the API reference
def _pdoc_command() -> list[str]:
    [line] = [line for line in _commands() if line.startswith("python -m pdoc ")]
    return shlex.split(line)


def test_api_reference_builds_offline(tmp_path):
    pdoc = pytest.importorskip("pdoc", reason="pdoc comes with the test extra")
    import pdoc.render

    argv = _pdoc_command()[3:]
    flags = [a for a in argv[:argv.index("-o")] if a.startswith("--")]
    modules = [a for a in argv[:argv.index("-o")] if not a.startswith("--")]
    assert flags == ["--no-show-source"], flags  # the one option applied below
    assert {"prefixcache", "prefixcache.core", "prefixcache.metadata", "prefixcache.sim",
            "prefixcache.engine", "prefixcache.serve", "prefixcache_kernels"} <= set(modules)
    # The README's options (the renderer is configured module-wide), and no search index:
    # pdoc's own JavaScript, a few seconds more, nothing of ours.
    pdoc.render.configure(show_source=False, search=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pdoc's notes on annotations it cannot resolve
        pdoc.pdoc(*modules, output_directory=tmp_path)
    page = {m: (tmp_path / (m.replace(".", "/") + ".html")) for m in modules}
    assert all(p.is_file() for p in page.values()), [m for m, p in page.items()
                                                       if not p.is_file()]
    expect = {
        "prefixcache": ["KVCacheManager", "CacheConfig", "Request", "get_computed_blocks",
                        "allocate_slots"],
        "prefixcache.metadata": ["MetadataBuilder", "ScheduledSeq", "AttentionMetadata"],
        "prefixcache.sim": ["read_trace", "CostModel"],
        "prefixcache.engine": ["Engine", "SamplingParams", "EngineMetrics"],
        "prefixcache.serve.app": ["build_app"],
        "prefixcache_kernels": ["paged_attention", "write_kv", "check_backend_config"],
    }
    for module, names in expect.items():
        html = page[module].read_text()
        missing = [n for n in names if f'id="{n}' not in html and f">{n}<" not in html]
        assert missing == [], (module, missing)
