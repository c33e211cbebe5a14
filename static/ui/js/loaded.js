// The loaded models of every engine (docs/deploy.md, "Several models, several engines"):
// GET /api/models's `loaded_models` maps each engine to the model it holds;
// `loaded_model_id` is the default engine's alone.

/** Every loaded model row, the default engine's first. */
export function loadedModels(registry) {
  const ids = registry.loaded_models ? Object.values(registry.loaded_models) : [registry.loaded_model_id];
  const first = registry.loaded_model_id;
  return registry.models.filter((m) => ids.includes(m.id))
    .sort((a, b) => (b.id === first) - (a.id === first));
}

/** " — on engine gpu1" for a model on a non-default engine; "" otherwise (one engine). */
export function engineNote(m) {
  return m && m.engine && m.engine !== "default" ? ` — on engine ${m.engine}` : "";
}

/** The loaded model an SAE's attach reaches: the loaded model it was trained on (its name
 * or repository), else the default engine's. */
export function attachTarget(loaded, registry, sae) {
  const on = sae?.trained_on;
  return (on && loaded.find((m) => m.name === on || m.repo_id === on))
    || loaded.find((m) => m.id === registry.loaded_model_id) || null;
}
