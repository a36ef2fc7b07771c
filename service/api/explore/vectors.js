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

// One sentence of an output "layers" answer: tokens, and its layers (num_layers, n, dim) as one Float32Array.
export function sentenceOf(item) {
  const [numLayers, n, dim] = item.shape;
  const layers = decodeFloat32(item.embedding);
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

// tokens: [{sentence, t}]. For each query and each token, the L x L dot products of their layers; each token's own
// L x L, and each token's layer sums.
export function layerGram(queries, tokens) {
  const L = tokens[0].sentence.numLayers;
  const vec = (x, j) => x.sentence.vector(j, x.t);
  const sums = (x) => Float64Array.from({ length: L }, (_, j) => vec(x, j).reduce((a, b) => a + b, 0));
  const own = (x) => Float64Array.from({ length: L * L }, (_, jk) => dot(vec(x, Math.floor(jk / L)), vec(x, jk % L)));
  const pairs = queries.map((q) =>
    tokens.map((x) => {
      const g = new Float64Array(L * L);
      for (let j = 0; j < L; j++) for (let k = 0; k < L; k++) g[j * L + k] = dot(vec(q, j), vec(x, k));
      return g;
    }),
  );
  return { L, pairs, tokenSums: tokens.map(sums), tokenOwn: tokens.map(own), querySums: queries.map(sums), queryOwn: queries.map(own) };
}

function mixDot(g, cx, cy, sx, sy, L, dim) {
  let s = 0;
  for (let j = 0; j < L; j++) {
    let inner = 0;
    for (let k = 0; k < L; k++) inner += g[j * L + k] * cy.coef[k];
    s += cx.coef[j] * inner;
  }
  let ax = 0;
  let ay = 0;
  for (let j = 0; j < L; j++) {
    ax += cx.coef[j] * sx[j];
    ay += cy.coef[j] * sy[j];
  }
  return s + cy.shift * ax + cx.shift * ay + dim * cx.shift * cy.shift;
}

// The cosines of the queries' mixes with every token's mix: queries x tokens. coefOf(x): the mixCoefficients of
// x's sentence.
// Also the queries' mixed vectors' norms.
export function mixCosines(gram, queries, tokens, coefOf, dim) {
  const { L } = gram;
  const tokenCoef = tokens.map(coefOf);
  const tokenNorm = tokens.map((x, i) => Math.sqrt(Math.max(0, mixDot(gram.tokenOwn[i], tokenCoef[i], tokenCoef[i], gram.tokenSums[i], gram.tokenSums[i], L, dim))));
  const queryNorms = [];
  const rows = queries.map((q, a) => {
    const cq = coefOf(q);
    const nq = Math.sqrt(Math.max(0, mixDot(gram.queryOwn[a], cq, cq, gram.querySums[a], gram.querySums[a], L, dim)));
    queryNorms.push(nq);
    return Float64Array.from(tokens, (x, i) => {
      const d = nq * tokenNorm[i];
      return d > 0 ? mixDot(gram.pairs[a][i], cq, tokenCoef[i], gram.querySums[a], gram.tokenSums[i], L, dim) / d : 0;
    });
  });
  return { rows, queryNorms };
}

// One layer's cosines, queries x tokens, from the same dot products (the diagonal blocks).
export function layerCosines(gram, layer) {
  const jj = layer * gram.L + layer;
  const tokenNorm = gram.tokenOwn.map((g) => Math.sqrt(g[jj]));
  return gram.pairs.map((row, a) => {
    const nq = Math.sqrt(gram.queryOwn[a][jj]);
    return Float64Array.from(row, (g, i) => (nq * tokenNorm[i] > 0 ? g[jj] / (nq * tokenNorm[i]) : 0));
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
