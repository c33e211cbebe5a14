"""`benchmarks/run.py --against` (issue 38): results files compared per machine kind, and
the machine kind a run records. The results files are written here by hand in the shape
run.py writes, with known figures; nothing is measured and no model loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.conftest import REPO

INTEL = "Intel Xeon Sapphire Rapids (AVX-512, AMX)"
AMD = "AMD EPYC Zen 4 (AVX-512)"
STEER = "steering 8 features ÷ no SAE (16384-feature SAE)"


def _row(group: str, what: str, ratio: float | None, kind: str, target: str = "", status: str = "") -> dict:
    return {
        "group": group,
        "what": what,
        "ratio": ratio,
        "target": target,
        "op": ">=" if target else "",
        "threshold": float(target.split()[1]) if target else None,
        "status": status,
        "note": "",
        "machine": kind,
    }


def _results(path, kind: str, commit: str, rows: list[dict], gb_s: float = 38.8) -> str:
    path.write_text(
        json.dumps(
            {
                "meta": {"commit": commit, "date": "2026-12-07 01:00:00 UTC", "quick": False, "groups": ["decode"]},
                "machine": {
                    "kind": kind,
                    "vendor": kind.split()[0],
                    "model_name": f"{kind.split(' (')[0]} test CPU",
                    "flags": ["avx2", "avx512f"],
                    "cpus": 2,
                    "bandwidth": {"buffer_bytes": 536870912, "reps": 5, "gb_s": gb_s, "read_gb_s": gb_s},
                    "load_average_start": [0.4, 0.3, 0.2],
                    "load_average_end": [1.7, 1.0, 0.5],
                },
                "bandwidth": {},
                "rows": rows,
                "raw": {},
            }
        )
    )
    return str(path)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _cells(stdout: str, what: str) -> list[str]:
    """The table line of the row ``what``, split into its cells (two or more spaces apart)."""
    (line,) = [ln for ln in stdout.splitlines() if what in ln]
    return re.split(r"\s{2,}", line.strip())


def test_two_kinds_side_by_side_with_a_dash_where_a_file_lacks_the_row(tmp_path):
    intel = _results(
        tmp_path / "intel.json",
        INTEL,
        "1111111",
        [
            _row("decode", STEER, 0.991, INTEL, "≥ 0.98 (SPEC §7)", "met"),
            _row("decode", "transformers no SAE ÷ bandwidth limit (74.1 tok/s)", 0.73, INTEL, "≥ 0.6 (SPEC §7)", "met"),
            _row("llamacpp", "llama.cpp F32 steering ÷ plain llama-cpp-python, batch 1", 0.998, INTEL),
        ],
    )
    amd = _results(
        tmp_path / "amd.json",
        AMD,
        "2222222",
        [
            _row("decode", STEER, 0.975, AMD, "≥ 0.98 (SPEC §7)", "missed"),
            _row(
                "decode", "transformers no SAE ÷ bandwidth limit (72.0 tok/s)", 0.567, AMD, "≥ 0.6 (SPEC §7)", "missed"
            ),
            _row("vllm", "vLLM against plain vLLM and transformers", None, AMD, status="not installed"),
        ],
        gb_s=40.1,
    )
    proc = _run("--compare-only", "--against", intel, "--against", amd)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # one column per kind, Intel's first (the order of the files)
    (kinds_line,) = [ln for ln in out.splitlines() if INTEL in ln and AMD in ln]
    assert kinds_line.index(INTEL) < kinds_line.index(AMD)
    assert _cells(out, STEER) == ["decode", STEER, "≥ 0.98 (SPEC §7)", "0.991 met", "0.975 missed"]
    # the bandwidth-limit rows are one row though each names its own machine's limit
    assert _cells(out, "bandwidth limit") == [
        "decode",
        "transformers no SAE ÷ bandwidth limit",
        "≥ 0.6 (SPEC §7)",
        "0.730 met",
        "0.567 missed",
    ]
    # a row only one file holds is shown, with a dash in the other kind's column
    assert _cells(out, "llama.cpp F32 steering")[-2:] == ["0.998", "—"]
    assert _cells(out, "vLLM against plain")[-2:] == ["—", "not installed"]
    # each column's file: commit, bandwidth and load
    assert f"[1] {intel}: commit 1111111" in out and "copy 38.8 GB/s" in out and "load 0.4 → 1.7" in out
    assert f"[2] {amd}: commit 2222222" in out and "copy 40.1 GB/s" in out


def test_one_kind_in_two_files_is_before_and_after_with_the_difference(tmp_path):
    before = _results(
        tmp_path / "before.json",
        AMD,
        "b191834",
        [
            _row("decode", STEER, 0.975, AMD, "≥ 0.98 (SPEC §7)", "missed"),
            _row("capture", "last-token capture of every layer ÷ no capture, 16 requests", 1.04, AMD),
        ],
    )
    after = _results(
        tmp_path / "after.json", AMD, "a5e52cc", [_row("decode", STEER, 0.985, AMD, "≥ 0.98 (SPEC §7)", "met")]
    )
    proc = _run("--compare-only", "--against", before, "--against", after)
    assert proc.returncode == 0, proc.stderr
    (head,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("group")]
    assert re.split(r"\s{2,}", head) == ["group", "what", "target", "before [1]", "after [2]", "after − before"]
    assert _cells(proc.stdout, STEER)[3:] == ["0.975 missed", "0.985 met", "+0.010"]
    assert _cells(proc.stdout, "last-token capture")[-2:] == ["1.040", "—"]  # no target: an empty cell


def test_bad_files_are_refused_in_one_line_with_status_2(tmp_path):
    good = _results(tmp_path / "good.json", AMD, "2222222", [_row("decode", STEER, 0.975, AMD)])
    (tmp_path / "broken.json").write_text('{"meta": {}, "rows": [')
    (tmp_path / "other.json").write_text(json.dumps({"checks": {}, "environment": {"device": "cpu"}}))
    (tmp_path / "badrow.json").write_text(json.dumps({"meta": {}, "rows": [{"group": "decode", "ratio": "fast"}]}))
    for name, says in [
        ("missing.json", "no such file"),
        ("broken.json", "not JSON"),
        ("other.json", "not a benchmarks/run.py results file"),
        ("badrow.json", "rows[0] is not a benchmarks/run.py row"),
    ]:
        bad = str(tmp_path / name)
        proc = _run("--compare-only", "--against", good, "--against", bad)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        [line] = proc.stderr.splitlines()
        assert line.startswith(f"benchmarks/run.py: error: {bad}: {says}")
        assert proc.stdout == ""
    # a bad file stops a run before any group starts: nothing is written
    out = tmp_path / "run"
    proc = _run("--only", "decode", "--out", str(out), "--against", str(tmp_path / "broken.json"))
    assert proc.returncode == 2 and "not JSON" in proc.stderr
    assert not out.exists()
    # --compare-only with nothing to compare
    proc = _run("--compare-only")
    assert proc.returncode == 2 and "--compare-only needs at least one --against FILE" in proc.stderr


def test_the_machine_kind_comes_from_cpuinfo():
    from benchmarks.harness import cpu_facts

    amd = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC 9R14 96-Core Processor\nflags\t\t: fpu sse avx avx2 fma avx512f avx512_bf16\n\n"
        "processor\t: 1\nvendor_id\t: AuthenticAMD\n"
    )
    intel = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        "model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: avx avx2 fma avx512f avx512_vnni amx_tile amx_bf16\n"
    )
    milan = (
        "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
        "model name\t: AMD EPYC 7R13 Processor\nflags\t\t: avx avx2 fma\n"
    )
    assert cpu_facts(amd) == {
        "kind": "AMD EPYC Zen 4 (AVX-512)",
        "vendor": "AMD",
        "model_name": "AMD EPYC 9R14 96-Core Processor",
        "family": 25,
        "model": 17,
        "flags": ["avx2", "fma", "avx512f", "avx512_bf16"],
    }
    assert cpu_facts(intel)["kind"] == "Intel Xeon Sapphire Rapids (AVX-512, AMX)"
    assert cpu_facts(intel)["flags"] == ["avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_bf16"]
    assert cpu_facts(milan)["kind"] == "AMD EPYC Zen 3 (AVX2)"
