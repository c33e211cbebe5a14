"""`benchmarks/run.py`, the one benchmark command (issue 17 item 8), as a smoke run: the
tiny model, a few tokens, one round. Checks what the run writes, never its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO
from tests.fixtures.assets import ASSET_DIR_ENV, asset_cache_dir

ROW_KEYS = {"group", "what", "ratio", "target", "op", "threshold", "status", "note", "machine"}


def _run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, ASSET_DIR_ENV: str(asset_cache_dir())}
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_quick_run_writes_rows_json_and_plot(tiny_assets, tmp_path):
    out = tmp_path / "bench"
    proc = _run("--quick", "--only", "decode,speculative,quantized,compile", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FIGURES ARE MEANINGLESS" in proc.stdout

    result = json.loads((out / "results.json").read_text())
    assert set(result) >= {"meta", "bandwidth", "rows", "raw"}
    meta = result["meta"]
    assert meta["quick"] is True and meta["model"] == "tiny-llama"
    assert meta["groups"] == ["decode", "speculative", "quantized", "compile"]
    assert "vllm" in meta["groups_not_run"] and "batching" in meta["groups_not_run"]
    # the bandwidth limit is measured in the same run, with a buffer the size of the weights
    (bw,) = result["bandwidth"].values()
    assert bw["gb_s"] > 0 and bw["buffer_bytes"] > 0
    assert set(result["raw"]) == {"decode", "speculative", "quantized", "compile"}

    rows = result["rows"]
    assert all(set(r) == ROW_KEYS for r in rows)
    # the machine block, and every row carries its kind (what --against compares by)
    machine = result["machine"]
    assert set(machine) >= {"kind", "vendor", "model_name", "flags", "cpus", "load_average_start", "load_average_end"}
    assert machine["bandwidth"]["buffer_bytes"] == 512 << 20 and machine["bandwidth"]["gb_s"] > 0
    assert machine["kind"] and all(r["machine"] == machine["kind"] for r in rows)
    decode = [r for r in rows if r["group"] == "decode"]
    assert len(decode) == 7
    assert all(isinstance(r["ratio"], float) and r["ratio"] > 0 for r in decode)
    judged = [r for r in decode if r["threshold"] is not None]
    assert {r["threshold"] for r in judged} == {0.95, 0.98, 0.97, 0.6}
    # a smoke run's verdicts carry the label that they mean nothing
    assert all(r["status"].endswith("(--quick: meaningless)") for r in judged)
    assert any("bandwidth limit" in r["what"] for r in judged)

    # speculative decoding: two self-drafts, unsteered and steered, each with a ratio and
    # the exact-tokens check
    speculative = [r for r in rows if r["group"] == "speculative"]
    assert len(speculative) == 8
    assert all(r["ratio"] == 1.0 for r in speculative if "equal plain" in r["what"])

    # Q8 and Q4 loads against fp32: measured, judged against "faster than fp32"
    quantized = [r for r in rows if r["group"] == "quantized"]
    assert [r["what"].split(" ")[0] for r in quantized] == ["Q8", "Q4", "Q8", "Q4"]
    assert all(isinstance(r["ratio"], float) and r["ratio"] > 0 for r in quantized)
    assert [r["threshold"] for r in quantized] == [1.0, 1.0, None, None]

    # compiled against eager and static against dynamic: a ratio each and the exact-tokens
    # check (a tiny model's compiled kernels still choose the same greedy tokens)
    compiled = [r for r in rows if r["group"] == "compile"]
    assert len(compiled) == 4
    assert all(isinstance(r["ratio"], float) and r["ratio"] > 0 for r in compiled)
    assert [r["ratio"] for r in compiled if "equal" in r["what"]] == [1.0, 1.0]

    png = out / "ratios.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_group_is_refused(tmp_path):
    proc = _run("--only", "decode,nonsense", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "nonsense" in proc.stderr


def test_a_missing_backend_is_a_row_not_a_gap(tmp_path, monkeypatch, capsys):
    from benchmarks import run

    monkeypatch.setattr(run, "MISSING", {"llamacpp": lambda: "llama-cpp-python", "vllm": lambda: "vLLM"})
    monkeypatch.setattr(sys, "argv", ["run.py", "--only", "llamacpp,vllm", "--out", str(tmp_path)])
    run.main()
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["group"], r["status"]) for r in rows] == [("llamacpp", "not installed"), ("vllm", "not installed")]
    assert capsys.readouterr().out.count("not installed") == 2


def test_the_benchmarks_stream_clients_read_chunked_sse_as_it_arrived():
    """``benchmarks.sse.stream_clients`` (the /v1 benchmarks' clients): frames split over
    HTTP chunks and recvs are read whole, each time-stamped no earlier than the server
    started sending its last part, the usage chunk's tokens counted, a refused request reported."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from benchmarks.sse import stream_clients

    sent: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/completions":
                self.send_response(404)
                self.send_header("Content-Length", "9")
                self.end_headers()
                self.wfile.write(b"not found")
                return
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def chunk(data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            for i in range(3):
                frame = b'data: {"choices": [{"text": "t%d"}]}\n\n' % i
                chunk(frame[:10])  # one frame in two chunks, sent apart
                time.sleep(0.01)
                sent.append(time.perf_counter())  # the frame cannot be whole before this
                chunk(frame[10:])
            chunk(b'data: {"choices": [{"text": ""}]}\n\n')  # no text: not a token frame
            chunk(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
            self.wfile.write(b"0\r\n\r\n")
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        [ok] = stream_clients(server.server_address[1], "/v1/completions", [{"prompt": "x"}], timeout_s=30)
        [refused] = stream_clients(server.server_address[1], "/v1/nothing", [{"prompt": "x"}], timeout_s=30)
    finally:
        server.shutdown()
    assert ok["tokens"] == 3
    assert len(ok["frames"]) == 3
    assert all(frame >= at for frame, at in zip(ok["frames"], sent))
    assert ok["sent"] <= ok["frames"][0] <= ok["end"]
    assert refused["error"] == 404 and refused["body"] == "not found"


def test_the_prepared_gpu_checks_run_on_the_cpu(tiny_assets, tmp_path):
    """benchmarks/gpu_checks.py is run on a lent GPU machine in one call, with no second
    try to spare: it runs here on the CPU (the tiny model compiled with inductor's default
    mode; the speed model at a small shape), so it cannot rot between the sessions that
    get one."""
    report_path = tmp_path / "gpu_checks.json"
    env = {**os.environ, ASSET_DIR_ENV: str(asset_cache_dir())}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_checks.py"),
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--speed-shape",
            "small",
            "--speed-tokens",
            "4",
            "--rounds",
            "1",
            "--work",
            str(tmp_path / "work"),
            "--assets",
            str(asset_cache_dir()),
            "--json",
            str(report_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["environment"]["device"] == "cpu"
    checks = report["checks"]
    assert set(checks) == {"compiled_serial", "compiled_batched", "idle_release", "decode_speed"}
    exact = {k: c for k, c in checks.items() if k != "decode_speed"}
    assert all(c["ok"] and not c.get("problems") for c in exact.values()), exact
    runs = checks["compiled_serial"]["runs"]
    assert set(runs) == {"eager", "static", "compiled"}
    # the SAE attached after compilation steers every forward pass of the compiled step
    assert all(r["applied"] == r["forward_passes"] >= 8 for r in runs.values())
    assert runs["compiled"]["torch_compile"]["compiles"] > 0
    assert runs["static"]["kv_cache_mode"] == "static"
    # steering changed the tokens, and every mode generated the same ones
    assert runs["eager"]["tokens"] != runs["eager"]["plain_tokens"]
    assert len({tuple(r["tokens"]) for r in runs.values()}) == 1
    assert checks["idle_release"]["status"]["idle_releases"] >= 1
    # decode speed: every mode measured against the device's copy limit, steering counted
    # on every forward pass (the figures of a tiny model on a CPU mean nothing)
    speed = checks["decode_speed"]
    assert speed["limit_tok_s"] > 0 and speed["bandwidth"]["buffer_bytes"] > 0
    assert set(speed["modes"]) == {
        f"{c} {m}" for c in ("eager", "compiled") for m in ("sae_idle", "steer", "steer_monitor")
    }
    assert all(v["tok_s"] > 0 and v["apply_count_minus_passes"] == [0] for v in speed["modes"].values())
    # warmed up: the compiled model compiles nothing more while it is timed
    assert speed["compiled torch_compile"]["compiled_during_rounds"] == 0
