"""Reading expert-load dumps: every format, every error path, and the real SGLang files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lbkit.eplb.loads import logical_from_physical, read_expert_load
from lbkit.eplb.synthetic import drift, synthetic_expert_load

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
EXPERT_FILES = sorted((TRACES / "moe_expert_load_deepseek_v3").glob("*.json"))

MATRIX = np.array([[0.0, 0.0, 0.0], [3.0, 1.0, 2.0], [5.0, 0.0, 7.0]])


def test_json_object_and_bare_list(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"logical_count": MATRIX.tolist()}))
    (tmp_path / "b.json").write_text(json.dumps(MATRIX.tolist()))
    for name in ("a.json", "b.json"):
        got = read_expert_load(tmp_path / name)
        np.testing.assert_array_equal(got.weight, MATRIX)
        assert got.source_format == "json" and got.num_layers_read == 3


def test_three_dimensional_dumps_are_summed_over_recordings(tmp_path):
    stacked = np.stack([MATRIX, 2 * MATRIX])
    (tmp_path / "w.json").write_text(json.dumps({"logical_count": stacked.tolist()}))
    np.save(tmp_path / "w.npy", stacked)
    for name in ("w.json", "w.npy"):
        np.testing.assert_array_equal(read_expert_load(tmp_path / name).weight, 3 * MATRIX)


def test_npy_npz_and_csv(tmp_path):
    np.save(tmp_path / "w.npy", MATRIX)
    np.savez(tmp_path / "w.npz", logical_count=MATRIX, other=np.zeros(2))
    np.savez(tmp_path / "single.npz", anything=MATRIX)
    (tmp_path / "w.csv").write_text("# comment\ne0,e1,e2\n0,0,0\n3,1,2\n\n5,0,7\n")
    (tmp_path / "w.txt").write_text("0,0,0\n3,1,2\n5,0,7")
    for name in ("w.npy", "w.npz", "single.npz", "w.csv", "w.txt"):
        np.testing.assert_array_equal(read_expert_load(tmp_path / name).weight, MATRIX, name)


def test_drop_zero_layers_keeps_original_indices(tmp_path):
    np.save(tmp_path / "w.npy", MATRIX)
    got = read_expert_load(tmp_path / "w.npy", drop_zero_layers=True)
    np.testing.assert_array_equal(got.weight, MATRIX[1:])
    assert got.layers.tolist() == [1, 2] and got.num_layers_read == 3


def test_format_override(tmp_path):
    (tmp_path / "load.dat").write_text("1,2\n3,4\n")
    np.testing.assert_array_equal(
        read_expert_load(tmp_path / "load.dat", format="csv").weight, [[1, 2], [3, 4]]
    )


@pytest.mark.parametrize(
    ("name", "content", "error", "match"),
    [
        ("a.json", "{", ValueError, "a.json: malformed JSON at line 1"),
        ("a.json", '{"count": [[1]]}', ValueError, "no 'logical_count' key"),
        ("a.json", '{"logical_count": [[1, 2], [3]]}', ValueError, "not a rectangular array"),
        ("a.json", '{"logical_count": 5}', ValueError, "expected a nested list"),
        ("a.json", '{"logical_count": [[1, -2]]}', ValueError, "a.json: must be non-negative"),
        ("a.json", '{"logical_count": [[1, NaN]]}', ValueError, "a.json: must be finite"),
        ("a.json", '{"logical_count": [1, 2]}', ValueError, "expected a \\[layers, experts\\]"),
        ("a.json", '{"logical_count": [[0, 0]]}', ValueError, "every layer is all zeros"),
        ("a.csv", "1,2\n3\n", ValueError, "a.csv: line 2: expected 2 columns, got 1"),
        ("a.csv", "1,2\n3,x\n", ValueError, "a.csv: line 2: non-numeric field"),
        ("a.csv", "1,2\n3,inf\n", ValueError, "a.csv: line 2: loads must be finite"),
        ("a.csv", "e0,e1\n", ValueError, "a.csv: no data rows"),
        ("a.yaml", "x", ValueError, "cannot tell the format from suffix '.yaml'"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, name, content, error, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(error, match=match):
        read_expert_load(tmp_path / name, drop_zero_layers=True)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="load file not found"):
        read_expert_load(tmp_path / "nope.json")
    (tmp_path / "a.json").write_text("[[1]]")
    with pytest.raises(ValueError, match="format: must be one of"):
        read_expert_load(tmp_path / "a.json", format="parquet")


def test_bad_npy_and_npz(tmp_path):
    (tmp_path / "a.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match="a.npy: not a readable .npy array"):
        read_expert_load(tmp_path / "a.npy")
    np.savez(tmp_path / "two.npz", x=MATRIX, y=MATRIX)
    with pytest.raises(ValueError, match="needs a 'logical_count' array"):
        read_expert_load(tmp_path / "two.npz")


@pytest.mark.skipif(not EXPERT_FILES, reason="shared DeepSeek-V3 expert-load files not present")
@pytest.mark.parametrize("path", EXPERT_FILES, ids=lambda p: p.stem)
def test_real_sglang_dumps(path):
    got = read_expert_load(path, drop_zero_layers=True)
    assert got.num_layers_read == 61
    assert got.weight.shape == (58, 256)
    assert got.layers.tolist() == list(range(3, 61))
    # Top-8 routing: every token counts once per selected expert.
    assert np.all(got.weight.sum(axis=1) % 8 == 0)


def test_synthetic_loads_are_seeded_and_scaled():
    a = synthetic_expert_load(4, 16, kind="lognormal", sigma=1.5, tokens_per_layer=10_000, rng=5)
    b = synthetic_expert_load(4, 16, kind="lognormal", sigma=1.5, tokens_per_layer=10_000, rng=5)
    c = synthetic_expert_load(4, 16, kind="lognormal", sigma=1.5, tokens_per_layer=10_000, rng=6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_allclose(a.sum(axis=1), 10_000, atol=16)
    z = synthetic_expert_load(3, 100, kind="zipf", exponent=1.0, rng=0)
    # Each Zipf layer is a permutation of the same profile.
    np.testing.assert_array_equal(np.sort(z[0]), np.sort(z[1]))
    assert z[0].max() / np.median(z[0]) > 20
    with pytest.raises(ValueError, match="kind: must be one of"):
        synthetic_expert_load(2, 2, kind="uniform")
    with pytest.raises(ValueError, match="sigma: must be >= 0.0"):
        synthetic_expert_load(2, 2, sigma=-1.0)


def test_drift_is_multiplicative_and_seeded():
    w = synthetic_expert_load(2, 32, rng=1)
    d = drift(w, sigma=0.1, rng=3)
    np.testing.assert_array_equal(d, drift(w, sigma=0.1, rng=3))
    ratio = d[w > 0] / w[w > 0]
    assert 0.05 < np.log(ratio).std() < 0.15
    with pytest.raises(ValueError, match="weight: must be non-negative"):
        drift([[-1.0]], sigma=0.1)


def test_logical_from_physical_sums_replicas_and_recordings():
    phy2log = np.array([[0, 1, 0, 2], [2, 2, 1, 0]])
    rec = np.array([[[1, 2, 3, 4], [1, 1, 1, 1]], [[1, 0, 0, 0], [0, 0, 0, 5]]])
    np.testing.assert_array_equal(
        logical_from_physical(rec, phy2log, num_experts=3), [[5, 2, 4], [6, 1, 2]]
    )
    with pytest.raises(ValueError, match="phy2log: entries must be <= 2"):
        logical_from_physical(rec, phy2log + 1, num_experts=3)
    with pytest.raises(ValueError, match="phy2log: must have shape"):
        logical_from_physical(rec, phy2log[:, :2], num_experts=3)
    with pytest.raises(ValueError, match="physical_load: must have shape"):
        logical_from_physical([1.0, 2.0], phy2log, num_experts=3)
