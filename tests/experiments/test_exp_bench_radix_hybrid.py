"""`experiments.bench_radix_hybrid --quick`: its rows, and equal hits on an unbounded pool."""

import json

from experiments import bench_radix_hybrid


def test_quick_rows(capsys):
    bench_radix_hybrid.main(["--quick", "--rounds", "1"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["record"] == "provenance"
    rows = lines[1:]
    assert [(r["layout"], r["num_blocks"]) for r in rows] == [("full,sw128", 100_000),
                                                              ("full,sw128", 600)]
    unbounded, tight = rows
    assert unbounded["hash"]["hit_rate"] == unbounded["radix"]["hit_rate"] > 0.5
    assert unbounded["hash"]["evictions"] == unbounded["radix"]["evictions"] == 0
    assert tight["radix"]["evictions"] > 0 and tight["radix"]["stranded"] == 0
