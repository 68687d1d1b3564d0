"""``lbkit`` on bad input, from one table: every row ends with exit status 2 and exactly one line
on stderr that names the culprit (the option, or the file and line), with no traceback and no
warning, before any simulation or planning starts.

The rows run in-process through :func:`lbkit.cli.main` (fast: nothing is replayed or planned);
a few run as subprocesses to show that no warning of numpy or numba reaches stderr.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lbkit.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-replicas", "24", "--num-groups", "4", "--num-nodes", "2", "--num-gpus", "8"]


def _jsonl(rows: list[dict | str]) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _rows(n: int = 40, **edits: dict) -> list[dict | str]:
    """``n`` valid Mooncake rows 0.5 s apart; ``edits`` maps "line<k>" to fields to change."""
    rows: list[dict | str] = [
        {"timestamp": 500 * i, "input_length": 300 + 17 * i, "output_length": 5 + i % 7}
        for i in range(n)
    ]
    for key, change in edits.items():
        k = int(key.removeprefix("line")) - 1
        rows[k] = change if isinstance(change, str) else {**rows[k], **change}  # type: ignore
    return rows


def _azure(n: int = 30, **edits: tuple[str, str]) -> str:
    """``n`` valid Azure rows; ``edits`` maps "line<k>" (file line, header is line 1) to fields."""
    rows = [[f"2023-11-16 18:00:{i:02d}.0000000", str(400 + i), str(20 + i)] for i in range(n)]
    for key, change in edits.items():
        k = int(key.removeprefix("line")) - 2
        rows[k] = list(change)
    return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(",".join(r) + "\n" for r in rows)


def _npy(array):
    return lambda path: np.save(path, np.asarray(array))


def _npz(**arrays):
    return lambda path: np.savez(path, **arrays)


W = np.random.default_rng(0).lognormal(0, 1, (3, 16)).round(3) * 100
BINARY = bytes(range(256)) * 8

#: Files the rows refer to as ``{name}``: text, bytes, or a writer called with the path.
# fmt: off
FILES = {
    "ok.jsonl": _jsonl(_rows()),
    "azure.csv": _azure(),
    "big_int.jsonl": _jsonl(_rows(line3={"input_length": 99_999_999_999_999_999_999_999})),
    "big_stamp.jsonl": _jsonl(_rows(line5={"timestamp": 10**25})),
    "big_hash.jsonl": _jsonl(
        [
            {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]},
            {"timestamp": 9, "input_length": 600, "output_length": 2, "hash_ids": [1, 2**64]},
        ]
    ),
    "huge3.jsonl": _jsonl(
        [{"timestamp": 1000 * i, "input_length": 10**9, "output_length": 2} for i in range(3)]
    ),
    "long_out.jsonl": _jsonl(_rows(line4={"output_length": 10**8})),
    "blank_lines.jsonl": _jsonl(["", *_rows(3), "", "", {"timestamp": 1600, "input_length":
                                 2**25, "output_length": 3}, *_rows(3)[1:]]),
    "outlier.jsonl": _jsonl(_rows(line21={"timestamp": 10**12})),
    "outlier_first.jsonl": _jsonl(
        [{"timestamp": 0, "input_length": 100, "output_length": 2}]
        + [{"timestamp": 10**10 + 500 * i, "input_length": 100, "output_length": 2}
           for i in range(30)]
    ),
    "same.jsonl": _jsonl([{"timestamp": 7, "input_length": 100 + i, "output_length": 2}
                          for i in range(10)]),
    "one.jsonl": _jsonl(_rows(1)),
    "binary.jsonl": BINARY,
    "empty.jsonl": "",
    "digits.jsonl": _jsonl(_rows(4, line2='{"timestamp": 1, "input_length": ' + "7" * 5000 + "}")),
    "deep.jsonl": _jsonl(_rows(4, line3="[" * 100_000)),
    "nan_stamp.jsonl": _jsonl(_rows(line6='{"timestamp": NaN, "input_length": 5, '
                                          '"output_length": 1}')),
    "azure_big.csv": _azure(line3=("2023-11-16 18:00:01.0000000", "1" + "0" * 30, "5")),
    "azure_huge.csv": _azure(line4=("2023-11-16 18:00:02.0000000", str(2**25), "5")),
    "azure_outlier.csv": _azure(line12=("2099-01-01 00:00:00.0000000", "400", "20")),
    "azure_binary.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + BINARY,
    "steps_one.jsonl": _jsonl(_rows(10, line6={"input_length": 2**24})),
    "steps_many.jsonl": _jsonl(
        [{"timestamp": 1000 * i, "input_length": 2**22, "output_length": 2} for i in range(60)]
    ),
    # expert loads
    "w.npy": _npy(W),
    "w12.npy": _npy(W[:, :12]),
    "bin.csv": BINARY,
    "bin.json": BINARY,
    "garbage.npy": b"\x93NUMPY" + BINARY,
    "garbage.npz": b"PK\x03\x04" + BINARY,
    "two.npz": _npz(a=W, b=W),
    "bool.npy": _npy(W > 100),
    "str.npy": _npy(np.array([["a", "b"], ["c", "d"]])),
    "complex.npy": _npy(W + 1j),
    "big_int.json": '{"logical_count": [[1, ' + "9" * 400 + "]]}",
    "digits.json": '{"logical_count": [[1, ' + "9" * 5000 + "]]}",
    "deep.json": "[" * 100_000,
    "nan.json": '{"logical_count": [[1, NaN, 2]]}',
    "bool.json": '{"logical_count": [[1, true, 2]]}',
    "overflow3d.npy": _npy(np.full((2, 3, 16), 1e308)),
    "neg.csv": "1,2,3\n4,-5,6\n",
    "inf.csv": "# loads\n1,2,3\n4,1e400,6\n",
    "ragged.csv": "1,2,3\n1,2\n",
    "header.csv": "e0,e1,e2\n",
    "w.yaml": "x: 1\n",
    "many_layers.npy": _npy(np.ones((2000, 16))),
    "many_experts.npy": _npy(np.ones((1, 5000))),
    "slot_layers.npy": _npy(np.ones((1024, 16))),
}
# fmt: on

#: (id, argv, culprit that the one line must name). ``{name}`` is a file of FILES (or
#: ``{dir}``, a directory; ``{tmp}``, the test's directory).
# fmt: off
CASES = [
    # ---- lbkit bench: sizes
    ("prefill-engines-1e9", ["bench", "--prefill-engines", "1000000000"], "--prefill-engines"),
    ("prefill-engines-float", ["bench", "--prefill-engines", "1e9"], "--prefill-engines"),
    ("ranks-per-engine", ["bench", "--ranks-per-engine", "100000"], "--ranks-per-engine"),
    ("prefill-pool", ["bench", "--prefill-engines", "1024", "--ranks-per-engine", "8"],
     "--prefill-engines x --ranks-per-engine"),
    ("prefill-engines-0", ["bench", "--prefill-engines", "0"], "--prefill-engines"),
    ("decode-ranks-1e9", ["bench", "--decode-ranks", "1000000000"], "--decode-ranks"),
    ("decode-pool", ["bench", "--decode-engines", "64", "--decode-ranks", "128"],
     "--decode-engines x --decode-ranks"),
    ("max-requests-1e12", ["bench", "--max-requests", "1000000000000"], "--max-requests"),
    ("max-requests-1", ["bench", "--max-requests", "1"], "--max-requests"),
    ("seed-huge", ["bench", "--seed", "100000000000000000000000"], "--seed"),
    ("seed-negative", ["bench", "--seed", "-1"], "--seed"),
    # ---- lbkit bench: numbers out of range
    ("utilization-tiny", ["bench", "--utilization", "1e-300"], "--utilization"),
    ("utilization-nan", ["bench", "--utilization", "nan"], "--utilization"),
    ("utilization-0", ["bench", "--utilization", "0"], "--utilization"),
    ("budget-tiny", ["bench", "--budget", "1e-300"], "--budget"),
    ("budget-huge", ["bench", "--budget", "1e300"], "--budget"),
    ("decode-batch-tiny", ["bench", "--decode-batch", "1e-300"], "--decode-batch"),
    ("decode-batch-0", ["bench", "--decode-batch", "0"], "--decode-batch"),
    ("migration-gbps-tiny", ["bench", "--migration-gbps", "1e-300"], "--migration-gbps"),
    ("migration-gbps-inf", ["bench", "--migration-gbps", "inf"], "--migration-gbps"),
    ("kv-bytes-huge", ["bench", "--kv-bytes-per-token", str(10**30)], "--kv-bytes-per-token"),
    ("kv-bytes-0", ["bench", "--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
    ("max-migrations-huge", ["bench", "--migrate-every", "0", "--max-migrations", str(10**20)],
     "--max-migrations"),
    ("migrate-every-negative", ["bench", "--migrate-every", "-1"], "--migrate-every"),
    ("migrate-every-inf", ["bench", "--migrate-every", "inf"], "--migrate-every"),
    ("replicas-0", ["bench", "--replicas", "0"], "--replicas"),
    ("replicas-huge", ["bench", "--replicas", "1025"], "--replicas"),
    ("sync-unknown", ["bench", "--replicas", "2", "--sync", "gossip"], "--sync"),
    ("sync-one-router", ["bench", "--sync", "none"], "--sync"),
    ("sync-delay-one-router", ["bench", "--sync-delay", "0.01"], "--sync-delay"),
    ("sync-delay-negative", ["bench", "--replicas", "2", "--sync-delay", "-1"], "--sync-delay"),
    ("sync-delay-with-reports",
     ["bench", "--replicas", "2", "--sync", "reports", "--sync-delay", "0.01"], "--sync-delay"),
    ("sync-period-0", ["bench", "--replicas", "2", "--sync", "reports", "--sync-period", "0"],
     "--sync-period"),
    ("sync-period-shared", ["bench", "--replicas", "2", "--sync-period", "2"], "--sync-period"),
    ("slo-ttft-0", ["bench", "--slo-ttft", "0"], "--slo-ttft"),
    ("slo-tpot-inf", ["bench", "--slo-tpot", "inf"], "--slo-tpot"),
    ("slo-slowdown-negative", ["bench", "--slo-ttft-slowdown", "-1"], "--slo-ttft-slowdown"),
    ("attainment-1.5", ["bench", "--attainment", "1.5"], "--attainment"),
    ("cp-efficiency-tiny", ["bench", "--work-sharing", "split", "--cp-efficiency", "1e-300"],
     "--cp-efficiency"),
    ("cp-efficiency-nan", ["bench", "--work-sharing", "split", "--cp-efficiency", "nan"],
     "--cp-efficiency"),
    ("cost-unknown", ["bench", "--cost", "h100"], "--cost"),
    ("policies-empty", ["bench", "--policies", ""], "--policies"),
    ("policies-commas", ["bench", "--policies", ",,,"], "--policies"),
    ("policies-unknown", ["bench", "--policies", "fastest"], "--policies"),
    ("unknown-option", ["bench", "--frobnicate"], "--frobnicate"),
    ("work-sharing-choice", ["bench", "--work-sharing", "all"], "--work-sharing"),
    # ---- lbkit bench: options that would do nothing
    ("max-migrations-alone", ["bench", "--max-migrations", "3"], "--max-migrations"),
    ("slo-without-goodput", ["bench", "--no-goodput", "--slo-ttft", "5"], "--slo-ttft"),
    ("attainment-without-goodput", ["bench", "--no-goodput", "--attainment", "0.99"],
     "--attainment"),
    ("cp-efficiency-without-split", ["bench", "--cp-efficiency", "0.5"], "--cp-efficiency"),
    ("format-without-trace", ["bench", "--format", "mooncake"], "--format"),
    ("gbps-without-migration", ["bench", "--policies", "round_robin", "--migration-gbps", "10"],
     "--migration-gbps"),
    ("max-requests-beyond-trace", ["bench", "--trace", "{ok.jsonl}", "--max-requests", "100"],
     "--max-requests"),
    ("cache-without-hashes", ["bench", "--trace", "{azure.csv}", "--cache", "local"], "--cache"),
    # ---- lbkit bench: output paths, checked before the replay
    ("json-missing-dir", ["bench", "--json", "/no/such/dir/r.json"], "--json"),
    ("json-is-dir", ["bench", "--json", "{dir}"], "--json"),
    ("json-under-file", ["bench", "--json", "{ok.jsonl}/r.json"], "--json"),
    ("json-is-trace", ["bench", "--trace", "{ok.jsonl}", "--json", "{ok.jsonl}"], "--json"),
    ("plot-is-json", ["bench", "--json", "{tmp}/r.out", "--plot", "{tmp}/r.out"], "--plot"),
    ("plot-suffix", ["bench", "--plot", "{tmp}/figure.xyz"], "--plot"),
    # ---- lbkit bench: the trace file
    ("trace-missing", ["bench", "--trace", "/no/such/trace.jsonl"], "--trace"),
    ("trace-dir", ["bench", "--trace", "{dir}"], "--trace"),
    ("trace-binary", ["bench", "--trace", "{binary.jsonl}"], "binary.jsonl"),
    ("trace-azure-binary", ["bench", "--trace", "{azure_binary.csv}"], "azure_binary.csv"),
    ("trace-empty", ["bench", "--trace", "{empty.jsonl}"], "empty.jsonl"),
    ("trace-wrong-format", ["bench", "--trace", "{ok.jsonl}", "--format", "azure"],
     "ok.jsonl: line 1"),
    ("trace-int-beyond-int64", ["bench", "--trace", "{big_int.jsonl}"], "big_int.jsonl: line 3"),
    ("trace-timestamp-beyond-2**53", ["bench", "--trace", "{big_stamp.jsonl}"],
     "big_stamp.jsonl: line 5"),
    ("trace-hash-beyond-int64", ["bench", "--trace", "{big_hash.jsonl}"], "big_hash.jsonl: line 2"),
    ("trace-5000-digits", ["bench", "--trace", "{digits.jsonl}"], "digits.jsonl: line 2"),
    ("trace-deep-json", ["bench", "--trace", "{deep.jsonl}"], "deep.jsonl: line 3"),
    ("trace-nan-timestamp", ["bench", "--trace", "{nan_stamp.jsonl}"], "nan_stamp.jsonl: line 6"),
    ("trace-three-1e9-prompts", ["bench", "--trace", "{huge3.jsonl}"], "huge3.jsonl: line 1"),
    ("trace-long-output", ["bench", "--trace", "{long_out.jsonl}"], "long_out.jsonl: line 4"),
    ("trace-line-after-blanks", ["bench", "--trace", "{blank_lines.jsonl}"],
     "blank_lines.jsonl: line 7"),
    ("trace-outlier-late", ["bench", "--trace", "{outlier.jsonl}"], "outlier.jsonl: line 21"),
    ("trace-outlier-first", ["bench", "--trace", "{outlier_first.jsonl}"],
     "outlier_first.jsonl: line 1"),
    ("trace-azure-outlier", ["bench", "--trace", "{azure_outlier.csv}"],
     "azure_outlier.csv: line 12"),
    ("trace-same-timestamp", ["bench", "--trace", "{same.jsonl}"], "same.jsonl"),
    ("trace-one-request", ["bench", "--trace", "{one.jsonl}"], "one.jsonl"),
    ("trace-azure-count-1e30", ["bench", "--trace", "{azure_big.csv}"], "azure_big.csv: line 3"),
    ("trace-azure-prompt-2**25", ["bench", "--trace", "{azure_huge.csv}"],
     "azure_huge.csv: line 4"),
    ("trace-prompt-steps", ["bench", "--trace", "{steps_one.jsonl}", "--budget", "0.02"],
     "steps_one.jsonl: line 6"),
    ("trace-total-steps", ["bench", "--trace", "{steps_many.jsonl}"], "--max-requests"),
    ("builtin-total-steps", ["bench", "--max-requests", "2000", "--budget", "0.001"], "--budget"),
    # ---- lbkit eplb: sizes and their relations
    ("num-replicas-1e12", ["eplb", "--num-replicas", "1000000000000"], "--num-replicas"),
    ("num-replicas-0", ["eplb", "--num-replicas", "0"], "--num-replicas"),
    ("num-gpus-1e9", ["eplb", "--num-gpus", "1000000000"], "--num-gpus"),
    ("num-gpus-7", ["eplb", "--num-gpus", "7"], "--num-gpus"),
    ("num-nodes-3", ["eplb", "--num-nodes", "3"], "--num-nodes"),
    ("hierarchical-groups", ["eplb", *SMALL, "--policy", "hierarchical", "--num-groups", "3"],
     "--policy hierarchical"),
    ("global-with-groups", ["eplb", "--policy", "global", "--num-groups", "4"], "--num-groups"),
    ("repeat-1e9", ["eplb", "--repeat", "1000000000"], "--repeat"),
    ("repeat-0", ["eplb", "--repeat", "0"], "--repeat"),
    ("methods-empty", ["eplb", "--methods", ""], "--methods"),
    ("methods-unknown", ["eplb", "--methods", "magic"], "--methods"),
    ("eplb-format-without-load", ["eplb", "--format", "csv"], "--format"),
    ("keep-zero-without-load", ["eplb", "--keep-zero-layers"], "--keep-zero-layers"),
    ("seed-with-load", ["eplb", "--load", "{w.npy}", *SMALL, "--seed", "5"], "--seed"),
    ("eplb-seed-negative", ["eplb", "--seed", "-1"], "--seed"),
    ("eplb-seed-huge", ["eplb", "--seed", str(10**30)], "--seed"),
    ("replicas-below-experts", ["eplb", "--load", "{w.npy}", *SMALL, "--num-replicas", "8",
                                "--num-gpus", "8"], "--num-replicas"),
    ("groups-not-dividing", ["eplb", "--load", "{w12.npy}", "--num-replicas", "24",
                             "--num-groups", "8", "--num-nodes", "2", "--num-gpus", "8"],
     "--num-groups"),
    ("slot-layers", ["eplb", "--load", "{slot_layers.npy}", "--num-replicas", "16384",
                     "--num-groups", "4", "--num-nodes", "2", "--num-gpus", "16"],
     "--num-replicas"),
    ("builtin-repeat-work", ["eplb", "--num-replicas", "16384", "--num-gpus", "4096",
                             "--repeat", "100"], "--repeat"),
    # ---- lbkit eplb: output paths
    ("eplb-json-dir", ["eplb", "--json", "{dir}"], "--json"),
    ("eplb-json-is-plan", ["eplb", "--json", "{tmp}/a.json", "--save-plan", "{tmp}/a.json"],
     "--save-plan"),
    ("save-plan-missing-dir", ["eplb", "--save-plan", "/no/such/dir/p.json"], "--save-plan"),
    ("json-is-load", ["eplb", "--load", "{w.npy}", *SMALL, "--json", "{w.npy}"], "--json"),
    # ---- lbkit eplb: the load file
    ("load-missing", ["eplb", "--load", "/no/such/load.json"], "--load"),
    ("load-dir", ["eplb", "--load", "{dir}"], "--load"),
    ("load-binary-csv", ["eplb", "--load", "{bin.csv}"], "bin.csv"),
    ("load-binary-json", ["eplb", "--load", "{bin.json}"], "bin.json"),
    ("load-garbage-npy", ["eplb", "--load", "{garbage.npy}"], "garbage.npy"),
    ("load-garbage-npz", ["eplb", "--load", "{garbage.npz}"], "garbage.npz"),
    ("load-two-arrays-npz", ["eplb", "--load", "{two.npz}"], "two.npz"),
    ("load-bool-npy", ["eplb", "--load", "{bool.npy}"], "bool.npy"),
    ("load-str-npy", ["eplb", "--load", "{str.npy}"], "str.npy"),
    ("load-complex-npy", ["eplb", "--load", "{complex.npy}"], "complex.npy"),
    ("load-int-beyond-float", ["eplb", "--load", "{big_int.json}"], "big_int.json"),
    ("load-5000-digits", ["eplb", "--load", "{digits.json}"], "digits.json"),
    ("load-deep-json", ["eplb", "--load", "{deep.json}"], "deep.json"),
    ("load-nan-json", ["eplb", "--load", "{nan.json}"], "nan.json"),
    ("load-bool-json", ["eplb", "--load", "{bool.json}"], "bool.json"),
    ("load-3d-sum-overflows", ["eplb", "--load", "{overflow3d.npy}", *SMALL], "overflow3d.npy"),
    ("load-negative-csv", ["eplb", "--load", "{neg.csv}"], "neg.csv: line 2"),
    ("load-inf-csv", ["eplb", "--load", "{inf.csv}"], "inf.csv: line 3"),
    ("load-ragged-csv", ["eplb", "--load", "{ragged.csv}"], "ragged.csv: line 2"),
    ("load-header-only", ["eplb", "--load", "{header.csv}"], "header.csv"),
    ("load-suffix", ["eplb", "--load", "{w.yaml}"], "w.yaml"),
    ("load-many-layers", ["eplb", "--load", "{many_layers.npy}", *SMALL], "many_layers.npy"),
    ("load-many-experts", ["eplb", "--load", "{many_experts.npy}"], "many_experts.npy"),
    # ---- the command itself
    ("no-command", [], "COMMAND"),
    ("unknown-command", ["plan"], "plan"),
]
# fmt: on


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The directory holding every file of FILES (written once for the module)."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    for name, content in FILES.items():
        path = tmp / name
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    (tmp / "adir").mkdir()
    return tmp


def _argv(argv: list[str], tmp: Path) -> list[str]:
    out = []
    for a in argv:
        a = a.replace("{tmp}", str(tmp)).replace("{dir}", str(tmp / "adir"))
        for name in FILES:
            a = a.replace("{" + name + "}", str(tmp / name))
        out.append(a)
    return out


def _assert_one_line(code: int, err: str, culprit: str) -> None:
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("lbkit"), err
    assert "Traceback" not in err and "Warning" not in err, err
    assert culprit in lines[0], err


@pytest.mark.parametrize(("argv", "culprit"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_culprit(files, capsys, argv, culprit):
    code = main(_argv(argv, files))
    captured = capsys.readouterr()
    _assert_one_line(code, captured.err, culprit)
    assert captured.out == ""  # refused before any table was printed


def test_the_table_is_long_and_its_ids_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 40


def test_no_output_file_is_left_by_a_refused_run(files, capsys):
    out = files / "never.json"
    assert main(["bench", "--trace", str(files / "outlier.jsonl"), "--json", str(out)]) == 2
    assert not out.exists()  # the probe that the path is writable leaves nothing behind
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["bench", "--trace", "{big_int.jsonl}"], "big_int.jsonl: line 3"),
        (["bench", "--decode-batch", "1e-300"], "--decode-batch"),
        (["eplb", "--load", "{overflow3d.npy}", *SMALL], "overflow3d.npy"),
        (["eplb", "--load", "{deep.json}"], "deep.json"),
    ],
    ids=["int64", "decode-batch", "3d-overflow", "deep-json"],
)
def test_subprocess_stderr_is_one_line(files, argv, culprit):
    proc = subprocess.run(
        [sys.executable, "-m", "lbkit", *_argv(argv, files)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    _assert_one_line(proc.returncode, proc.stderr, culprit)
