// A safetensors reader for the browser: an 8-byte little-endian header length, a JSON
// header ({name: {dtype, shape, data_offsets: [begin, end]}, __metadata__?}), then the raw
// little-endian data, offsets counted from the end of the header. Written by hand because
// the format is this small and the UI takes nothing from a CDN or a build step.
//
// Floats come back as Float64Array (the pages compute in float64, like the analyzers);
// F16 and BF16, which JS has no array for, are widened from their bits here.
// Integers come back as Float64Array too (exact below 2^53: positions and token ids).

const SIZES = { F64: 8, F32: 4, F16: 2, BF16: 2, I64: 8, U64: 8, I32: 4, U32: 4, I16: 2, U16: 2, I8: 1, U8: 1, BOOL: 1 };

// 2^-24, the value of F16's smallest subnormal step
const F16_SUB = 2 ** -24;

function f16(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exp = (bits >> 10) & 0x1f;
  const frac = bits & 0x3ff;
  if (exp === 0) return sign * frac * F16_SUB;
  if (exp === 0x1f) return frac ? NaN : sign * Infinity;
  return sign * 2 ** (exp - 15) * (1 + frac / 1024);
}

const READERS = {
  F64: (v, o) => v.getFloat64(o, true),
  F32: (v, o) => v.getFloat32(o, true),
  F16: (v, o) => f16(v.getUint16(o, true)),
  BF16: (() => {
    // bfloat16 is the top half of a float32: put its bits there and read a float32
    const scratch = new DataView(new ArrayBuffer(4));
    return (v, o) => { scratch.setUint32(0, v.getUint16(o, true) << 16); return scratch.getFloat32(0); };
  })(),
  I64: (v, o) => Number(v.getBigInt64(o, true)),
  U64: (v, o) => Number(v.getBigUint64(o, true)),
  I32: (v, o) => v.getInt32(o, true),
  U32: (v, o) => v.getUint32(o, true),
  I16: (v, o) => v.getInt16(o, true),
  U16: (v, o) => v.getUint16(o, true),
  I8: (v, o) => v.getInt8(o),
  U8: (v, o) => v.getUint8(o),
  BOOL: (v, o) => v.getUint8(o),
};

export class SafetensorsError extends Error {}

/**
 * Parse a safetensors buffer: {tensors: {name: {dtype, shape, data: Float64Array}}, metadata}.
 * `names` (optional) limits which tensors are decoded (the others are listed, data null).
 */
export function parseSafetensors(buffer, { names = null } = {}) {
  const bytes = buffer instanceof ArrayBuffer ? buffer : buffer.buffer.slice(buffer.byteOffset, buffer.byteOffset + buffer.byteLength);
  if (bytes.byteLength < 8) throw new SafetensorsError("not a safetensors file (shorter than 8 bytes)");
  const view = new DataView(bytes);
  const headerLength = Number(view.getBigUint64(0, true));
  if (8 + headerLength > bytes.byteLength) throw new SafetensorsError("header runs past the end of the file");
  let header;
  try {
    header = JSON.parse(new TextDecoder().decode(new Uint8Array(bytes, 8, headerLength)));
  } catch (err) {
    throw new SafetensorsError(`unreadable header: ${err.message}`);
  }
  const base = 8 + headerLength;
  const metadata = header.__metadata__ || {};
  const tensors = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const { dtype, shape, data_offsets: [begin, end] } = info;
    const size = SIZES[dtype];
    const read = READERS[dtype];
    if (!size || !read) throw new SafetensorsError(`${name}: unsupported dtype ${dtype}`);
    const count = shape.reduce((a, b) => a * b, 1);
    if (end - begin !== count * size || base + end > bytes.byteLength) {
      throw new SafetensorsError(`${name}: data_offsets do not match its shape ${JSON.stringify(shape)} × ${dtype}`);
    }
    let data = null;
    if (!names || names.includes(name)) {
      data = new Float64Array(count);
      const start = base + begin;
      for (let i = 0; i < count; i += 1) data[i] = read(view, start + i * size);
    }
    tensors[name] = { dtype, shape, data };
  }
  return { tensors, metadata };
}

/** The L2 norm of each row of a (rows, width) tensor, in float64. */
export function rowNorms(tensor) {
  const [rows, width] = tensor.shape;
  const out = new Float64Array(rows);
  for (let r = 0; r < rows; r += 1) {
    let sum = 0;
    const offset = r * width;
    for (let c = 0; c < width; c += 1) sum += tensor.data[offset + c] ** 2;
    out[r] = Math.sqrt(sum);
  }
  return out;
}
