// The page's numbers: what /embed's answer decodes to, the API's scalar mix (service/mix.py, here in the browser
// so that a slider never waits on the server), cosines, nearest tokens, a 2-D PCA by power iteration and the
// sense separation. No DOM here: app.js draws.

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
export const LAYER_NORM_EPS = 1e-12; // service/mix.py's

// /embed's base64: little-endian float32, C order (the API's `encoding: "base64"`).
export function decodeFloat32(base64) {
  // Uint8Array.fromBase64 where the browser has it (Chromium 140 and later); else atob and a plain loop (a
  // mapping Uint8Array.from took seconds on the full-size model's 10 MB)
  let bytes;
  if (Uint8Array.fromBase64) {
    bytes = Uint8Array.fromBase64(base64);
  } else {
    const text = atob(base64);
    bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  }
  if (LITTLE_ENDIAN) return new Float32Array(bytes.buffer);
  const view = new DataView(bytes.buffer);
  return Float32Array.from({ length: bytes.length / 4 }, (_, i) => view.getFloat32(4 * i, true));
}

// /embed's .npz answer (`Accept: application/x-npz`, service/api/answers.py): a zip, stored uncompressed, of
// `embedding_<index>.npy` (each sentence's float32 layers) and `answer.json` (the answer without them). Read
// straight from the bytes: no base64 to undo, no 10 MB of JSON text to parse. {answer, arrays: name -> {shape, data}}.
export function readNpz(buffer) {
  const bytes = new Uint8Array(buffer);
  const view = new DataView(buffer);
  let end = bytes.length - 22; // the end-of-central-directory record, found from the back (no comment is written)
  while (end >= 0 && view.getUint32(end, true) !== 0x06054b50) end--;
  if (end < 0) throw new Error("the answer is not a zip (.npz)");
  const count = view.getUint16(end + 10, true);
  let at = view.getUint32(end + 16, true); // the central directory
  const members = new Map();
  for (let k = 0; k < count; k++) {
    if (view.getUint32(at, true) !== 0x02014b50) throw new Error("a broken .npz: its central directory");
    const method = view.getUint16(at + 10, true);
    const size = view.getUint32(at + 20, true);
    const nameLength = view.getUint16(at + 28, true);
    const skip = nameLength + view.getUint16(at + 30, true) + view.getUint16(at + 32, true);
    const local = view.getUint32(at + 42, true);
    const name = new TextDecoder().decode(bytes.subarray(at + 46, at + 46 + nameLength));
    if (method !== 0 || size === 0xffffffff) throw new Error(`${name} in the .npz is compressed or over 4 GB`);
    // the data follow the member's local header, whose name and extra field (zip64's) have their own lengths
    const start = local + 30 + view.getUint16(local + 26, true) + view.getUint16(local + 28, true);
    members.set(name, { start, size });
    at += 46 + skip;
  }
  const text = (m) => new TextDecoder().decode(bytes.subarray(m.start, m.start + m.size));
  const arrays = new Map();
  for (const [name, m] of members) if (name.endsWith(".npy")) arrays.set(name.slice(0, -4), readNpy(buffer, m.start, m.size));
  return { answer: JSON.parse(text(members.get("answer.json"))), arrays };
}

// One .npy (version 1 to 3) of little-endian float32 in C order: its shape and a Float32Array over its numbers (a
// view of the answer's bytes where they sit 4-byte aligned, else a copy).
function readNpy(buffer, start, size) {
  const view = new DataView(buffer, start, size);
  const major = view.getUint8(6);
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const first = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(new Uint8Array(buffer, start + first, headerLength));
  const descr = /'descr':\s*'([^']*)'/.exec(header)?.[1];
  if (descr !== "<f4" || /'fortran_order':\s*True/.test(header)) throw new Error(`a .npy of ${descr} (not <f4, C order)`);
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header)[1].split(",").filter((x) => x.trim()).map(Number);
  const offset = start + first + headerLength;
  const length = (size - first - headerLength) / 4;
  if (!LITTLE_ENDIAN) {
    const numbers = new DataView(buffer, offset, 4 * length);
    return { shape, data: Float32Array.from({ length }, (_, i) => numbers.getFloat32(4 * i, true)) };
  }
  const data = offset % 4 === 0 ? new Float32Array(buffer, offset, length) : new Float32Array(buffer.slice(offset, offset + 4 * length));
  return { shape, data };
}

