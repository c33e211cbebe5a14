// What the profiles, clusters and circuits pages share: import from a file or pasted
// JSON, export to a file, the intensity dial.

import { getText, postText } from "./api.js";
import { busy, el, notice } from "./dom.js";

/** Wire an import form: <input type=file> and/or a textarea, posted verbatim. */
export function importForm(form, path, onDone) {
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const file = form.querySelector("input[type=file]")?.files?.[0];
    const pasted = form.querySelector("textarea")?.value.trim();
    busy(form.querySelector("button[type=submit]"), async () => {
      const text = file ? await file.text() : pasted;
      if (!text) { notice("Choose a file or paste a document first.", "error"); return; }
      try { JSON.parse(text); } catch { notice("That is not JSON.", "error"); return; }
      const out = await postText(path, text);
      form.reset();
      await onDone(out);
    }, "Import");
  });
}

/** Download the server's export of a document, byte for byte. */
export async function exportTo(path, filename) {
  const text = await getText(path);
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const link = el("a", { href: url, download: filename });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/**
 * An intensity dial (λ): a range and a number kept in step; `onCommit(λ)` on release or
 * Enter. `range` is the document's allowed [low, high] (default 0…2).
 */
export function dial({ id, label, value, range, onCommit }) {
  const [lo, hi] = range && range.length === 2 ? range : [0, 2];
  const slider = el("input", { type: "range", id, min: lo, max: hi, step: 0.05, value, "aria-label": label });
  const number = el("input", { type: "number", min: lo, max: hi, step: 0.05, value, "aria-label": `${label} (number)`, style: "width:5rem" });
  slider.addEventListener("input", () => { number.value = slider.value; });
  slider.addEventListener("change", () => onCommit(Number(slider.value)));
  number.addEventListener("change", () => {
    const v = Math.max(lo, Math.min(hi, Number(number.value)));
    number.value = v;
    slider.value = v;
    onCommit(v);
  });
  return el("div", { class: "dial" }, el("span", { class: "small muted" }, "λ"), slider, number,
    el("span", { class: "small muted" }, `${lo}…${hi}`));
}
