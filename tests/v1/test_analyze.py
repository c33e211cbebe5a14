"""``analyze`` and ``capture.attention`` on /v1 (official openai client),
``/api/captures/{id}/analyze``, ANALYZERS_EXTRA and ANALYZER_PROBE_DIR, end to end.

Every expected number is computed here from an independent float32 forward of a second
copy of the tiny model (``reference_blocks`` / ``reference_qk``) with the test's own numpy
formulas; no analyzer code computes an expectation.
"""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import msgspec
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.errors import AnalyzerCaptureMissing
from gpu_engine.api.protocol import EngineStatus
from tests.conftest import manage
from tests.engine.helpers import count_forwards
from tests.engine.test_capture import reference_blocks
from tests.engine.test_capture_qk import reference_qk
from tests.engine.tolerances import ANALYSIS_ATOL, ANALYSIS_RTOL
from tests.v1.helpers import assert_openai_error, request

CHAT = [{"role": "user", "content": "tell me about the fox"}]
PROMPT_IDS = [5, 17, 23, 42, 8, 11, 60, 3, 29, 14]  # a completions prompt given as token ids


@pytest.fixture(scope="module")
def hf(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    model = AutoModelForCausalLM.from_pretrained(str(asset.path), dtype=torch.float32, local_files_only=True).eval()
    return asset, model


@pytest.fixture
def probes(tmp_path, settings):
    """A probe directory of the test's own, and the analyzers built from the settings
    (as the site builds them at start) for the duration."""
    from core.runtime import runtime
    from monitoring.analysis import Analyzers

    directory = tmp_path / "probes"
    directory.mkdir()
    settings.ANALYZER_PROBE_DIR = str(directory)
    analyzers = Analyzers.from_settings()
    with runtime().replaced(analyzers=analyzers):
        yield directory
    analyzers.shutdown()


def close(got, want) -> bool:
    return np.allclose(np.asarray(got, dtype=np.float64), want, atol=ANALYSIS_ATOL, rtol=ANALYSIS_RTOL)


def sigmoid(z: float) -> float:
    return float(1.0 / (1.0 + np.exp(-z)))


def write_probe(directory, d: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    probe = {
        "best_layer": np.array(2),
        "weights": rng.normal(size=d) * 0.2,
        "bias": np.array(0.3),
        "scaler_mean": rng.normal(size=d) * 0.1,
        "scaler_scale": rng.uniform(0.5, 2.0, size=d),
        "h_node_indices": np.array([3, 17, 40]),
        "h_node_baselines": np.array([0.0, -0.5, 0.2]),
    }
    np.savez(directory / "hnode.npz", **probe)
    return probe


def test_hidden_state_reductions_and_the_hnode_probe(llama, openai_client, probes, hf):
    probe = write_probe(probes)
    analyze = [
        {"name": "hidden_states", "params": {"layers": [1, 3], "reduce": "mean", "positions": "completion"}},
        {"name": "hidden_states", "params": {"layers": [2], "reduce": "norm", "positions": "prompt"}},
        {"name": "hnode_hallucination", "params": {"probe": "hnode.npz"}},
    ]
    kw = {"model": "tiny-llama", "messages": CHAT, "max_tokens": 5, "temperature": 0}
    resp = openai_client.chat.completions.create(
        **kw, extra_body={"ignore_eos": True, "capture": {"layers": [0], "positions": "all"}, "analyze": analyze}
    )
    plain = openai_client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == plain.choices[0].message.content  # analysis changes no token
    millm = resp.model_extra["millm"]
    # the request's own capture, united with what its analyzers read
    meta = load_capture(base64.b64decode(millm["capture"]["data"])).meta
    assert meta["layers"] == [0, 1, 2, 3] and meta["positions"] == "all"
    p = len(meta["prompt_token_ids"])
    ref = reference_blocks(*hf, meta["prompt_token_ids"] + meta["completion_token_ids"][:-1])
    assert [e["name"] for e in millm["analysis"]] == ["hidden_states", "hidden_states", "hnode_hallucination"]
    means, norm, hnode = (e["result"] for e in millm["analysis"])
    assert means["reduce"] == "mean" and set(means["layers"]) == {"1", "3"}
    for layer in (1, 3):
        assert close(means["layers"][str(layer)], ref[layer][p - 1 :].mean(axis=0)), layer
    assert not close(means["layers"]["1"], ref[2][p - 1 :].mean(axis=0))  # the neighbouring layer fails
    assert close(norm["layers"]["2"], np.linalg.norm(ref[2][:p]))
    h = ref[2][-1]
    margin = float(((h - probe["scaler_mean"]) / probe["scaler_scale"]) @ probe["weights"] + 0.3)
    excess = float(np.maximum(0.0, h[[3, 17, 40]] - probe["h_node_baselines"]).mean())
    assert close(hnode["margin"], margin) and close(hnode["probability"], sigmoid(margin))
    assert close(hnode["h_node_excess"], excess)
    assert hnode["verdict"] == ("hallucinated" if sigmoid(margin) >= 0.5 else "grounded")
    assert "capture_id" not in millm["analysis"][0]  # inline: nothing stored to analyze again


def tracker_want(hf, ids: list[int], layer_heads: dict[int, list[int]], instruction, data) -> float:
    """The Attention Tracker score from the reference Q/K and the module's own scale."""
    asset, model = hf
    ref = reference_qk(asset, model, ids)
    n = len(ids)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    scores = []
    for layer, heads in layer_heads.items():
        scale = float(model.model.layers[layer].self_attn.scaling)
        for head in heads:
            q, k = ref[layer][0][n - 1, head], ref[layer][1][:, head // group]
            s = k.astype(np.float64) @ q.astype(np.float64) * scale
            a = np.exp(s - s.max())
            a /= a.sum()
            inst, dat = a[slice(*instruction)].sum(), a[slice(*data)].sum()
            scores.append(inst / (inst + dat + 1e-8))
    return float(np.mean(scores))


TRACKER = {"layer_heads": {"1": [0, 1], "3": [1]}, "instruction": [0, 4], "data": [4, -1]}


def test_attention_tracker_on_completions_and_streams(llama, probes, hf):
    want = tracker_want(hf, PROMPT_IDS, {1: [0, 1], 3: [1]}, (0, 4), (4, len(PROMPT_IDS) - 1))
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT_IDS,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "analyze": {"name": "attention_tracker", "params": TRACKER},
    }
    resp = request(llama.base_url, "POST", "/completions", body)
    assert resp.status == 200, resp.body
    millm = resp.json()["millm"]
    assert "capture" not in millm  # armed for the analyzer only: not sent
    (entry,) = millm["analysis"]
    assert entry["name"] == "attention_tracker"
    assert close(entry["result"]["score"], want)
    assert [(h["layer"], h["head"]) for h in entry["result"]["heads"]] == [(1, 0), (1, 1), (3, 1)]
    # streamed: the analysis comes in the last millm chunk, before [DONE]
    frames = request(llama.base_url, "POST", "/completions", {**body, "stream": True}).frames()
    assert frames[-1] == "[DONE]"
    last = json.loads(frames[-2])
    assert last["choices"] == [] and close(last["millm"]["analysis"][0]["result"]["score"], want)


def test_analyzers_run_on_a_llamacpp_capture(v1_server, tiny_gguf, probes, hf, settings):
    """The tiny Llama's float32 GGUF, registered and loaded through the registry, served by
    the llama.cpp backend: its capture (taken in the eval callback) feeds the same
    analyzers, whose results equal the test's own formulas on the HF reference forward."""
    from orchestration.services import model_load
    from registry.services import model_register_local

    # an f32 KV cache without flash attention: the float32 reference's arithmetic
    settings.GGUF_KV_CACHE_TYPE, settings.GGUF_FLASH_ATTENTION = "f32", False
    model_load(model=model_register_local(local_path=str(tiny_gguf), name="tiny-llama-gguf"))
    v1_server.wait_idle()
    assert v1_server.engine.status().backend == "llamacpp"
    want = tracker_want(hf, PROMPT_IDS, {1: [0, 1], 3: [1]}, (0, 4), (4, len(PROMPT_IDS) - 1))
    resp = request(
        v1_server.base_url,
        "POST",
        "/completions",
        {
            "model": "tiny-llama-gguf",
            "prompt": PROMPT_IDS,
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "capture": {"layers": [3], "positions": "all"},
            "analyze": [
                {"name": "attention_tracker", "params": TRACKER},
                {"name": "hidden_states", "params": {"layers": [2], "reduce": "norm", "positions": "prompt"}},
            ],
        },
    )
    assert resp.status == 200, resp.body
    millm = resp.json()["millm"]
    cap = load_capture(base64.b64decode(millm["capture"]["data"]))
    assert cap.meta["backend"] == "llamacpp" and cap.meta["layers"] == [2, 3]
    tracker, norm = (e["result"] for e in millm["analysis"])
    assert close(tracker["score"], want)
    ref = reference_blocks(*hf, cap.meta["prompt_token_ids"] + cap.meta["completion_token_ids"][:-1])
    assert close(norm["layers"]["2"], np.linalg.norm(ref[2][: len(PROMPT_IDS)]))
    assert close(cap.hidden[3], ref[3])  # the last layer, every row
    assert not close(norm["layers"]["2"], np.linalg.norm(ref[1][: len(PROMPT_IDS)]))  # another layer fails


def test_capture_attention_comes_back_with_the_request(llama, hf):
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {
            "model": "tiny-llama",
            "prompt": PROMPT_IDS,
            "max_tokens": 2,
            "temperature": 0,
            "capture": {
                "attention": {"layers": [2], "heads": [1], "positions": "prompt", "q_positions": "last_prompt"}
            },
        },
    )
    assert resp.status == 200, resp.body
    cap = load_capture(base64.b64decode(resp.json()["millm"]["capture"]["data"]))
    n = len(PROMPT_IDS)
    att = cap.meta["attention"]
    assert att["layers"] == [2] and att["heads"] == [1] and cap.layers == []
    assert cap.q_positions.tolist() == [n - 1] and cap.k_positions.tolist() == list(range(n))
    ref = reference_qk(*hf, PROMPT_IDS)
    group = hf[1].config.num_attention_heads // hf[1].config.num_key_value_heads
    assert close(cap.q[2][0, 0], ref[2][0][n - 1, 1])
    assert close(cap.k[2][:, 0], ref[2][1][:, 1 // group])


def refusals(llama, openai_client, probes):
    def chat(analyze, **kw):
        return openai_client.chat.completions.create(
            model="tiny-llama", messages=CHAT, max_tokens=4, extra_body={"analyze": analyze}, **kw
        )

    with pytest.raises(openai.BadRequestError) as exc:
        chat({"name": "tea_leaves"})
    assert exc.value.code == "unknown_analyzer"
    for known in (
        "attention_tracker",
        "attnlink",
        "core_reranker",
        "hidden_states",
        "hnode_hallucination",
        "science_hallucination",
    ):
        assert known in exc.value.message
    write_probe(probes)
    (probes.parent / "outside.npz").write_bytes((probes / "hnode.npz").read_bytes())
    for name in ("../outside.npz", str(probes.parent / "outside.npz"), "..", ".hnode.npz"):
        with pytest.raises(openai.BadRequestError) as exc:
            chat({"name": "hnode_hallucination", "params": {"probe": name}})
        assert exc.value.code == "invalid_parameter" and exc.value.param == "analyze.params", name
    (probes / "garbage.npz").write_bytes(b"PK\x03\x04 this is no zip archive")
    np.savez(probes / "short.npz", best_layer=np.array(2), weights=np.ones(64), bias=np.array(0.0))
    for name in ("garbage.npz", "short.npz", "missing.npz"):
        with pytest.raises(openai.BadRequestError) as exc:
            chat({"name": "hnode_hallucination", "params": {"probe": name}})
        assert exc.value.code == "invalid_probe_file", name
    with pytest.raises(openai.BadRequestError) as exc:
        chat({"name": "hidden_states", "params": {"layers": [0], "reduce": "max"}})
    assert exc.value.code == "invalid_parameter" and exc.value.param == "analyze.params"
    with pytest.raises(openai.BadRequestError) as exc:
        chat({"name": "hidden_states", "params": {"layers": [9], "reduce": "last"}})
    assert exc.value.code == "invalid_parameter" and exc.value.param == "capture.layers"
    with pytest.raises(openai.BadRequestError) as exc:
        chat({"name": "hidden_states", "params": {"layers": [0]}}, n=2)
    assert exc.value.code == "invalid_parameter" and exc.value.param == "analyze"
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {"model": "tiny-llama", "messages": CHAT, "analyze": {"params": {}}},
    )
    assert_openai_error(resp, 400, "invalid_parameter")


def test_refusals_create_nothing_and_run_no_forward(llama, openai_client, probes):
    from monitoring.models import Capture

    with count_forwards(llama.engine.backend.model) as forwards:
        refusals(llama, openai_client, probes)
    assert forwards[0] == 0
    assert not Capture.objects.exists()


@pytest.mark.parametrize("backend", ["vllm", "llamacpp"])
def test_backends_without_capture_refuse_analyzers_before_generation(backend, probes):
    """The capabilities those backends report (their own ``capabilities()``, on stand-ins
    for their loaded state) refuse an analyzer's capture in planning, naming both: vLLM
    captures hidden states (compiled, through its layers' taps) and Q/K only where every
    layer has vLLM's Attention module (the stand-in has none); llama.cpp captures hidden states, and Q/K only where the model has a rotary
    embedding (the stand-in's has none)."""
    from inference.errors import openai_error_from_exception
    from inference.planning import prepare_analyses
    from inference.protocol import ChatCompletionRequest
    from tests.fixtures.backends import require_backend

    require_backend(backend)  # skips, or fails where required, without the package
    hidden = ({"name": "hidden_states", "params": {"layers": [0]}}, "hidden_state_capture")
    tracker = ({"name": "attention_tracker", "params": TRACKER}, "attention_capture")
    if backend == "vllm":
        from gpu_engine.backends.vllm.backend import VllmBackend

        # a model whose attention vLLM's Attention module does not take (no Q/K geometry):
        # hidden states through the layers' taps, no Q/K
        caps = VllmBackend.capabilities(
            SimpleNamespace(enforce_eager=False, tool_call_format=None, worker_device="cpu")
        )
        refused, taken = (tracker,), (hidden,)
    else:
        from gpu_engine.backends.llamacpp.backend import LlamaCppBackend

        caps = LlamaCppBackend.capabilities(
            SimpleNamespace(
                opts={"embeddings": True},
                taps=SimpleNamespace(native_filter=False),
                native=SimpleNamespace(rotary=False),
                tool_call_format=None,
                steering_mode="eval_callback_per_row",
                steering_mode_reason="",
                hook_points=("resid_post", "resid_pre"),
                prefix=SimpleNamespace(enabled=False),
            )
        )
        refused, taken = (tracker,), (hidden,)
    status = EngineStatus(state="ready", backend=backend, batching={"capabilities": caps})
    for analyze, capability in refused:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "analyze": analyze})
        with pytest.raises(AnalyzerCaptureMissing) as exc:
            asyncio.run(prepare_analyses(req, status, backend))
        error = openai_error_from_exception(exc.value)
        assert (error.status, error.code, error.param) == (400, "analyzer_capture_missing", "analyze")
        assert backend in error.message and capability in error.message and analyze["name"] in error.message
    for analyze, _ in taken:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "analyze": analyze})
        assert asyncio.run(prepare_analyses(req, status, backend))
    transformers = EngineStatus(
        state="ready",
        backend="transformers",
        batching={"capabilities": msgspec.structs.replace(caps, hidden_state_capture=True, attention_capture=True)},
    )
    assert asyncio.run(prepare_analyses(req, transformers, "transformers"))  # the positive control