// One sentence of an output "layers" answer: tokens, and its layers (num_layers, n, dim) as one Float32Array (`layers`:
// the .npz's array; else the JSON item's base64).
export function sentenceOf(item, layers = decodeFloat32(item.embedding)) {
  const [numLayers, n, dim] = item.shape;
  const sentence = { tokens: item.tokens, n, dim, numLayers, layers, stats: null };
  sentence.vector = (layer, t) => layers.subarray((layer * n + t) * dim, (layer * n + t + 1) * dim);
  return sentence;
}

// As the API: softmax(s) (the paper's mix) or s as given.
export function mixWeights(s, normalize) {
  if (normalize !== "softmax") return s.slice();
  const top = Math.max(...s);
  const e = s.map((x) => Math.exp(x - top));
  const sum = e.reduce((a, b) => a + b, 0);
  return e.map((x) => x / sum);
}

// Each layer's mean and 1/std over the sentence's tokens and dims (the API's layer_norm), in doubles, once: they do
// not depend on the weights, so a slider move reuses them.
function layerStats(sentence) {
  if (sentence.stats) return sentence.stats;
  const { n, dim, numLayers, layers } = sentence;
  const size = n * dim;
  sentence.stats = Array.from({ length: numLayers }, (_, j) => {
    const part = layers.subarray(j * size, (j + 1) * size);
    let sum = 0;
    for (let i = 0; i < size; i++) sum += part[i];
    const mean = sum / size;
    let sq = 0;
    for (let i = 0; i < size; i++) sq += (part[i] - mean) * (part[i] - mean);
    return { mean, scale: 1 / Math.sqrt(sq / size + LAYER_NORM_EPS) };
  });
  return sentence.stats;
}

// gamma * sum_j w_j h_j for every token of the sentence, computed in doubles and stored as float32 (as the API
// computes in float64 and answers float32): (n, dim) in one Float32Array.
export function mixSentence(sentence, mix) {
  const { n, dim, numLayers, layers } = sentence;
  const w = mixWeights(mix.weights, mix.normalize).map((x) => x * mix.gamma);
  const out = new Float32Array(n * dim);
  const size = n * dim;
  let shift = 0;
  const coef = w.slice();
  if (mix.layerNorm) {
    // w_j * (h - mean_j) * scale_j = (w_j * scale_j) * h - w_j * scale_j * mean_j
    const stats = layerStats(sentence);
    for (let j = 0; j < numLayers; j++) {
      coef[j] = w[j] * stats[j].scale;
      shift -= coef[j] * stats[j].mean;
    }
  }
  for (let i = 0; i < size; i++) {
    let acc = shift;
    for (let j = 0; j < numLayers; j++) acc += coef[j] * layers[j * size + i];
    out[i] = acc;
  }
  return out;
}

