"""served_path.py's comparison of its drift table with nll_eval.py's (--compare-nll), without torch:
the reader takes nll_eval's --json and --markdown alike (the committed tiny-gdn TEST tables give
the same numbers both ways), and the comparison says per method whether the served excess is
within one of the table's standard errors, and which methods no table has."""

import os
import sys
import tempfile

import _harness

def _served_path():
    return _harness.script("served_path")


def test_reader_json_and_markdown_agree():
    sp = _served_path()
    base = _harness.data("tools", "results", "tiny-gdn-test", "nll-test-4")
    j, m = sp.read_nll_table(base + ".json"), sp.read_nll_table(base + ".md")
    assert set(j) == set(m) and "stepq@4" in j and "fp32" in j
    for k in j:  # the markdown rounds to 5 decimals
        assert abs(j[k][0] - m[k][0]) <= 5e-6 and abs(j[k][1] - m[k][1]) <= 5e-6, (k, j[k], m[k])


def test_reader_refuses_a_file_without_rows():
    sp = _served_path()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "empty.md")
        with open(p, "w") as f:
            f.write("no table here\n")
        try:
            sp.read_nll_table(p)
        except SystemExit as e:
            assert "--compare-nll" in str(e) and "empty.md" in str(e)
        else:
            raise AssertionError("a file without rows was read")


def test_compare_within_and_outside_one_se():
    sp = _served_path()
    table = [{"method": "fp32", "excess": 0.0, "excess_se": 0.0},
             {"method": "stepq@4", "excess": 0.0060, "excess_se": 0.0017},
             {"method": "uniform@4", "excess": 0.0200, "excess_se": 0.0050},
             {"method": "stepq-rows@4", "excess": 0.0070, "excess_se": 0.0017}]
    refs = [("a.json", {"stepq@4": (0.0054, 0.0017), "uniform@4": (0.0073, 0.0055)}),
            ("b.json", {"stepq@4": (1.0, 0.1)})]
    c = sp.compare_nll(table, refs)
    rows = {r["method"]: r for r in c["rows"]}
    assert set(rows) == {"stepq@4", "uniform@4"}  # fp32 is the reference itself
    assert rows["stepq@4"]["within_one_se"] and rows["stepq@4"]["table"] == "a.json"  # the first file wins
    assert abs(rows["stepq@4"]["difference"] - 0.0006) < 1e-12
    assert not rows["uniform@4"]["within_one_se"]  # 0.0127 apart, s.e. 0.0055
    assert c["not_in_tables"] == ["stepq-rows@4"] and not c["all_within"]
    md = sp.compare_markdown(c)
    assert "| uniform@4 |" in md and "NO" in md and "stepq-rows@4" in md


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))
