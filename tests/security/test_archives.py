"""Archive bombs (issue 31, item 5): every ``.npz`` and safetensors the server reads is
checked by its declared shapes and bytes before anything is inflated.

The attacks: a probe upload of about half a megabyte whose member inflates to 256 MiB (a
highly compressible member), one whose ``.npy`` header declares 24 GiB (a header that
lies about the member), an object array; a Gemma Scope SAE file with a bomb member; a
safetensors file whose header declares more than it holds. Each is refused with the
documented code naming the member, and the memory of the process that read it stays flat
(sampled while the live server handles the upload; ``ru_maxrss`` of a fresh process for
the engine's loaders). Before the fix the upload took 256 MiB+ in the server.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests

from tests.v1.conftest import _v1_db, v1_server  # noqa: F401 - the live server fixtures

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parents[2]
BOMB_BYTES = 256 << 20  # what the bomb member inflates to
FLAT_BYTES = 64 << 20  # "flat": far below what inflating would take


def _npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _zip_member(name: str, header: bytes, zeros: int) -> bytes:
    """An .npz of one deflated member: ``header`` then ``zeros`` zero bytes, written
    streaming (the member is never whole in this process's memory)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        with zf.open(name, "w", force_zip64=True) as fh:
            fh.write(header)
            chunk = bytes(1 << 20)
            for _ in range(zeros // len(chunk)):
                fh.write(chunk)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    n = BOMB_BYTES // 8
    return {
        # honest header, honest directory: 256 MiB of float64 zeros in ~250 KB
        "compressible": _zip_member("weights.npy", _npy_header((n,)), BOMB_BYTES),
        # the header declares 3 Gi float64 values (24 GiB); the member holds 256 MiB
        "lying": _zip_member("weights.npy", _npy_header((3 << 30,)), BOMB_BYTES),
    }


class PeakRss:
    """The highest resident memory of this process (the live server runs in it) while
    the block runs, sampled every 5 ms, above what it was when the block began."""

    def __enter__(self) -> PeakRss:
        self._proc = psutil.Process()
        self.start = self._proc.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def grew(self) -> int:
        return self.peak - self.start


def _import(server, name: str, content: bytes) -> requests.Response:
    return requests.post(
        f"{server.url}/api/probes/import",
        files={"file": (name, content, "application/octet-stream")},
        data={"layer": "0"},
        timeout=120,
    )


@pytest.mark.parametrize("kind", ["compressible", "lying"])
def test_a_probe_bomb_is_refused_naming_its_member_without_inflating(v1_server, bombs, kind):
    from monitoring.models import Probe

    content = bombs[kind]
    assert len(content) < 1 << 20  # a small upload
    started = time.monotonic()
    with PeakRss() as rss:
        resp = _import(v1_server, "bomb.npz", content)
    assert resp.status_code == 400, resp.text
    assert rss.grew < FLAT_BYTES, f"the server grew by {rss.grew >> 20} MiB"
    error = resp.json()["error"]
    assert error["code"] == "PROBE_INVALID"
    assert "weights.npy" in error["message"]
    assert error["details"]["member"] == "weights.npy"
    assert time.monotonic() - started < 10
    assert not Probe.objects.exists()  # nothing was created


def test_an_object_array_is_refused_never_unpickled(v1_server):
    from monitoring.models import Probe

    buf = io.BytesIO()
    np.savez(buf, weights=np.array([1.0, 2.0]), name=np.array([{"x": 1}], dtype=object))
    resp = _import(v1_server, "objects.npz", buf.getvalue())
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "PROBE_INVALID" and error["details"]["member"] == "name.npy"
    assert "objects are never unpickled" in error["message"]
    assert not Probe.objects.exists()


def test_an_honest_npz_probe_still_imports(v1_server):
    buf = io.BytesIO()
    np.savez(buf, weights=np.array([0.5, -1.0, 2.0]), bias=np.array(0.25), name=np.array("honest"))
    resp = _import(v1_server, "honest.npz", buf.getvalue())
    assert resp.status_code == 201, resp.text
    data = resp.json()["data"]
    assert data["name"] == "honest" and data["d_in"] == 3 and data["bias"] == 0.25
    got = requests.get(f"{v1_server.url}/api/probes/honest", timeout=30).json()["data"]
    assert got["weights"] == [0.5, -1.0, 2.0]


# ------------------------------------------------------------------ the engine's loaders


def _max_rss_of(code: str) -> tuple[int, str]:
    """Peak RSS (bytes) of a fresh interpreter running ``code``, and what it printed."""
    wrapper = code + "\nimport resource, sys\nprint('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    out = subprocess.run([sys.executable, "-c", wrapper], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kib = int(out.stdout.rsplit("MAXRSS", 1)[1].split()[0])
    return kib * 1024, out.stdout


_LOAD_SAE = """
import torch  # what the engine has loaded anyway: not the bomb's
from gpu_engine.api.errors import SAEFormatError
from gpu_engine.sae.module import load_sae
try:
    load_sae({path!r})
    print('LOADED')
except SAEFormatError as exc:
    print('REFUSED', exc.message, exc.details.get('member'))
"""


def _deflated(archive: bytes) -> tuple[bytes, int, int]:
    """The first member of ``archive`` as it is stored (deflated, never inflated here):
    its bytes, CRC and inflated size."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        info = zf.infolist()[0]
    name_len, extra_len = struct.unpack("<HH", archive[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    return archive[start : start + info.compress_size], info.CRC, info.file_size


def _zip(members: list[tuple[str, int, bytes, int, int]]) -> bytes:
    """A zip written by hand (zip64 sizes everywhere), from members given as they are
    stored: (name, method, stored bytes, CRC, inflated size)."""
    out = io.BytesIO()
    central = []
    for name, method, payload, crc, usize in members:
        offset = out.tell()
        encoded = name.encode()
        z64 = struct.pack("<HHQQ", 1, 16, usize, len(payload))
        out.write(
            struct.pack(
                "<IHHHHHIIIHH", 0x04034B50, 45, 0, method, 0, 0, crc, 0xFFFFFFFF, 0xFFFFFFFF, len(encoded), len(z64)
            )
        )
        out.write(encoded + z64 + payload)
        cz64 = struct.pack("<HHQQQ", 1, 24, usize, len(payload), offset)
        central.append(
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                45,
                45,
                0,
                method,
                0,
                0,
                crc,
                0xFFFFFFFF,
                0xFFFFFFFF,
                len(encoded),
                len(cz64),
                0,
                0,
                0,
                0,
                0xFFFFFFFF,
            )
            + encoded
            + cz64
        )
    cd_offset = out.tell()
    for entry in central:
        out.write(entry)
    cd_size = out.tell() - cd_offset
    z64_end = out.tell()
    out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(central), len(central), cd_size, cd_offset))
    out.write(struct.pack("<IIQI", 0x07064B50, 0, z64_end, 1))
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    return out.getvalue()


def _gemmascope(directory: Path, bomb: bytes | None) -> Path:
    """A valid Gemma Scope params.npz (d_in 8, d_sae 16), plus ``bomb``'s member."""
    rng = np.random.default_rng(0)
    arrays = {
        "W_enc": rng.standard_normal((8, 16)).astype(np.float32),
        "W_dec": rng.standard_normal((16, 8)).astype(np.float32),
        "b_enc": np.zeros(16, np.float32),
        "b_dec": np.zeros(8, np.float32),
        "threshold": np.full(16, 0.1, np.float32),
    }
    members = []
    for key, value in arrays.items():
        raw = io.BytesIO()
        np.save(raw, value)
        members.append(
            (f"{key}.npy", zipfile.ZIP_STORED, raw.getvalue(), zlib.crc32(raw.getvalue()), len(raw.getvalue()))
        )
    if bomb is not None:
        payload, crc, size = _deflated(bomb)
        members.append(("bomb.npy", zipfile.ZIP_DEFLATED, payload, crc, size))
    path = directory / "params.npz"
    path.write_bytes(_zip(members))
    return path


def test_a_gemma_scope_sae_with_a_bomb_member_is_refused_in_flat_memory(bombs, tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    _gemmascope(good, None)
    path = _gemmascope(bad, bombs["compressible"])
    assert path.stat().st_size < 1 << 20

    base, out = _max_rss_of(_LOAD_SAE.format(path=str(good)))
    assert "LOADED" in out  # the honest file still loads
    peak, out = _max_rss_of(_LOAD_SAE.format(path=str(bad)))
    assert "REFUSED" in out and "bomb.npy" in out, out
    assert peak - base < FLAT_BYTES, f"the loader grew by {(peak - base) >> 20} MiB"


def test_a_safetensors_header_that_lies_is_refused_before_any_tensor(tmp_path):
    """A steering-vector file whose header declares a tensor larger than the file: the
    vector reader names the tensor and builds nothing."""
    from gpu_engine.api.errors import SAEFormatError
    from gpu_engine.sae.vectors import read_vectors

    header = {
        "layer.0": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 4 << 30]},
        "__metadata__": {"hook_point": "resid_post"},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "vector.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
    with pytest.raises(SAEFormatError) as caught:
        read_vectors(path)
    assert caught.value.details["member"] == "layer.0"
    assert "layer.0" in caught.value.message