// Four sums side by side: V8 keeps them in registers and the loop runs about twice as fast as with one
// (the nearest tokens of the mix, 40 x 600 of these at dim 1024, are most of a slider move's arithmetic).
export function dot(a, b) {
  const n = a.length;
  const end = n - (n % 4);
  let s0 = 0;
  let s1 = 0;
  let s2 = 0;
  let s3 = 0;
  for (let i = 0; i < end; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (let i = end; i < n; i++) s0 += a[i] * b[i];
  return s0 + s1 + s2 + s3;
}

export function norm(a) {
  return Math.sqrt(dot(a, a));
}

export function cosine(a, b, na = norm(a), nb = norm(b)) {
  const d = na * nb;
  return d > 0 ? dot(a, b) / d : 0;
}

// Rows of `a` against rows of `b`: a.length x b.length cosines.
export function crossCosines(a, b) {
  const nb = b.map(norm);
  return a.map((x) => {
    const nx = norm(x);
    return Float64Array.from(b, (y, j) => cosine(x, y, nx, nb[j]));
  });
}

// The first two principal axes of `rows` and the mean they are centred on. Power iteration on the rows' centred
// Gram matrix (rows x rows: 120 x 120 for 40 occurrences in 3 layers) rather than on the dim x dim covariance: the
// same axes (axis = X^T u / |X^T u|), at the cost of one pass over the vectors. A fixed start and a sign rule make
// the same input always give the same picture.
export function pca2(rows) {
  const dim = rows[0].length;
  const m = rows.length;
  const mean = new Float64Array(dim);
  for (const r of rows) for (let i = 0; i < dim; i++) mean[i] += r[i] / m;
  const centred = rows.map((r) => Float64Array.from(r, (x, i) => x - mean[i]));
  const K = centred.map(() => new Float64Array(m));
  for (let i = 0; i < m; i++) for (let j = 0; j <= i; j++) K[i][j] = K[j][i] = dot(centred[i], centred[j]);
  const found = [];
  const axes = [];
  for (let a = 0; a < 2; a++) {
    let u = Float64Array.from({ length: m }, (_, i) => Math.sin(i + 1 + a));
    for (let iter = 0; iter < 500; iter++) {
      let next = Float64Array.from(K, (row) => dot(row, u));
      for (const f of found) {
        const p = dot(next, f);
        next = next.map((x, i) => x - p * f[i]);
      }
      const len = norm(next);
      if (len === 0) break; // fewer than a + 1 directions: this axis stays what it is
      const change = 1 - Math.abs(dot(next, u) / (len * norm(u)));
      u = next.map((x) => x / len);
      if (change < 1e-14) break;
    }
    found.push(u);
    const axis = new Float64Array(dim);
    centred.forEach((r, i) => {
      for (let k = 0; k < dim; k++) axis[k] += u[i] * r[k];
    });
    const len = norm(axis) || 1;
    let big = 0;
    for (let i = 1; i < dim; i++) if (Math.abs(axis[i]) > Math.abs(axis[big])) big = i;
    const sign = axis[big] < 0 ? -1 : 1;
    axes.push(axis.map((x) => (sign * x) / len));
  }
  const atMean = axes.map((u) => dot(u, mean));
  return {
    mean,
    axes,
    atMean,
    sums: axes.map((u) => u.reduce((x, y) => x + y, 0)),
    project: (r) => axes.map((u, k) => dot(u, r) - atMean[k]),
  };
}

// A mix's point on the layers' PCA without the mix: projection is linear, so it is sum_j c_j P_j + b * sum(axis)
// - axis . mean, with P_j the layer's point plus axis . mean (points[j]: the layers' projected points).
export function projectMix(pca, layerPoints, c) {
  return pca.axes.map((_, k) => {
    let s = c.shift * pca.sums[k] - pca.atMean[k];
    for (let j = 0; j < c.coef.length; j++) s += c.coef[j] * (layerPoints[j][k] + pca.atMean[k]);
    return s;
  });
}

// Mean cosine within groups (A with A, B with B) minus mean cosine between A and B; null without pairs of both.
export function separation(matrix, groups) {
  let within = 0;
  let nWithin = 0;
  let between = 0;
  let nBetween = 0;
  for (let i = 0; i < groups.length; i++) {
    for (let j = 0; j < i; j++) {
      if (!groups[i] || !groups[j]) continue;
      if (groups[i] === groups[j]) {
        within += matrix[i][j];
        nWithin++;
      } else {
        between += matrix[i][j];
        nBetween++;
      }
    }
  }
  if (!nWithin || !nBetween) return null;
  return { within: within / nWithin, between: between / nBetween, value: within / nWithin - between / nBetween };
}

// ---- the mix's cosines from the layers' dot products
// A token's mix is m = sum_j c_j h_j + b: c_j = gamma * w_j (divided by the layer's std with layer_norm) and b a
// number added to every dim (-sum_j c_j mean_j with layer_norm, else 0); c and b are the sentence's. So
//   <m_x, m_y> = sum_jk c_j(x) c_k(y) <h_jx, h_ky> + b(y) sum_j c_j(x) S_jx + b(x) sum_k c_k(y) S_ky + dim b(x) b(y)
// with S_jx the sum of h_jx's entries. The dot products <h_jx, h_ky> do not depend on the mix: computed once per
// word (occurrences x all tokens), a slider move costs L*L multiplications per pair instead of a dot product of
// `dim` (at dim 1024, 40 occurrences and 600 tokens: 0.2 M instead of 25 M).

// c and b of a sentence for `mix`.
export function mixCoefficients(sentence, mix) {
  const w = mixWeights(mix.weights, mix.normalize).map((x) => x * mix.gamma);
  if (!mix.layerNorm) return { coef: w, shift: 0 };
  const stats = layerStats(sentence);
  const coef = w.map((x, j) => x * stats[j].scale);
  return { coef, shift: -coef.reduce((acc, c, j) => acc + c * stats[j].mean, 0) };
}

// The L x L dot products <h_j(q), h_k(x)> of two tokens' layers into out[at ..], row j, column k: one pass over
// the dims for all of them (L = 3: each number read once for 9 products, in 9 sums V8 keeps in registers; nine
// separate dot products read each 3 times and were most of an Embed's time on the page at dim 1024).
// A token: its sentence's layers (num_layers, n, dim) array `a`, its layer 0 vector's offset `o`, and the stride
// between its layers `st` (n * dim).
function gramOf(qa, qo, qst, xa, xo, xst, dim, L, out, at) {
  if (L !== 3) {
    for (let j = 0; j < L; j++) {
      for (let k = 0; k < L; k++) {
        let sum = 0;
        for (let i = 0, q = qo + j * qst, x = xo + k * xst; i < dim; i++) sum += qa[q + i] * xa[x + i];
        out[at + j * L + k] = sum;
      }
    }
    return;
  }
  const q1 = qo + qst;
  const q2 = qo + 2 * qst;
  const x1 = xo + xst;
  const x2 = xo + 2 * xst;
  let s00 = 0;
  let s01 = 0;
  let s02 = 0;
  let s10 = 0;
  let s11 = 0;
  let s12 = 0;
  let s20 = 0;
  let s21 = 0;
  let s22 = 0;
  for (let i = 0; i < dim; i++) {
    const a0 = qa[qo + i];
    const a1 = qa[q1 + i];
    const a2 = qa[q2 + i];
    const b0 = xa[xo + i];
    const b1 = xa[x1 + i];
    const b2 = xa[x2 + i];
    s00 += a0 * b0;
    s01 += a0 * b1;
    s02 += a0 * b2;
    s10 += a1 * b0;
    s11 += a1 * b1;
    s12 += a1 * b2;
    s20 += a2 * b0;
    s21 += a2 * b1;
    s22 += a2 * b2;
  }
  out[at] = s00;
  out[at + 1] = s01;
  out[at + 2] = s02;
  out[at + 3] = s10;
  out[at + 4] = s11;
  out[at + 5] = s12;
  out[at + 6] = s20;
  out[at + 7] = s21;
  out[at + 8] = s22;
}

// tokens: [{sentence, t}]; queries: the places among them of the tokens asked about (the word's occurrences).
// Flat Float64Arrays, LL = L * L numbers per entry: `pairs` (queries x tokens) the L x L dot products of a query
// and a token, `own` each token's with itself, `sums` (tokens x L) the sum of each of its layers' entries.
export function layerGram(queries, tokens) {
  const { numLayers: L, dim } = tokens[0].sentence;
  const LL = L * L;
  const at = (x) => [x.sentence.layers, x.t * dim, x.sentence.n * dim];
  const own = new Float64Array(tokens.length * LL);
  const sums = new Float64Array(tokens.length * L);
  tokens.forEach((x, i) => {
    const [a, o, st] = at(x);
    gramOf(a, o, st, a, o, st, dim, L, own, i * LL);
    for (let j = 0; j < L; j++) {
      let sum = 0;
      for (let d = o + j * st, e = d + dim; d < e; d++) sum += a[d];
      sums[i * L + j] = sum;
    }
  });
  // token by token on the outside: its L vectors stay in the cache while every query (40 x 3 x 4 KB at dim 1024)
  // passes by them
  const Q = queries.length;
  const pairs = new Float64Array(Q * tokens.length * LL);
  const qs = queries.map((p) => at(tokens[p]));
  tokens.forEach((x, i) => {
    const [a, o, st] = at(x);
    for (let q = 0; q < Q; q++) gramOf(qs[q][0], qs[q][1], qs[q][2], a, o, st, dim, L, pairs, (q * tokens.length + i) * LL);
  });
  return { L, dim, queries, tokens: tokens.length, pairs, own, sums };
}

// <m_x, m_y> of two tokens' mixes from their layers' dot products g[at ..] (above), c and b of their sentences,
// and their layer sums sx[ax ..], sy[ay ..].
function mixDot(g, at, cx, cy, sx, ax, sy, ay, L, dim) {
  let s = 0;
  for (let j = 0; j < L; j++) {
    let inner = 0;
    for (let k = 0; k < L; k++) inner += g[at + j * L + k] * cy.coef[k];
    s += cx.coef[j] * inner;
  }
  let px = 0;
  let py = 0;
  for (let j = 0; j < L; j++) {
    px += cx.coef[j] * sx[ax + j];
    py += cy.coef[j] * sy[ay + j];
  }
  return s + cy.shift * px + cx.shift * py + dim * cx.shift * cy.shift;
}

// The cosines of the queries' mixes with every token's mix: queries x tokens; and the queries' mixed vectors'
// norms. coefs[i]: the mixCoefficients of token i's sentence.
export function mixCosines(gram, coefs) {
  const { L, dim, queries, tokens, pairs, own, sums } = gram;
  const LL = L * L;
  const norms = new Float64Array(tokens);
  for (let i = 0; i < tokens; i++) norms[i] = Math.sqrt(Math.max(0, mixDot(own, i * LL, coefs[i], coefs[i], sums, i * L, sums, i * L, L, dim)));
  const rows = queries.map((p, q) => {
    const row = new Float64Array(tokens);
    for (let i = 0; i < tokens; i++) {
      const d = norms[p] * norms[i];
      row[i] = d > 0 ? mixDot(pairs, (q * tokens + i) * LL, coefs[p], coefs[i], sums, p * L, sums, i * L, L, dim) / d : 0;
    }
    return row;
  });
  return { rows, queryNorms: queries.map((p) => norms[p]) };
}

// One layer's cosines, queries x tokens, from the same dot products (the diagonal blocks).
export function layerCosines(gram, layer) {
  const { L, queries, tokens, pairs, own } = gram;
  const LL = L * L;
  const jj = layer * L + layer;
  const norms = Float64Array.from({ length: tokens }, (_, i) => Math.sqrt(own[i * LL + jj]));
  return queries.map((p, q) => {
    const row = new Float64Array(tokens);
    for (let i = 0; i < tokens; i++) {
      const d = norms[p] * norms[i];
      row[i] = d > 0 ? pairs[(q * tokens + i) * LL + jj] / d : 0;
    }
    return row;
  });
}

// The k largest of each row, leaving out one column per row (the query itself): [{index, value}] best first.
export function topK(rows, skips, k) {
  return rows.map((row, r) => {
    const best = [];
    for (let c = 0; c < row.length; c++) {
      if (c === skips[r]) continue;
      const value = row[c];
      if (best.length < k || value > best[best.length - 1].value) {
        best.push({ index: c, value });
        best.sort((x, y) => y.value - x.value);
        if (best.length > k) best.pop();
      }
    }
    return best;
  });
}