def test_a_stored_capture_is_analyzed_again_through_the_api(llama, openai_client, probes, settings, hf):
    settings.CAPTURE_INLINE_MAX_BYTES = 0
    resp = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "analyze": {"name": "hidden_states", "params": {"layers": [1, 2], "reduce": "last"}},
        },
    )
    (entry,) = resp.model_extra["millm"]["analysis"]
    cid = entry["capture_id"]  # stored (above the inline size): it can be analyzed again
    assert "capture" not in resp.model_extra["millm"]
    detail = request(llama.url, "GET", f"/api/captures/{cid}").json()["data"]
    meta = detail["metadata"]
    assert meta["layers"] == [1, 2] and meta["positions"] == "last"
    ids = meta["prompt_token_ids"] + meta["completion_token_ids"][:-1]
    ref = reference_blocks(*hf, ids)
    assert close(entry["result"]["layers"]["2"], ref[2][-1])
    again = request(
        llama.url,
        "POST",
        f"/api/captures/{cid}/analyze",
        {"name": "hidden_states", "params": {"layers": [1], "reduce": "norm", "positions": "last"}},
    )
    assert again.status == 200, again.body
    data = again.json()["data"]
    assert data["capture_id"] == cid and data["name"] == "hidden_states"
    assert close(data["result"]["layers"]["1"], np.linalg.norm(ref[1][-1]))
    missing = request(
        llama.url, "POST", f"/api/captures/{cid}/analyze", {"name": "attention_tracker", "params": TRACKER}
    )
    assert missing.status == 400 and missing.json()["error"]["code"] == "ANALYZER_CAPTURE_MISSING"
    assert "attention Q/K" in missing.json()["error"]["message"]
    wider = request(
        llama.url,
        "POST",
        f"/api/captures/{cid}/analyze",
        {"name": "hidden_states", "params": {"layers": [3], "reduce": "last"}},
    )
    assert wider.status == 400 and wider.json()["error"]["code"] == "ANALYZER_CAPTURE_MISSING"
    unknown = request(llama.url, "POST", f"/api/captures/{cid}/analyze", {"name": "tea_leaves"})
    assert unknown.status == 400 and unknown.json()["error"]["code"] == "UNKNOWN_ANALYZER"
    assert "hidden_states" in unknown.json()["error"]["message"]
    bad = request(
        llama.url,
        "POST",
        f"/api/captures/{cid}/analyze",
        {"name": "hidden_states", "params": {"layers": [1], "reduce": "max"}},
    )
    assert bad.status == 422 and bad.json()["error"]["code"] == "VALIDATION_ERROR"
    for other in ("0" * 32, "..%2F..%2Fmillm.sqlite3"):
        gone = request(
            llama.url, "POST", f"/api/captures/{other}/analyze", {"name": "hidden_states", "params": {"layers": [1]}}
        )
        assert gone.status in (400, 404) and b"SQLite" not in gone.body


