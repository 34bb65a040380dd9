"""The quickstart notebook runs end to end on CPU (nbclient, kernel python3)."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    # The notebook's install cell takes its source from PREFIXCACHE_SOURCE (here: this
    # checkout, as a mounted checkout on Colab); the kernel runs outside the checkout.
    monkeypatch.setenv("PREFIXCACHE_SOURCE", str(NOTEBOOK.parents[2]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=110,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = {i: "".join(o.get("text", "") for o in c.get("outputs", []))
               for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "token hit rate" in text and "simulated: hit rate" in text
    assert f"prefixcache from {NOTEBOOK.parents[2]}\n" in text  # this checkout's code
    assert "JAX backend: cpu" in text
    # The plots were produced (the sweep PNG and the inline matplotlib figure).
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) >= 2
    assert not any(o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
