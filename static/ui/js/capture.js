// What the captures page computes from a downloaded artifact (docs/capture.md): per-layer
// L2 norms of the hidden states and, for an attention capture, softmax(q·Kᵀ·scale) of one
// layer and query head — in float64, causal (a query sees the keys at or before its own
// position), with the scale the layer's attention applies (the sidecar's `scaling`).

import { rowNorms } from "./safetensors.js";

/** The hidden-state layers in the file, ascending. */
export function hiddenLayers(tensors) {
  return Object.keys(tensors).filter((n) => n.startsWith("layer."))
    .map((n) => Number(n.slice(6))).sort((a, b) => a - b);
}

/** {layers, norms: {layer: Float64Array(rows)}, mean: {layer: number}} */
export function layerNorms(tensors) {
  const layers = hiddenLayers(tensors);
  const norms = {};
  const mean = {};
  for (const layer of layers) {
    norms[layer] = rowNorms(tensors[`layer.${layer}`]);
    mean[layer] = norms[layer].reduce((a, b) => a + b, 0) / Math.max(1, norms[layer].length);
  }
  return { layers, norms, mean };
}

/** The token id at each sequence position: prompt then completion. */
export function sequenceTokens(meta) {
  return [...(meta.prompt_token_ids || []), ...(meta.completion_token_ids || [])];
}

/**
 * The KV head a query head reads (transformers' repeat_kv order) and where both sit in the
 * file: {kvHead, q, k, qName, kName}. A tensor-parallel capture (vLLM) holds one shard per
 * rank (`q.<L>.tp<rank>`, listed in `attention.shards` with their global heads); a query
 * head and the KV head it reads are always in the same rank's shard.
 */
export function headSlots(attention, head, layer) {
  const group = attention.num_heads / attention.num_kv_heads;
  const kvHead = Math.floor(head / group);
  for (const shard of attention.shards || []) {
    const q = shard.heads.indexOf(head);
    if (q < 0) continue;
    return { kvHead, q, k: shard.kv_heads.indexOf(kvHead),
             qName: `q.${layer}.tp${shard.rank}`, kName: `k.${layer}.tp${shard.rank}` };
  }
  return { kvHead, q: attention.shards ? -1 : attention.heads.indexOf(head), k: attention.kv_heads.indexOf(kvHead),
           qName: `q.${layer}`, kName: `k.${layer}` };
}

/** The scale the layer's attention applies to q·k, and whether the sidecar recorded it. */
export function layerScale(attention, layer) {
  const recorded = (attention.scaling || {})[String(layer)];
  if (recorded !== null && recorded !== undefined) return { scale: recorded, recorded: true };
  return { scale: 1 / Math.sqrt(attention.head_dim), recorded: false };
}

/**
 * The attention of one (layer, query head): {qPositions, kPositions, scale, recorded,
 * kvHead, weights: [Float64Array(kRows) per q row, NaN where the key is after the query]}.
 */
export function attentionMap(tensors, attention, layer, head) {
  const slots = headSlots(attention, head, layer);
  if (slots.q < 0 || slots.k < 0) throw new Error(`head ${head} was not captured at layer ${layer}`);
  const q = tensors[slots.qName];
  const k = tensors[slots.kName];
  if (!q || !k) throw new Error(`no Q/K captured at layer ${layer}`);
  const [qRows, qHeads, dim] = q.shape;
  const [kRows, kHeads] = k.shape;
  const qPositions = Array.from(tensors.q_positions.data);
  const kPositions = Array.from(tensors.k_positions.data);
  const { scale, recorded } = layerScale(attention, layer);
  const weights = [];
  for (let i = 0; i < qRows; i += 1) {
    const qOff = (i * qHeads + slots.q) * dim;
    const scores = new Float64Array(kRows).fill(NaN);
    let max = -Infinity;
    for (let j = 0; j < kRows; j += 1) {
      if (kPositions[j] > qPositions[i]) continue;
      const kOff = (j * kHeads + slots.k) * dim;
      let dot = 0;
      for (let d = 0; d < dim; d += 1) dot += q.data[qOff + d] * k.data[kOff + d];
      scores[j] = dot * scale;
      if (scores[j] > max) max = scores[j];
    }
    let sum = 0;
    for (let j = 0; j < kRows; j += 1) {
      if (Number.isNaN(scores[j])) continue;
      scores[j] = Math.exp(scores[j] - max);
      sum += scores[j];
    }
    for (let j = 0; j < kRows; j += 1) if (!Number.isNaN(scores[j])) scores[j] /= sum;
    weights.push(scores);
  }
  return { qPositions, kPositions, scale, recorded, kvHead: slots.kvHead, weights };
}
