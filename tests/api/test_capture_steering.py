"""``manage.py capture`` steers each line as /v1 would (issue 33, item 6): the rows it
captures and the text it generates equal a float32 transformers forward of the same
weights made here with the SAE's decoder row added by a hook of this test's own, and the
hash it records is the canonical text of docs/steering.md hashed here."""

from __future__ import annotations

import hashlib
import json
import struct
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

pytestmark = pytest.mark.django_db

PROMPT = "the sea and the sky"
FEATURE, STRENGTH = 3, 8.0


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def _lines(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _index(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "index.jsonl").read_text().splitlines()]


def _hash(sae_id: str, layer: int, index: int, strength: float) -> str:
    """docs/steering.md, "The steering hash", for one plain add."""
    text = f"{sae_id}\t{layer}\t{index}\t{struct.pack('>d', strength).hex()}\n"
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _decoder_row(sae_asset, index: int) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(Path(sae_asset.path) / "sae_weights.safetensors"))["W_dec"][index].astype(np.float64)


class Reference:
    """The tiny model in float32 transformers, steered (or not) by adding ``delta`` to
    decoder block ``layer``'s output at every position: the independent oracle."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(str(path))

    def _hooked(self, layer: int | None, delta: np.ndarray | None):
        torch = self.torch
        if layer is None:
            return None
        add = torch.tensor(delta, dtype=torch.float32)

        def hook(_module, _inputs, output):
            if isinstance(output, tuple):
                return (output[0] + add, *output[1:])
            return output + add

        return self.model.model.layers[layer].register_forward_hook(hook)

    def hidden(self, text: str, layer: int | None = None, delta: np.ndarray | None = None) -> list[np.ndarray]:
        """Each block's output, read by hooks registered after the steering one (so they see
        what it returns, as the next block does)."""
        handles = [self._hooked(layer, delta)]
        states: dict[int, np.ndarray] = {}
        for i, block in enumerate(self.model.model.layers):

            def read(_module, _inputs, output, i=i):
                states[i] = (output[0] if isinstance(output, tuple) else output)[0].numpy().copy()

            handles.append(block.register_forward_hook(read))
        try:
            with self.torch.inference_mode():
                self.model(self.torch.tensor([self.tok(text)["input_ids"]]))
        finally:
            for handle in handles:
                if handle is not None:
                    handle.remove()
        return [states[i] for i in range(len(states))]

    def greedy(self, text: str, n: int, layer: int | None = None, delta: np.ndarray | None = None) -> list[int]:
        handle = self._hooked(layer, delta)
        try:
            ids = self.tok(text)["input_ids"]
            with self.torch.inference_mode():
                for _ in range(n):
                    logits = self.model(self.torch.tensor([ids])).logits[0, -1]
                    ids.append(int(logits.argmax()))
        finally:
            if handle is not None:
                handle.remove()
        return ids[len(self.tok(text)["input_ids"]) :]


@pytest.fixture
def offline(settings):
    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = "cpu", "float32"
    settings.EMBEDDED = True


@pytest.fixture
def reference(tiny_assets):
    return Reference(tiny_assets.models["tiny-llama"].path)


def _check_line(out_dir: Path, row: dict, reference: Reference, *, delta: np.ndarray | None, n: int) -> None:
    """The line's rows at blocks 0 and 1 and its greedy tokens equal the reference, steered
    by ``delta`` at block 1 (None: unsteered); its apply counts are one add per forward."""
    from gpu_engine.api.artifacts import load_capture

    cap = load_capture(out_dir / row["file"])
    sidecar = json.loads((out_dir / f"{row['capture_id']}.json").read_text())
    expected = reference.hidden(PROMPT, 1 if delta is not None else None, delta)
    np.testing.assert_allclose(cap.hidden[0], expected[0], atol=1e-4)
    np.testing.assert_allclose(cap.hidden[1], expected[1], atol=1e-4)
    tokens = reference.greedy(PROMPT, n, 1 if delta is not None else None, delta)
    assert sidecar["completion_token_ids"] == tokens
    assert row["usage"]["completion_tokens"] == n
    if delta is None:
        assert row["steering_apply_count"] == [] and sidecar["steering_apply_count"] == []
        assert sidecar["steering_hash"] is None
    else:
        # a plain add at every position: once in each of the n forwards (the prefill and
        # the n - 1 decode steps that fed a generated token back)
        counts = row["steering_apply_count"]
        assert [(c["layer"], c["count"], c["modes"]) for c in counts] == [(1, n, {"add": n})]
        assert sidecar["steering_apply_count"] == counts
        assert sidecar["steering_hash"] == row["steering"]["hash"]


def test_a_steered_capture_is_the_unsteered_one_plus_the_decoder_row(
    offline, tiny_llama, llama_saes, tiny_assets, reference, tmp_path
):
    sae = llama_saes["tiny-llama-L1-relu"]
    asset = next(a for a in tiny_assets.saes_for("tiny-llama") if a.name == "tiny-llama-L1-relu")
    row_dec = _decoder_row(asset, FEATURE)
    prompts = _lines(
        tmp_path / "p.jsonl",
        {"id": "default", "prompt": PROMPT},  # the command's --steering
        {"id": "off", "prompt": PROMPT, "steering": {"features": []}},  # a line's own replaces it
        {"id": "half", "prompt": PROMPT, "steering_intensity": 0.5},  # the command's, dialled
        {"id": "clamp", "prompt": PROMPT, "steering": {"features": [{"index": 5, "mode": "clamp", "value": 0.0}]}},
    )
    out_dir = tmp_path / "caps"
    steering = json.dumps({"sae_id": sae.id, "features": [{"index": FEATURE, "strength": STRENGTH}]})
    out = _run(
        "capture", "tiny-llama", "--input", str(prompts), "--out", str(out_dir), "--layers", "0,1",
        "--positions", "prompt", "--max-tokens", "4", "--steering", steering, "--attach", f"{sae.id}@1",
    )  # fmt: skip
    assert "4 capture(s) written" in out
    rows = {r["id"]: r for r in _index(out_dir)}
    _check_line(out_dir, rows["default"], reference, delta=STRENGTH * row_dec, n=4)
    _check_line(out_dir, rows["off"], reference, delta=None, n=4)
    _check_line(out_dir, rows["half"], reference, delta=0.5 * STRENGTH * row_dec, n=4)
    assert rows["default"]["steering"]["hash"] == _hash(sae.id, 1, FEATURE, STRENGTH)
    assert rows["half"]["steering"]["hash"] == _hash(sae.id, 1, FEATURE, 0.5 * STRENGTH)
    assert rows["default"]["steering"]["mode"] == "inline" and rows["off"]["steering"]["hash"] is None
    # the clamp ran as a clamp (counted as one), not dropped
    clamp = rows["clamp"]["steering_apply_count"]
    assert [(c["layer"], c["modes"]) for c in clamp] == [(1, {"clamp": 4})]
    # the registry is untouched: nothing is recorded as attached
    from registry.models import Attachment

    assert not Attachment.objects.exists()


def test_a_profile_by_name_attaches_its_sae_and_steers_like_the_same_features_inline(
    offline, tiny_llama, llama_saes, tiny_assets, reference, tmp_path
):
    from steering.services import profile_create

    sae = llama_saes["tiny-llama-L1-relu"]
    asset = next(a for a in tiny_assets.saes_for("tiny-llama") if a.name == "tiny-llama-L1-relu")
    profile_create(name="ocean", steering={str(FEATURE): STRENGTH}, sae_id=sae.id, layer=1, model_name="tiny-llama")
    prompts = _lines(tmp_path / "p.jsonl", {"prompt": PROMPT}, {"prompt": PROMPT, "profile": "ocean"})
    out_dir = tmp_path / "caps"
    # no --attach: the profile's binding is what this command's engine holds
    _run(
        "capture", "tiny-llama", "--input", str(prompts), "--out", str(out_dir), "--layers", "0,1",
        "--positions", "prompt", "--max-tokens", "3", "--profile", "ocean",
    )  # fmt: skip
    for row in _index(out_dir):
        _check_line(out_dir, row, reference, delta=STRENGTH * _decoder_row(asset, FEATURE), n=3)
        assert row["steering"]["mode"] == "profile" and row["steering"]["profile"] == "ocean"
        assert row["steering"]["hash"] == _hash(sae.id, 1, FEATURE, STRENGTH)  # as the same features inline


def test_a_raw_vector_steers_by_its_own_direction(offline, tiny_llama, reference, tmp_path):
    from registry.models import SAE
    from registry.vectors import vector_create

    v = np.random.default_rng(7).standard_normal(tiny_llama.hidden_size).astype(np.float32)
    vector = vector_create(name="v1", model=tiny_llama, vectors={1: v}, source=SAE.VectorSource.UPLOAD)
    prompts = _lines(
        tmp_path / "p.jsonl",
        {"prompt": PROMPT, "steering": {"sae_id": vector.id, "features": [{"index": 0, "strength": 2.0}]}},
    )
    out_dir = tmp_path / "caps"
    _run(
        "capture", "tiny-llama", "--input", str(prompts), "--out", str(out_dir), "--layers", "0,1",
        "--positions", "prompt", "--max-tokens", "2", "--attach", vector.id,  # its one layer
    )  # fmt: skip
    (row,) = _index(out_dir)
    _check_line(out_dir, row, reference, delta=2.0 * v.astype(np.float64), n=2)
    assert row["steering"]["hash"] == _hash(vector.id, 1, 0, 2.0)


def _refused(args: list[str], match: str, out_dir: Path) -> None:
    with pytest.raises(CommandError, match=match):
        _run(*args)
    assert not out_dir.exists()  # nothing written, not even the folder


def test_bad_steering_stops_the_command_naming_the_line_and_the_field(
    offline, tiny_llama, llama_saes, tmp_path, monkeypatch
):
    from registry.models import SAE
    from registry.vectors import vector_create

    sae = llama_saes["tiny-llama-L1-relu"]
    other = llama_saes["tiny-llama-L3-relu"]
    out_dir = tmp_path / "never"
    good = {"prompt": PROMPT}

    def refused(line: dict, match: str, *extra: str) -> None:
        prompts = _lines(tmp_path / "p.jsonl", good, line)
        args = ["capture", "tiny-llama", "--input", str(prompts), "--out", str(out_dir), "--layers", "1"]
        _refused([*args, "--attach", f"{sae.id}@1", *extra], match, out_dir)

    feature = {"sae_id": sae.id, "features": [{"index": FEATURE, "strength": 1.0}]}
    refused({**good, "steering": {"features": [{"index": 10**6, "strength": 1}]}},
            r"line 2: steering\.features: invalid_feature_index: .*1000000")  # fmt: skip
    refused({**good, "steering": {"features": [{"index": 1, "strength": 500}]}},
            r"line 2: steering\.features\[0\]\.strength: invalid_parameter: .*200")  # fmt: skip
    refused({**good, "steering": {"features": [{"index": 1, "mode": "blend", "value": 1}]}},
            r"line 2: steering\.features\[0\]\.mode: invalid_parameter")  # fmt: skip
    refused({**good, "profile": "nope"}, r"line 2: profile: profile_not_found")
    refused({**good, "steering": {**feature, "sae_id": other.id}},
            rf"line 2: steering\.sae_id: sae_not_attached: .*{other.id}")  # fmt: skip
    refused({**good, "steering_intensity": 0.5}, r"line 2: steering_intensity: invalid_parameter")
    refused({**good, "steering_intensity": 3}, r"line 2: steering_intensity: invalid_parameter")
    refused({**good, "steering": feature, "profile": "ocean"}, r"line 2: profile: invalid_parameter: .*not both")
    refused({**good, "steerng": feature}, r"line 2: unknown key\(s\) steerng")
    # a command option's value is named with the line it reached
    refused(good, r"line 1 \(--steering\): steering\.features\[0\]\.strength", "--steering",
            json.dumps({"features": [{"index": 1, "strength": -201}]}))  # fmt: skip
    refused(good, r"--steering: not JSON", "--steering", "{")
    refused(good, r"--attach nope@1: SAE_NOT_FOUND", "--attach", "nope@1")
    # a mode the attachment cannot run: a clamp reads an activation a raw vector has none of
    vector = vector_create(
        name="v1", model=tiny_llama, vectors={1: np.ones(tiny_llama.hidden_size)}, source=SAE.VectorSource.UPLOAD
    )
    clamp = {"sae_id": vector.id, "features": [{"index": 0, "mode": "clamp", "value": 1.0}]}
    refused({**good, "steering": clamp}, r"line 2: steering\.features\.mode: invalid_parameter: .*raw steering vector",
            "--attach", vector.id)  # fmt: skip
    # a mode the loaded backend cannot run (as llama.cpp reported before its controls):
    # refused once the engine says so, before any line is sent
    from gpu_engine.api.capabilities import Capabilities
    from gpu_engine.backends.transformers.runner import TransformersRunner

    monkeypatch.setattr(TransformersRunner, "capabilities", lambda self: Capabilities(steering_controls=False))
    ablate = {"features": [{"index": 2, "mode": "ablate"}]}
    refused({**good, "steering": ablate}, r"line 2: steering\.features\.mode: invalid_parameter: .*steering_controls")
    monkeypatch.undo()
    # a refusal only the engine can make (a window past the context, known once the
    # prompt is tokenised) stops the command too, and the other lines' captures go with it
    late = {"features": [{"index": 2, "mode": "add", "value": 1.0, "window": {"start": 10**6}}]}
    refused({**good, "steering": late}, r"line 2: invalid_parameter: steering window starts at 1000000")


def test_distributed_mode_steers_with_the_engines_attachments(
    settings, engine_client, tiny_llama, llama_saes, tiny_assets, reference, tmp_path
):
    """Distributed: run_engine (here an engine client the runtime reaches) holds the model
    and the server's attachments; the command resolves against those, attaches nothing."""
    settings.EMBEDDED = False
    sae = llama_saes["tiny-llama-L1-relu"]
    asset = next(a for a in tiny_assets.saes_for("tiny-llama") if a.name == "tiny-llama-L1-relu")
    _run("load_model", "tiny-llama")
    _run("attach_sae", sae.id, "1")
    try:
        prompts = _lines(
            tmp_path / "p.jsonl",
            {"prompt": PROMPT, "steering": {"features": [{"index": FEATURE, "strength": STRENGTH}]}},
        )
        out_dir = tmp_path / "caps"
        args = ["capture", "tiny-llama", "--input", str(prompts), "--out", str(out_dir), "--layers", "0,1"]
        _run(*args, "--positions", "prompt", "--max-tokens", "3")
        (row,) = _index(out_dir)
        _check_line(out_dir, row, reference, delta=STRENGTH * _decoder_row(asset, FEATURE), n=3)
        assert row["steering"]["hash"] == _hash(sae.id, 1, FEATURE, STRENGTH)
        fresh = tmp_path / "never"
        args[args.index(str(out_dir))] = str(fresh)
        _refused([*args, "--attach", f"{sae.id}@1"], r"--attach is for embedded mode", fresh)
        other = llama_saes["tiny-llama-L3-relu"]
        _lines(
            prompts,
            {"prompt": PROMPT},
            {"prompt": PROMPT, "steering": {"sae_id": other.id, "features": [{"index": 1, "strength": 1.0}]}},
        )
        _refused(args, rf"line 2: steering\.sae_id: sae_not_attached: .*{other.id}", fresh)
    finally:
        _run("detach_sae", sae.id)
        _run("unload_model", "tiny-llama")


def test_a_refused_line_exits_non_zero_without_a_traceback(run_manage, tmp_path):
    bad = _lines(tmp_path / "p.jsonl", {"prompt": PROMPT}, {"prompt": PROMPT, "steerng": {"features": []}})
    result = run_manage(
        "capture", "tiny-llama", "--input", str(bad), "--out", str(tmp_path / "out"),
        env={"MILLM_DATA_DIR": str(tmp_path / "data")},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "CommandError: line 2: unknown key(s) steerng" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
