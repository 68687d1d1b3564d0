"""The Trace container and the trace readers: fixtures, every error path, the real files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.sim.traces import (
    BUCKET_EDGES_TOKENS,
    Trace,
    bucket_labels,
    load_azure,
    load_mooncake,
    load_trace,
)

DATA = Path(__file__).resolve().parent / "data"
MOONCAKE_SMALL = DATA / "mooncake_small.jsonl"
AZURE_SMALL = DATA / "azure_small.csv"
TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
MOONCAKE_FULL = TRACES / "mooncake_conversation" / "conversation_trace.jsonl"
AZURE_FULL = TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv"


def _trace(**overrides):
    fields = dict(
        arrival_s=[0.0, 1.0, 1.0, 4.0],
        total_tokens=[100, 20_000, 70_000, 300_000],
        output_tokens=[1, 5, 9, 2],
    )
    fields.update(overrides)
    return Trace(**fields)


# ---------------------------------------------------------------------------------------------
# Trace container
# ---------------------------------------------------------------------------------------------


def test_defaults_copies_and_read_only_arrays():
    arrival = np.array([0.0, 1.0, 1.0, 4.0])
    t = _trace(arrival_s=arrival)
    assert t.cached_tokens.tolist() == [0, 0, 0, 0]
    assert t.request_id.tolist() == [0, 1, 2, 3]
    assert t.total_tokens.dtype == np.int64 and t.arrival_s.dtype == np.float64
    arrival[0] = 99.0  # the caller's array is copied, not captured
    assert t.arrival_s[0] == 0.0
    with pytest.raises(ValueError, match="read-only"):
        t.total_tokens[0] = 5
    with pytest.raises(AttributeError):
        t.source = "other"  # frozen


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"arrival_s": [0.0, 2.0, 1.0, 4.0]}, r"arrival_s: must be non-decreasing \(index 2"),
        ({"arrival_s": [-1.0, 1.0, 1.0, 4.0]}, "arrival_s: must be non-negative"),
        ({"arrival_s": [0.0, math.nan, 1.0, 4.0]}, "arrival_s: must be finite"),
        ({"total_tokens": [0, 1, 2, 3]}, "total_tokens: entries must be >= 1"),
        ({"total_tokens": [1, 2, 3]}, r"total_tokens: must have shape \(4\)"),
        ({"output_tokens": [1, 0, 1, 1]}, "output_tokens: entries must be >= 1"),
        ({"output_tokens": [1, 2.5, 1, 1]}, "output_tokens: must hold integers"),
        ({"cached_tokens": [0, 20_001, 0, 0]}, r"cached_tokens: must be <= total_tokens \(index 1"),
        ({"cached_tokens": [0, -1, 0, 0]}, "cached_tokens: entries must be >= 0"),
        ({"request_id": [0, 1, 1, 2]}, "request_id: must be unique"),
        ({"hash_ids": [1, 2]}, "hash_ids, hash_offsets: give both or neither"),
        (
            {"hash_ids": [1, 2], "hash_offsets": [0, 1, 1, 1, 3]},
            r"hash_offsets: must start at 0 and end at len\(hash_ids\) = 2",
        ),
        (
            {"hash_ids": [1, 2], "hash_offsets": [0, 2, 1, 2, 2]},
            "hash_offsets: must be non-decreasing",
        ),
        ({"hash_ids": [1, -2], "hash_offsets": [0, 1, 2, 2, 2]}, "hash_ids: entries must be >= 0"),
    ],
)
def test_construction_rejects_broken_invariants(overrides, message):
    with pytest.raises(ValueError, match=message):
        _trace(**overrides)


def test_source_must_be_text():
    with pytest.raises(TypeError, match="source: must be a str"):
        _trace(source=3)


def test_cached_may_equal_total_in_the_container():
    t = _trace(cached_tokens=[100, 0, 0, 300_000])
    assert t.cached_tokens.tolist() == [100, 0, 0, 300_000]


def test_slicing_mask_head_and_ragged_hash_ids():
    t = _trace(
        request_id=[10, 11, 12, 13],
        hash_ids=[5, 6, 7, 8, 9, 1],
        hash_offsets=[0, 2, 2, 5, 6],
        source="x",
    )
    s = t[1:3]
    assert s.request_id.tolist() == [11, 12] and s.arrival_s.tolist() == [1.0, 1.0]
    assert s.hash_offsets.tolist() == [0, 0, 3] and s.hash_ids.tolist() == [7, 8, 9]
    m = t[np.array([True, False, True, True])]
    assert m.request_id.tolist() == [10, 12, 13]
    assert [m.hash_ids_of(i).tolist() for i in range(3)] == [[5, 6], [7, 8, 9], [1]]
    assert m.hash_ids_of(-1).tolist() == [1]
    assert t[::2].request_id.tolist() == [10, 12]
    assert t.head(2) == t[:2] and t.head(10) == t and len(t.head(0)) == 0
    assert t[:0].hash_offsets.tolist() == [0] and t[:0].source == "x"


def test_indexing_errors():
    t = _trace()
    with pytest.raises(ValueError, match="slice step must be positive"):
        t[::-1]
    with pytest.raises(TypeError, match="boolean mask of shape"):
        t[1]
    with pytest.raises(TypeError, match="boolean mask of shape"):
        t[np.array([True, False])]
    with pytest.raises(ValueError, match="n: must be >= 0"):
        t.head(-1)
    with pytest.raises(ValueError, match="has no hash_ids"):
        t.hash_ids_of(0)
    with pytest.raises(ValueError, match="i: must be <= 3"):
        _trace(hash_ids=[1, 2, 3, 4], hash_offsets=[0, 1, 2, 3, 4]).hash_ids_of(4)


def test_time_scaled_multiplies_arrivals_only():
    t = _trace(cached_tokens=[1, 2, 3, 4])
    s = t.time_scaled(0.25)
    np.testing.assert_array_equal(s.arrival_s, t.arrival_s * 0.25)
    for name in ("total_tokens", "cached_tokens", "output_tokens", "request_id"):
        np.testing.assert_array_equal(getattr(s, name), getattr(t, name))
    assert s.summary().rate_per_s == pytest.approx(4 * t.summary().rate_per_s)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="factor: must be"):
            t.time_scaled(bad)


def test_equality_is_by_value():
    assert _trace() == _trace()
    assert _trace() != _trace(output_tokens=[1, 5, 9, 3])
    assert _trace() != _trace(source="other")
    assert _trace() != _trace(hash_ids=[0, 1, 2, 3], hash_offsets=[0, 1, 2, 3, 4])
    assert _trace() != "not a trace"


def test_summary_buckets_rate_and_percentiles():
    t = _trace(cached_tokens=[50, 0, 0, 0])
    s = t.summary()
    assert s.num_requests == 4 and s.duration_s == 4.0 and s.rate_per_s == 1.0
    assert s.bucket_labels == ("<16K", "16K-64K", "64K-256K", ">=256K")
    assert s.bucket_counts == (1, 1, 1, 1)
    total = 100 + 20_000 + 70_000 + 300_000
    assert s.bucket_token_shares == pytest.approx(
        (100 / total, 20_000 / total, 70_000 / total, 300_000 / total)
    )
    assert s.cached_share == pytest.approx(50 / total)
    assert s.total_tokens.max == 300_000 and s.output_tokens.p50 == 3.5
    text = str(s)
    for label in s.bucket_labels:
        assert label in text
    assert "25.00%" in text and "(unnamed)" in text
    as_json = json.loads(json.dumps(s.as_dict()))
    assert as_json["total_tokens"]["max"] == 300_000 and as_json["bucket_counts"] == [1, 1, 1, 1]


def test_summary_lower_edges_are_inclusive_and_edges_are_checked():
    t = _trace(total_tokens=[16383, 16384, 65536, 262144])
    assert t.summary().bucket_counts == (1, 1, 1, 1)
    assert t.summary(bucket_edges_tokens=(1000,)).bucket_counts == (0, 4)
    with pytest.raises(ValueError, match="bucket_edges_tokens: must be strictly increasing"):
        t.summary(bucket_edges_tokens=(10, 10))
    with pytest.raises(ValueError, match="bucket_edges_tokens: must be positive"):
        t.summary(bucket_edges_tokens=(0,))
    assert t.summary(bucket_edges_tokens=()).bucket_counts == (4,)


def test_summary_of_empty_and_single_request_traces():
    empty = _trace()[:0].summary()
    assert empty.num_requests == 0 and empty.bucket_request_shares == (0.0,) * 4
    assert math.isnan(empty.total_tokens.p50) and "no requests" in str(empty)
    one = _trace().head(1).summary()
    assert one.duration_s == 0.0 and math.isnan(one.rate_per_s) and "n/a" in str(one)


def test_bucket_labels():
    assert bucket_labels(BUCKET_EDGES_TOKENS) == ("<16K", "16K-64K", "64K-256K", ">=256K")
    assert bucket_labels((1_048_576, 1500)) == ("<1M", "1M-1500", ">=1500")
    assert bucket_labels(()) == ("all",)


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.integers(1, 300_000), st.integers(1, 50)),
        min_size=1,
        max_size=40,
    ),
    st.integers(0, 45),
    st.integers(0, 45),
)
def test_slices_agree_with_python_lists(rows, start, stop):
    rows.sort(key=lambda r: r[0])
    counts = [r[2] % 4 for r in rows]
    ids = list(range(1000, 1000 + sum(counts)))
    offsets = np.r_[0, np.cumsum(counts)]
    t = Trace(
        arrival_s=[r[0] for r in rows],
        total_tokens=[r[1] for r in rows],
        output_tokens=[r[2] for r in rows],
        hash_ids=ids,
        hash_offsets=offsets,
    )
    s = t[start:stop]
    want = list(range(len(rows)))[start:stop]
    assert s.request_id.tolist() == want
    assert s.total_tokens.tolist() == [rows[i][1] for i in want]
    for j, i in enumerate(want):
        assert s.hash_ids_of(j).tolist() == ids[offsets[i] : offsets[i + 1]]
    summary = s.summary()
    assert sum(summary.bucket_counts) == len(want)
    if want:
        assert sum(summary.bucket_request_shares) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# Readers on the shipped fixtures
# ---------------------------------------------------------------------------------------------


def test_mooncake_fixture_matches_the_json():
    rows = [json.loads(line) for line in MOONCAKE_SMALL.read_text().splitlines()]
    t = load_mooncake(MOONCAKE_SMALL)
    assert len(t) == len(rows) == 200 and t.source == "mooncake_small.jsonl"
    assert t.request_id.tolist() == list(range(200))
    assert t.arrival_s.tolist() == [r["timestamp"] / 1000 for r in rows]
    assert t.total_tokens.tolist() == [r["input_length"] for r in rows]
    assert t.output_tokens.tolist() == [r["output_length"] for r in rows]
    assert t.cached_tokens.tolist() == [0] * 200
    for i in (0, 57, 199):
        assert t.hash_ids_of(i).tolist() == rows[i]["hash_ids"]


def test_azure_fixture_matches_the_csv_exactly():
    lines = AZURE_SMALL.read_text().splitlines()[1:]
    t = load_azure(AZURE_SMALL)
    assert len(t) == 200 and t.hash_ids is None and t.source == "azure_small.csv"
    assert t.total_tokens.tolist() == [int(line.split(",")[1]) for line in lines]
    assert t.output_tokens.tolist() == [int(line.split(",")[2]) for line in lines]

    # Exact: the seconds string, read as a decimal, minus the first one (same day, same hour).
    def seconds(line: str) -> int:  # in 100-ns ticks since the hour
        mm, ss = line.split(",")[0][14:].split(":")
        whole, frac = ss.split(".")
        return (int(mm) * 60 + int(whole)) * 10**7 + int(frac)

    base = seconds(lines[0])
    want = [(seconds(line) - base) / 10**7 for line in lines]
    assert t.arrival_s.tolist() == want  # bit-for-bit: correctly rounded, no drift
    assert t.arrival_s[1] == 4.314579


def test_load_trace_detects_both_formats(tmp_path):
    assert load_trace(MOONCAKE_SMALL) == load_mooncake(MOONCAKE_SMALL)
    assert load_trace(AZURE_SMALL) == load_azure(AZURE_SMALL)
    # Content decides when the suffix says nothing.
    for src, name in ((MOONCAKE_SMALL, "a.log"), (AZURE_SMALL, "b.txt")):
        (tmp_path / name).write_bytes(src.read_bytes())
        assert len(load_trace(tmp_path / name)) == 200
    assert len(load_trace(tmp_path / "a.log", format="mooncake", spread="even")) == 200
    assert len(load_trace(AZURE_SMALL, format="azure")) == 200


def test_load_trace_format_errors(tmp_path):
    with pytest.raises(ValueError, match="format: must be one of 'mooncake', 'azure'; got 'csv'"):
        load_trace(AZURE_SMALL, format="csv")
    (tmp_path / "mystery.dat").write_text("hello,world\n1,2\n")
    with pytest.raises(ValueError, match=r"mystery.dat: cannot tell the trace format.*format="):
        load_trace(tmp_path / "mystery.dat")
    (tmp_path / "garbage.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="garbage.jsonl: line 1: malformed JSON"):
        load_trace(tmp_path / "garbage.jsonl")
    with pytest.raises(TypeError, match="spread"):
        load_trace(AZURE_SMALL, spread="even")


@pytest.mark.parametrize("loader", [load_mooncake, load_azure, load_trace])
def test_missing_file_names_the_path(tmp_path, loader):
    missing = tmp_path / "nope" / "trace.jsonl"
    with pytest.raises(FileNotFoundError, match=r"trace file not found: .*nope.*trace\.jsonl"):
        loader(missing)


@pytest.mark.parametrize("loader", [load_mooncake, load_azure, load_trace])
def test_empty_file(tmp_path, loader):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"empty.jsonl: empty file \(no requests\)"):
        loader(tmp_path / "empty.jsonl")


def test_directory_and_binary_input(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        load_mooncake(tmp_path)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(ValueError, match="bin.jsonl: not UTF-8 text"):
        load_mooncake(tmp_path / "bin.jsonl")


def _mooncake_variant(tmp_path, lineno: int, replace) -> Path:
    """The fixture with line ``lineno`` (1-based) rewritten by ``replace(record_or_text)``."""
    lines = MOONCAKE_SMALL.read_text().splitlines()
    lines[lineno - 1] = replace(lines[lineno - 1])
    out = tmp_path / "conversation_trace.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def _edit(**changes):
    def replace(text):
        rec = json.loads(text)
        for k, v in changes.items():
            if v is _DROP:
                del rec[k]
            else:
                rec[k] = v
        return json.dumps(rec)

    return replace


_DROP = object()


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        (_edit(input_length=-3), "line 17: input_length: must be a positive integer, got -3"),
        (_edit(input_length=0), "line 17: input_length: must be a positive integer, got 0"),
        (_edit(input_length=12.5), "line 17: input_length: must be a positive integer, got 12.5"),
        (_edit(input_length="12"), "line 17: input_length: must be a positive integer, got '12'"),
        (_edit(input_length=True), "line 17: input_length: must be a positive integer, got True"),
        (_edit(output_length=0), "line 17: output_length: must be a positive integer, got 0"),
        (_edit(output_length=None), "line 17: output_length: must be a positive integer, got None"),
        (_edit(timestamp=-5), "line 17: timestamp: must be a non-negative number of ms, got -5"),
        (
            _edit(timestamp="3s"),
            "line 17: timestamp: must be a non-negative number of ms, got '3s'",
        ),
        (_edit(timestamp=_DROP), "line 17: missing field 'timestamp'"),
        (_edit(output_length=_DROP), "line 17: missing field 'output_length'"),
        (_edit(hash_ids=_DROP), r"line 17: hash_ids: must be on every line or on none \(present"),
        (_edit(hash_ids=[0, -1]), "line 17: hash_ids: must be a list of non-negative integers"),
        (_edit(hash_ids="0,1"), "line 17: hash_ids: must be a list of non-negative integers"),
        (
            _edit(hash_ids=list(range(300))),
            r"line 17: hash_ids: must hold ceil\(input_length / 512\) = ",
        ),
        (lambda s: s[:-5], "line 17: malformed JSON"),
        (lambda s: "[1, 2]", "line 17: expected a JSON object, got list"),
    ],
)
def test_mooncake_malformed_line_names_file_line_and_field(tmp_path, replace, message):
    path = _mooncake_variant(tmp_path, 17, replace)
    with pytest.raises(ValueError, match="conversation_trace.jsonl: " + message):
        load_mooncake(path)


def test_mooncake_lines_without_hash_ids_everywhere(tmp_path):
    lines = [json.loads(x) for x in MOONCAKE_SMALL.read_text().splitlines()[:5]]
    for rec in lines:
        del rec["hash_ids"]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    t = load_mooncake(tmp_path / "t.jsonl")
    assert len(t) == 5 and t.hash_ids is None
    lines[3]["hash_ids"] = [0]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    with pytest.raises(ValueError, match=r"line 4: hash_ids: .* \(absent on line 1\)"):
        load_mooncake(tmp_path / "t.jsonl")


def test_mooncake_unsorted_file_is_sorted_stably_and_rebased(tmp_path):
    recs = [
        {"timestamp": 9000, "input_length": 3, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 6000, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]},
        {"timestamp": 9000, "input_length": 5, "output_length": 3, "hash_ids": [3]},
        {"timestamp": 7500.5, "input_length": 7, "output_length": 4, "hash_ids": [4]},
    ]
    (tmp_path / "u.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    t = load_mooncake(tmp_path / "u.jsonl")
    assert t.request_id.tolist() == [1, 3, 0, 2]
    assert t.arrival_s.tolist() == [0.0, 1.5005, 3.0, 3.0]
    assert t.output_tokens.tolist() == [2, 4, 1, 3]
    assert [t.hash_ids_of(i).tolist() for i in range(4)] == [[0, 2], [4], [1], [3]]


def test_mooncake_block_tokens_option(tmp_path):
    rec = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1, 2]}
    (tmp_path / "b.jsonl").write_text(json.dumps(rec))
    assert load_mooncake(tmp_path / "b.jsonl", block_tokens=256).hash_ids.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"hash_ids: must hold ceil\(input_length / 512\) = 2"):
        load_mooncake(tmp_path / "b.jsonl")
    with pytest.raises(ValueError, match="block_tokens: must be >= 1"):
        load_mooncake(tmp_path / "b.jsonl", block_tokens=0)


# ---------------------------------------------------------------------------------------------
# Spreading quantised Mooncake timestamps
# ---------------------------------------------------------------------------------------------


def _slotted(tmp_path, stamps_ms) -> Path:
    recs = [{"timestamp": s, "input_length": 10, "output_length": 1} for s in stamps_ms]
    (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    return tmp_path / "s.jsonl"


def test_even_spread_places_requests_evenly_within_each_slot(tmp_path):
    path = _slotted(tmp_path, [0, 0, 0, 0, 3000, 3000, 5999, 9000])
    t = load_mooncake(path, spread="even")
    # Slot widths are the gaps to the next timestamp: 3, 2.999, 3.001, then the median gap 3.
    assert t.arrival_s.tolist() == pytest.approx(
        [0.0, 0.75, 1.5, 2.25, 3.0, 3.0 + 2.999 / 2, 5.999, 9.0]
    )
    capped = load_mooncake(path, spread="even", slot_s=1.0)
    assert capped.arrival_s.tolist() == pytest.approx([0, 0.25, 0.5, 0.75, 3, 3.5, 5.999, 9])
    assert load_mooncake(path).arrival_s.tolist() == [0, 0, 0, 0, 3, 3, 5.999, 9]


def test_uniform_spread_is_seeded_and_stays_inside_slots(tmp_path):
    path = _slotted(tmp_path, [0] * 10 + [3000] * 10 + [6000] * 5)
    a = load_mooncake(path, spread="uniform", rng=1)
    assert a == load_mooncake(path, spread="uniform", rng=1)
    assert a != load_mooncake(path, spread="uniform", rng=2)
    assert a == load_mooncake(path, spread="uniform", rng=np.random.default_rng(1))
    slot = np.repeat([0.0, 3.0, 6.0], [10, 10, 5])
    assert (a.arrival_s >= slot).all() and (a.arrival_s < slot + 3.0).all()
    assert (np.diff(a.arrival_s) >= 0).all() and a.request_id.tolist() == list(range(25))


def test_spread_options_are_checked(tmp_path):
    path = _slotted(tmp_path, [0, 0, 0])
    with pytest.raises(ValueError, match="spread: must be one of 'none', 'even', 'uniform'"):
        load_mooncake(path, spread="random")
    with pytest.raises(ValueError, match="slot_s: cannot infer the slot width"):
        load_mooncake(path, spread="even")
    assert load_mooncake(path, spread="even", slot_s=3).arrival_s.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="slot_s: only used with spread="):
        load_mooncake(path, slot_s=3.0)
    with pytest.raises(ValueError, match="slot_s: must be > 0.0"):
        load_mooncake(path, spread="even", slot_s=0)


@given(
    st.lists(st.integers(0, 20), min_size=1, max_size=30),
    st.sampled_from(["even", "uniform"]),
    st.integers(0, 2**32 - 1),
)
def test_spread_keeps_slot_order_and_bounds(tmp_path_factory, slots, spread, seed):
    stamps = sorted(s * 3000 for s in slots)
    path = _slotted(tmp_path_factory.mktemp("spread"), stamps)
    t = load_mooncake(path, spread=spread, slot_s=3.0, rng=seed)
    base = (np.array(stamps) - stamps[0]) / 1000  # seconds since the first timestamp
    assert (np.diff(t.arrival_s) >= 0).all()
    assert (t.arrival_s >= base).all() and (t.arrival_s < base + 3.0).all()
    first_of_slot = np.r_[True, base[1:] != base[:-1]]
    if spread == "even":  # the first request of a slot stays at the slot's start
        np.testing.assert_array_equal(t.arrival_s[first_of_slot], base[first_of_slot])


# ---------------------------------------------------------------------------------------------
# Azure error paths
# ---------------------------------------------------------------------------------------------


def _azure_variant(tmp_path, lineno: int, text: str) -> Path:
    lines = AZURE_SMALL.read_text().splitlines()
    lines[lineno - 1] = text
    out = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    out.write_text("\n".join(lines))
    return out


_T = "2023-11-16 18:16:46.1"  # a valid timestamp
_POS = "must be a positive integer, got"


@pytest.mark.parametrize(
    ("lineno", "text", "message"),
    [
        (
            1,
            "time,ContextTokens,GeneratedTokens",
            "line 1: header must name columns .*missing TIME",
        ),
        (1, "2023-11-16 18:15:46.6805900,374,44", "line 1: header must name columns"),
        (17, f"{_T},374", "line 17: expected 3 columns, got 2"),
        (17, f"{_T},-3,44", f"line 17: ContextTokens: {_POS} -3"),
        (17, f"{_T},0,44", f"line 17: ContextTokens: {_POS} 0"),
        (17, f"{_T},3.5,44", f"line 17: ContextTokens: {_POS} '3.5'"),
        (17, f"{_T},35,x", f"line 17: GeneratedTokens: {_POS} 'x'"),
        (17, f"{_T},35,", f"line 17: GeneratedTokens: {_POS} ''"),
        (17, "2023/11/16 18:16:46.1,374,44", "line 17: TIMESTAMP: must read YYYY-MM-DD HH:MM:SS"),
        (17, "2023-11-16 18:16:46.12345678,374,44", "line 17: TIMESTAMP: must read"),
        (17, "2023-02-30 18:16:46.1,374,44", "line 17: TIMESTAMP: has an invalid date"),
        (17, "2023-11-16 24:16:46.1,374,44", "line 17: TIMESTAMP: has an invalid time of day"),
        (17, ",374,44", "line 17: TIMESTAMP: must read"),
    ],
)
def test_azure_malformed_row_names_file_line_and_column(tmp_path, lineno, text, message):
    path = _azure_variant(tmp_path, lineno, text)
    with pytest.raises(ValueError, match="AzureLLMInferenceTrace_conv.csv: " + message):
        load_azure(path)


def test_azure_header_only_extra_columns_and_coarse_timestamps(tmp_path):
    (tmp_path / "h.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="h.csv: no data rows after the header"):
        load_azure(tmp_path / "h.csv")
    (tmp_path / "x.csv").write_text(
        "\ufeffGeneratedTokens,TIMESTAMP,Extra,ContextTokens\r\n"
        "5,2023-11-16 23:59:59,a,10\r\n"
        "6,2023-11-17T00:00:00.5,b,20\r\n"
        "7,2023-11-16 23:59:59.25,c,30\r\n"
    )
    t = load_azure(tmp_path / "x.csv")
    assert t.arrival_s.tolist() == [0.0, 0.25, 1.5]  # across midnight, sorted stably
    assert t.request_id.tolist() == [0, 2, 1]
    assert t.total_tokens.tolist() == [10, 30, 20] and t.output_tokens.tolist() == [5, 7, 6]


# ---------------------------------------------------------------------------------------------
# The real shared traces (skipped when absent)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not MOONCAKE_FULL.is_file(), reason="shared Mooncake trace not present")
def test_real_mooncake_trace_statistics():
    t = load_trace(MOONCAKE_FULL)
    s = t.summary()
    assert len(t) == 12_031 and s.duration_s == 3536.999
    assert s.rate_per_s == pytest.approx(3.40, abs=0.005)
    assert s.total_tokens.p50 == 6909 and s.total_tokens.max == 126_195
    assert s.total_tokens.p90 == pytest.approx(27_367) and s.total_tokens.p99 == pytest.approx(
        85_400, abs=1
    )
    assert t.total_tokens.min() == 891 and t.output_tokens.min() == 1
    assert s.output_tokens.max == 2000 and s.output_tokens.p50 == 350
    assert s.bucket_counts[3] == 0 and s.bucket_request_shares[2] == pytest.approx(0.021, abs=5e-4)
    assert np.unique(t.arrival_s).size == 1180
    assert (np.diff(t.hash_offsets) == -(-t.total_tokens // 512)).all()
    assert (t.hash_ids[t.hash_offsets[:-1]] == 0).all()  # every request starts with block 0
    even = load_mooncake(MOONCAKE_FULL, spread="even")
    assert np.unique(even.arrival_s).size == 12_031 and even.arrival_s[-1] < 3540.0


@pytest.mark.skipif(not AZURE_FULL.is_file(), reason="shared Azure trace not present")
def test_real_azure_trace_statistics():
    t = load_trace(AZURE_FULL)
    s = t.summary()
    assert len(t) == 19_366 and t.request_id.tolist() == list(range(19_366))
    assert t.total_tokens.min() == 2 and t.total_tokens.max() == 14_050
    assert t.output_tokens.min() == 7 and t.output_tokens.max() == 1000
    # 18:15:46.6805900 to 19:14:08.4025270
    assert t.arrival_s[-1] == ((58 * 60 + 22) * 10**7 + 4025270 - 6805900) / 10**7
    assert s.bucket_request_shares == (1.0, 0.0, 0.0, 0.0)
