"""``benchmarks/results_json.py``: the results as written read back as the same values, and
short containers sit on one line (the files travel with every device call)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import results_json  # noqa: E402


def test_results_read_back_as_the_same_values():
    doc = {"summary": [{"prompt_tokens": 8193, "each_round": [1.067, 1.149, 1.126], "ok": True, "none": None,
                        **{f"kvplugin_ratio_{i}": 1.0 + i / 100 for i in range(8)}}],
           "timeline": [["step", 1.95, 45.56, 26.3]] * 40, "samples": list(range(500)),
           "nested": {"a": {"b": {"c": ["x" * 50] * 5}}}, "empty": {}, "empty_list": [], "text": "é\n\"q\""}
    text = results_json.dumps(doc)
    assert json.loads(text) == doc
    lines = text.splitlines()
    assert '   "each_round": [1.067, 1.149, 1.126],' in lines  # a short list in a long object: one line
    assert ' "timeline": [' in lines and '  ["step", 1.95, 45.56, 26.3],' in lines  # one row a line
    assert all(len(ln) <= results_json.WIDTH for ln in lines if '"x' not in ln)  # (a long string stays whole)
    assert len(text) < 0.8 * len(json.dumps(doc, indent=1))


def test_write_and_rewrite_keep_a_file_equal(tmp_path):
    p = tmp_path / "r.json"
    doc = {"rows": [{"k": i, "v": [i] * 30} for i in range(20)]}
    p.write_text(json.dumps(doc, indent=1))
    assert results_json.main([str(p)]) == 0
    assert json.loads(p.read_text()) == doc and p.read_text().endswith("}\n")