def test_analyzers_extra_loads_a_deployments_analyzer(llama, openai_client, probes, settings, hf):
    from core.runtime import runtime
    from monitoring.analysis import Analyzers

    settings.ANALYZERS_EXTRA = ["tests.v1.extra_analyzer:register"]
    analyzers = Analyzers.from_settings()  # what the site builds at start
    with runtime().replaced(analyzers=analyzers):
        resp = openai_client.chat.completions.create(
            model="tiny-llama",
            messages=CHAT,
            max_tokens=3,
            temperature=0,
            extra_body={
                "ignore_eos": True,
                "capture": {"layers": [0], "positions": "all"},
                "analyze": [{"name": "last_row_sum", "params": {"layer": 2, "tag": "mine"}}],
            },
        )
    analyzers.shutdown()
    millm = resp.model_extra["millm"]
    meta = load_capture(base64.b64decode(millm["capture"]["data"])).meta
    ref = reference_blocks(*hf, meta["prompt_token_ids"] + meta["completion_token_ids"][:-1])
    (entry,) = millm["analysis"]
    assert entry["name"] == "last_row_sum" and entry["result"]["tag"] == "mine"
    assert close(entry["result"]["sum"], ref[2][-1].sum())
    # not in the built-in registry: the default analyzers refuse it
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.chat.completions.create(
            model="tiny-llama", messages=CHAT, max_tokens=1, extra_body={"analyze": {"name": "last_row_sum"}}
        )
    assert exc.value.code == "unknown_analyzer"


def test_a_bad_analyzers_extra_stops_start_up_with_one_line(tmp_path):
    ok = manage("check", env={"MILLM_DATA_DIR": str(tmp_path), "ANALYZERS_EXTRA": "tests.v1.extra_analyzer:register"})
    assert ok.returncode == 0, ok.stderr
    for value, words in (
        ("tests.v1.no_such_module:register", "cannot be imported"),
        ("tests.v1.extra_analyzer:nope", "cannot be imported"),
        ("tests.v1.extra_analyzer", "package.module:function"),
        ("tests.v1.extra_analyzer:register,tests.v1.extra_analyzer:register", "registered already"),
    ):
        result = manage("check", env={"MILLM_DATA_DIR": str(tmp_path), "ANALYZERS_EXTRA": value})
        assert result.returncode == 2, (value, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("miLLM configuration error: ANALYZERS_EXTRA: "), lines
        assert words in lines[0] and "Traceback" not in result.stderr
