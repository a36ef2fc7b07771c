// The /explore page: one POST /embed (output "layers", base64) per Embed press; every view after that is computed
// here from the layers (vectors.js), so moving a slider never waits on the server. The state lives in the URL's
// fragment (a link reproduces the view); the API key in this tab's sessionStorage only. URLs are relative to the
// page, so the page works under a root path too.
import * as V from "./vectors.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "elmo-explore-key";
const NPZ = "application/x-npz";
const NEAREST_K = 4;
const SENTENCE_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
const GROUP_COLOURS = { A: "#1f5fbf", B: "#d9480f", "": "#999999" };

// Homonyms in both senses (four sentences each: group A, then group B), as the tests' sense probes have them.
const EXAMPLES = {
  bank: [
    "She walked along the bank of the river to watch the boats drift slowly downstream .",
    "The children sat on the grassy bank and dipped their feet into the cold stream .",
    "Fishermen lined the muddy bank of the lake early every morning in the summer .",
    "The flood washed away part of the bank where the old willow tree once stood .",
    "He went to the bank to deposit his wages before it closed for the weekend .",
    "The bank raised its interest rates again , and many loans became more expensive .",
    "She opened a savings account at the bank near her office last month .",
    "The central bank said that inflation would stay high for the rest of the year .",
  ],
  plant: [
    "Water the plant on the windowsill twice a week and keep it out of the frost .",
    "This plant grows tall flowers that attract bees and butterflies in late spring .",
    "The gardener moved the young plant into a larger pot full of fresh soil .",
    "Every plant in the greenhouse needs sunlight , water and a little patience .",
    "The car plant outside the city employs three thousand workers on two shifts .",
    "A new power plant will supply electricity to the whole region next year .",
    "Workers at the chemical plant went on strike over pay and safety rules .",
    "The company closed its steel plant and moved production to another country .",
  ],
  bat: [
    "A bat flew out of the cave at dusk to hunt insects over the quiet pond .",
    "The bat hung upside down from the beam and wrapped its wings around its body .",
    "Each bat uses echoes of its own calls to find moths in the dark night .",
    "We saw a small brown bat fluttering around the street lamp after sunset .",
    "He swung the bat hard and sent the ball over the fence for a home run .",
    "The player picked up his bat and walked slowly to the plate to face the pitcher .",
    "She bought a new cricket bat made of willow for the summer season .",
    "The coach told him to choke up on the bat and keep his eye on the ball .",
  ],
  spring: [
    "In spring the trees in the park turn green and the birds begin to sing again .",
    "We plant tomatoes every spring once the last frost of the winter has passed .",
    "The spring rains filled the rivers and flooded the low fields near the village .",
    "Cherry blossoms open early in the spring and draw crowds to the old gardens .",
    "The old mattress had a broken spring that poked through the thin cover .",
    "A steel spring inside the pen pushes the tip back when you click the button .",
    "The mechanic replaced the worn spring in the door so that it closes by itself .",
    "Press the lever down until the spring clicks and the latch holds the lid shut .",
  ],
};

const state = {
  models: [], // /v1/models' data
  data: null, // the last answer: {model, numLayers, dim, sentences, texts}
  word: "",
  groups: [], // per sentence: "A", "B" or ""
  weights: [0, 0, 0],
  gamma: 1,
  normalize: "softmax",
  layerNorm: false,
  colourBy: "sentence",
  heat: { a: 0, b: 1, view: "mix" },
  mixed: null, // per sentence: the mix of every token (Float32Array n * dim)
  occurrences: [], // [{s, t}] of the word
  fixed: null, // what depends on the word alone: per-layer matrices, neighbours, the PCA
};
const timings = { embedToRender: null, lastRedraw: null };

// ---- the server

function headers() {
  const key = sessionStorage.getItem(KEY_STORE);
  const h = { "content-type": "application/json" };
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

async function call(path, body, accept) {
  const response = await ask(path, body, accept);
  return response.json();
}

// The server's answer to `path` (GET, or POST of `body`), `accept`ing what the caller reads; an error in words
// (explain) unless it is a success.
async function ask(path, body, accept) {
  let response;
  const h = headers();
  if (accept) h.accept = accept;
  try {
    response = await fetch(path, body === undefined ? { headers: h } : { method: "POST", headers: h, body: JSON.stringify(body) });
  } catch (error) {
    throw new Error(`The server could not be reached (${error.message}). Is elmo-serve still running at ${location.host}?`);
  }
  if (response.ok) return response;
  let detail = "";
  try {
    const answer = await response.json();
    detail = answer.detail ?? answer.error?.message ?? "";
    if (typeof detail !== "string") detail = JSON.stringify(detail);
  } catch {
    detail = response.statusText;
  }
  throw new Error(explain(response.status, detail, response.headers.get("retry-after")));
}

// An error answer in words: what happened and what to do; the server's own message kept whole.
export function explain(status, detail, retryAfter) {
  switch (status) {
    case 401:
      return `The server needs an API key (401: ${detail}). Enter one in "API key" above and press Embed again; it stays in this tab only.`;
    case 413:
      return `Too much for this server's limits (413: ${detail}). Shorten or remove sentences and press Embed again.`;
    case 422:
      return `The server refused the request (422: ${detail}).`;
    case 404:
      return `Not found (404: ${detail}). Choose another model.`;
    case 503:
      return `The server is busy or starting (503: ${detail}). Press Embed again ${retryIn(retryAfter)}: what you typed stays here.`;
    default:
      return `The server answered ${status}: ${detail}`;
  }
}

// A 503's Retry-After in words: seconds (what elmo-serve sends) or an HTTP date (a proxy's).
export function retryIn(value) {
  const text = (value || "").trim();
  let seconds = /^\d+$/.test(text) ? Number(text) : Math.ceil((Date.parse(text) - Date.now()) / 1000);
  if (!Number.isFinite(seconds)) return "in a few seconds";
  seconds = Math.max(0, seconds);
  if (seconds === 0) return "now";
  if (seconds < 90) return `in ${seconds} second${seconds === 1 ? "" : "s"}`;
  const minutes = Math.round(seconds / 60);
  return `in about ${minutes} minute${minutes === 1 ? "" : "s"}`;
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

async function loadModels() {
  try {
    const answer = await call("v1/models");
    state.models = answer.data;
    const select = $("model");
    const wanted = select.dataset.wanted || select.value;
    select.replaceChildren(
      ...answer.data.map((m) => new Option(`${m.id} (dim ${m.dim}, ${m.num_layers} layers)`, m.id)),
    );
    if (answer.data.some((m) => m.id === wanted)) select.value = wanted;
    showError("");
    return true;
  } catch (error) {
    showError(error.message);
    return false;
  }
}

function sentencesTyped() {
  return $("sentences")
    .value.split("\n")
    .map((line) => line.trim())
    .filter((line) => line);
}

async function embed() {
  const texts = sentencesTyped();
  if (!texts.length) {
    showError("Type a sentence first (one a line), or choose an example.");
    return;
  }
  if (!state.models.length && !(await loadModels())) return;
  const started = performance.now();
  const button = $("embed");
  button.disabled = true;
  $("status").textContent = "Embedding…";
  try {
    const model = $("model").value || undefined;
    // Every layer of every token, as an .npz (service/api/answers.py): its float32 bytes read where they lie, where
    // base64 in JSON took the page a parse of 1.3 times the bytes as text and a decode (about 60 ms more at dim 1024
    // with 40 sentences, and the server its base64 encoding).
    const laps = {};
    let mark = started;
    const lap = (name) => {
      const now = performance.now();
      laps[name] = now - mark;
      mark = now;
    };
    const response = await ask("embed", { model, sentences: texts, output: "layers", encoding: "base64" }, NPZ);
    lap("answer's first byte");
    const body = await response.arrayBuffer();
    lap("body received");
    let answer;
    let sentences;
    if ((response.headers.get("content-type") || "").startsWith(NPZ)) {
      const npz = V.readNpz(body);
      answer = npz.answer;
      sentences = answer.data.map((item) => V.sentenceOf(item, npz.arrays.get(`embedding_${item.index}`).data));
    } else {
      // a server (or a proxy between) that answers JSON whatever is asked: the layers in base64
      answer = JSON.parse(new TextDecoder().decode(body));
      sentences = answer.data.map((item) => V.sentenceOf(item));
    }
    lap("parsed");
    state.drawn = (state.drawn || 0) + 1;
    state.fixed = null; // the last word's numbers are of the last answer: nothing is drawn from them again
    state.data = { model: answer.model, numLayers: answer.num_layers, dim: answer.dim, sentences, texts };
    if (state.groups.length !== texts.length) state.groups = texts.map((_, i) => state.groups[i] || "");
    if (state.weights.length !== answer.num_layers) state.weights = new Array(answer.num_layers).fill(0);
    state.heat.a = Math.min(state.heat.a, texts.length - 1);
    state.heat.b = Math.min(state.heat.b, texts.length - 1);
    showError("");
    buildSliders();
    drawTokens();
    const tokens = sentences.flatMap((s) => s.tokens);
    if (!tokens.includes(state.word)) state.word = guessWord(sentences);
    remix();
    lap("controls drawn");
    pickWord(state.word, lap);
    void document.body.offsetHeight; // laid out: the views are on screen at the next paint
    lap("views laid out");
    timings.embedParts = laps;
    timings.embedToRender = performance.now() - started;
    $("status").textContent = `${sentences.length} sentences, ${answer.usage.tokens} tokens, dim ${answer.dim}: drawn in ${Math.round(timings.embedToRender)} ms.`;
  } catch (error) {
    showError(error.message);
    $("status").textContent = "";
  } finally {
    button.disabled = false;
  }
}

// The word to start with: the most frequent token of three letters or more that is in most sentences.
function guessWord(sentences) {
  const counts = new Map();
  for (const s of sentences) for (const t of new Set(s.tokens)) if (/^\p{L}{3,}$/u.test(t)) counts.set(t, (counts.get(t) || 0) + 1);
  let best = sentences[0].tokens[0];
  let most = 0;
  for (const [t, c] of counts) if (c > most && !STOP.has(t.toLowerCase())) [best, most] = [t, c];
  return best;
}
const STOP = new Set(["the", "and", "its", "his", "her", "for", "was", "are", "that", "with", "this", "from", "into", "out", "over", "all", "had", "has", "every", "once", "new", "old"]);

// ---- state in the fragment

function saveState() {
  const p = new URLSearchParams();
  p.set("s", $("sentences").value);
  if ($("model").value) p.set("model", $("model").value);
  p.set("word", state.word);
  p.set("weights", state.weights.join(","));
  p.set("gamma", String(state.gamma));
  p.set("normalize", state.normalize);
  p.set("layer_norm", state.layerNorm ? "1" : "0");
  p.set("groups", state.groups.map((g) => g || "-").join(""));
  p.set("colour", state.colourBy);
  p.set("heat", `${state.heat.a},${state.heat.b},${state.heat.view}`);
  history.replaceState(null, "", `#${p.toString()}`);
}

const WEIGHT_RANGE = [-5, 5]; // the weight sliders'
const gammaRange = () => [Number($("gamma").min), Number($("gamma").max)];
const within = (x, [low, high]) => Math.min(high, Math.max(low, x));

function loadState() {
  const p = new URLSearchParams(location.hash.slice(1));
  if (!p.has("s")) return false;
  $("sentences").value = p.get("s");
  $("model").dataset.wanted = p.get("model") || "";
  state.word = p.get("word") || "";
  // A link's numbers within its sliders' ranges: the page draws what its controls can show and set (gamma=1e308
  // drew NaN, and a weight of 1e308 made the softmax NaN)
  const weights = (p.get("weights") || "").split(",").map(Number);
  if (weights.length && weights.every(Number.isFinite)) state.weights = weights.map((w) => within(w, WEIGHT_RANGE));
  const gamma = Number(p.get("gamma"));
  if (p.has("gamma") && Number.isFinite(gamma)) state.gamma = within(gamma, gammaRange());
  state.normalize = p.get("normalize") === "none" ? "none" : "softmax";
  state.layerNorm = p.get("layer_norm") === "1";
  state.groups = [...(p.get("groups") || "")].map((g) => (g === "A" || g === "B" ? g : ""));
  state.colourBy = p.get("colour") === "group" ? "group" : "sentence";
  const [a, b, view] = (p.get("heat") || "0,1,mix").split(",");
  state.heat = { a: Number(a) || 0, b: Number(b) || 0, view: view === "mix" ? "mix" : Number(view) || 0 };
  return true;
}

// ---- the controls

function buildSliders() {
  const box = $("weights");
  box.replaceChildren();
  state.weights.forEach((value, j) => {
    const id = `weight-${j}`;
    const row = el("div", { class: "slider" });
    const label = el("label", { for: id }, `s${j} (layer ${j})`);
    const [min, max] = WEIGHT_RANGE.map(String);
    const input = el("input", { id, type: "range", min, max, step: "0.1", value: String(value) });
    const out = el("output", { for: id, id: `${id}-out` });
    input.addEventListener("input", () => {
      state.weights[j] = Number(input.value);
      remix();
    });
    input.addEventListener("change", settled);
    row.append(label, input, out);
    box.append(row);
  });
  $("gamma").value = String(state.gamma);
  $("normalize").value = state.normalize;
  $("layer-norm").checked = state.layerNorm;
  $("colour-by").value = state.colourBy;
}

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawTokens() {
  const list = $("tokens");
  list.replaceChildren();
  state.data.sentences.forEach((s, i) => {
    const item = el("li");
    const group = el("select", { "aria-label": `group of sentence ${i + 1}`, class: "group" });
    for (const [value, text] of [["", "–"], ["A", "A"], ["B", "B"]]) group.append(new Option(text, value));
    group.value = state.groups[i];
    group.addEventListener("change", () => {
      state.groups[i] = group.value;
      redrawWord();
    });
    item.append(el("span", { class: "number" }, `${i + 1}`), group);
    s.tokens.forEach((t) => {
      const b = el("button", { type: "button", class: "token" }, t);
      b.dataset.token = t;
      b.addEventListener("click", () => pickWord(t));
      item.append(b);
    });
    list.append(item);
  });
  const options = state.data.sentences.map((s, i) => new Option(`${i + 1}: ${s.tokens.slice(0, 6).join(" ")}…`, String(i)));
  $("heat-a").replaceChildren(...options.map((o) => o.cloneNode(true)));
  $("heat-b").replaceChildren(...options);
  $("heat-a").value = String(state.heat.a);
  $("heat-b").value = String(state.heat.b);
  $("heat-view").value = String(state.heat.view);
  for (const id of ["tokens-section", "mix-section", "views", "heatmap-section", "copy-section"]) $(id).hidden = false;
}

// ---- computing

const VIEWS = () => [...Array(state.data.numLayers).keys(), "mix"];
const viewName = (v) => (v === "mix" ? "mix" : `layer ${v}`);
const tokenVector = (v, s, t) => (v === "mix" ? mixedOf(s).subarray(t * state.data.dim, (t + 1) * state.data.dim) : state.data.sentences[s].vector(v, t));
// A sentence's mixed vectors, computed when first needed after a slider move (the views of the mix need none but
// the heatmap's two sentences: vectors.js computes their cosines, points and norms from the layers).
const mixedOf = (s) => (state.mixed[s] ??= V.mixSentence(state.data.sentences[s], mixOptions()));
const mixOptions = () => ({ weights: state.weights, gamma: state.gamma, normalize: state.normalize, layerNorm: state.layerNorm });

// Every token's mix, from the layers: what the API's output "mix" answers for these settings.
function remix() {
  const started = performance.now();
  state.mixed = new Array(state.data.sentences.length).fill(null);
  const w = V.mixWeights(state.weights, state.normalize);
  state.weights.forEach((value, j) => {
    const out = $(`weight-${j}-out`);
    if (out) out.textContent = `${value.toFixed(1)} → weight ${(w[j] * state.gamma).toFixed(3)}`;
  });
  $("gamma-out").textContent = state.gamma.toFixed(2);
  if (state.fixed) drawMixViews();
  timings.lastRedraw = performance.now() - started;
}

// What a slider's `change` (its release, or a key press) adds to the redraw of its `input`s: the copyable request
// and the fragment (history.replaceState at every step of a drag would cost more than the drawing).
function settled() {
  drawCopy();
  saveState();
}

// lap(name): a stage of the drawing done (Embed's clock).
function pickWord(word, lap = () => {}) {
  state.word = word;
  const occ = [];
  state.data.sentences.forEach((s, i) => s.tokens.forEach((t, j) => t === word && occ.push({ s: i, t: j })));
  state.occurrences = occ;
  for (const b of document.querySelectorAll("button.token")) b.setAttribute("aria-pressed", String(b.dataset.token === word));
  // what the sliders do not change: each layer's matrix and neighbours, and the PCA over all layers' vectors
  // (each layer's cosines are the diagonal blocks of the layers' dot products that the mix's views need anyway)
  const layers = [...Array(state.data.numLayers).keys()];
  const rows = layers.flatMap((l) => occ.map((o) => tokenVector(l, o.s, o.t)));
  const fixed = mixGram(occ);
  lap("the layers' dot products");
  const cosines = layers.map((l) => V.layerCosines(fixed.gram, l));
  fixed.matrices = cosines.map((c) => c.map((row) => Float64Array.from(fixed.places, (p) => row[p])));
  fixed.nearest = cosines.map((c) => nearestOf(c, fixed));
  fixed.pca = V.pca2(rows);
  fixed.points = layers.map((l) => occ.map((o) => fixed.pca.project(tokenVector(l, o.s, o.t))));
  state.fixed = fixed;
  lap("cosines, neighbours, PCA");
  $("word-title").textContent = `“${word}”: ${occ.length} occurrence${occ.length === 1 ? "" : "s"} in ${new Set(occ.map((o) => o.s)).size} sentences`;
  drawLayerMatrices();
  drawMixViews();
  drawHeatmap();
  drawCopy();
  saveState();
  lap("views drawn");
}

// The layers' matrices, drawn once per word: the sliders change none of them. Their smallest cosine sets the
// colour scale that the mix's matrix shares.
function drawLayerMatrices() {
  low = lowest(state.fixed.matrices);
  $("matrix-scale").textContent = `Colour: white at ${fmt(low)} (the layers' smallest cosine) or below, deep blue at 1.000.`;
  $("matrices-fixed").innerHTML = state.fixed.matrices.map((m, l) => matrixFigure(l, m)).join("");
}


// What the mix's views need of the layers, once per word: every token, the occurrences' places among them, and the
// dot products of their layers (vectors.js: mixCosines).
function mixGram(occ) {
  const tokens = [];
  state.data.sentences.forEach((sentence, s) => sentence.tokens.forEach((token, t) => tokens.push({ sentence, s, t, token })));
  const place = new Map(tokens.map((x, i) => [`${x.s},${x.t}`, i]));
  const queries = occ.map((o) => tokens[place.get(`${o.s},${o.t}`)]);
  const places = queries.map((q) => place.get(`${q.s},${q.t}`));
  return { tokens, queries, places, gram: V.layerGram(places, tokens) };
}

// The mix's cosines, occurrences x all tokens, for the sliders' mix, from the dot products of the layers.
function mixRows() {
  const f = state.fixed;
  const coefs = state.data.sentences.map((s) => V.mixCoefficients(s, mixOptions()));
  const { rows, queryNorms } = V.mixCosines(f.gram, f.tokens.map((x) => coefs[x.s]));
  return { rows, queryNorms, coefs };
}

// The nearest tokens of each occurrence from its row of cosines with every token (itself left out).
function nearestOf(rows, fixed = state.fixed) {
  return V.topK(rows, fixed.places, NEAREST_K).map((list) => list.map((n) => ({ ...fixed.tokens[n.index], value: n.value })));
}

function redrawWord() {
  saveState();
  if (state.fixed) {
    drawLayerMatrices();
    drawMixViews();
  }
}

// ---- drawing (SVG, each chart with a <title> and its numbers in a table one click away)

const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const fmt = (x) => (Math.abs(x) < 5e-4 ? "0.000" : x.toFixed(3));
const occLabel = (o) => `${state.word} (${o.s + 1})`;
const colourOf = (o) => (state.colourBy === "group" ? GROUP_COLOURS[state.groups[o.s] || ""] : SENTENCE_COLOURS[o.s % SENTENCE_COLOURS.length]);

// White at `low` (or below), deep blue at 1. The occurrences' matrices share one `low` (their smallest cosine), so
// that they read alike; a scale from 0 would paint ELMo's cosines, mostly above 0.5, all in one blue.
let low = 0;
function cellColour(value, from = low) {
  const x = Math.max(0, Math.min(1, (value - from) / (1 - from || 1)));
  return `hsl(215, 70%, ${Math.round(97 - 62 * x)}%)`;
}

function lowest(matrices) {
  let m = 1;
  for (const matrix of matrices) for (const row of matrix) for (const v of row) m = Math.min(m, v);
  return Math.min(m, 0.9);
}

function matrixSvg(matrix, rowLabels, colLabels, title, view) {
  const n = matrix.length;
  const m = matrix[0]?.length || 0;
  const cell = Math.max(6, Math.min(22, Math.floor(220 / Math.max(n, m, 1))));
  const grid = { cell, x0: 0, y0: 0, from: low };
  return `<svg role="img" class="matrix" data-view="${view}" data-values="${valuesOf(matrix)}" ${cellData(rowLabels, colLabels, grid)} width="${m * cell}" height="${n * cell}" viewBox="0 0 ${m * cell} ${n * cell}"><title>${esc(title)}</title><g class="cells">${cellPaths(matrix, grid)}</g></svg>`;
}

// A matrix's cells as one <path> per colour (lightness in 1% steps: a few dozen), each cell a square of it: four
// 40 x 40 matrices were 6,400 <rect>s, whose parsing, style and layout were most of drawing an Embed's views.
function cellPaths(matrix, { cell, x0, y0, from }) {
  const byColour = new Map();
  for (let i = 0; i < matrix.length; i++) {
    const row = matrix[i];
    for (let j = 0; j < row.length; j++) {
      const fill = cellColour(row[j], from);
      const square = `M${x0 + j * cell} ${y0 + i * cell}h${cell}v${cell}h-${cell}z`;
      const list = byColour.get(fill);
      if (list) list.push(square);
      else byColour.set(fill, [square]);
    }
  }
  return Array.from(byColour, ([fill, squares]) => `<path fill="${fill}" d="${squares.join("")}"/>`).join("");
}

// A chart's numbers, one click away: the table is written when its <details> opens (and again at each redraw
// while open), so that a slider move does not lay out thousands of cells nobody looks at.
const tables = new Map(); // id -> {caption, header, rows}
const openTables = new Set();

function tableHtml(id, caption, header, rows) {
  tables.set(id, { caption, header, rows });
  const open = openTables.has(id);
  return `<details data-table="${id}"${open ? " open" : ""}><summary>Table of the numbers</summary>${open ? tableBody(id) : ""}</details>`;
}

function tableBody(id) {
  const { caption, header } = tables.get(id);
  let { rows } = tables.get(id);
  if (typeof rows === "function") rows = rows(); // formatted when shown, not at every slider move
  const head = `<tr>${header.map((h) => `<th scope="col">${esc(h)}</th>`).join("")}</tr>`;
  const body = rows.map((r) => `<tr><th scope="row">${esc(r[0])}</th>${r.slice(1).map((c) => `<td>${esc(c)}</td>`).join("")}</tr>`).join("");
  return `<table><caption>${esc(caption)}</caption>${head}${body}</table>`;
}

function toggled(event) {
  const box = event.target;
  const id = box.dataset?.table;
  if (!id) return;
  if (box.open) {
    openTables.add(id);
    if (!box.querySelector("table")) box.insertAdjacentHTML("beforeend", tableBody(id));
  } else {
    openTables.delete(id);
  }
}

// A view redrawn as `html`: into the elements already there when they are the same ones (what differs of their
// attributes and text copied over), else written anew. A slider move then adds no element to the page: laying out
// new elements is most of what a redraw costs.
function morph(box, html) {
  const model = document.createElement("template");
  model.innerHTML = html; // parsed apart from the page: no style, no layout
  if (!box.firstChild || !sameInto(box, model.content)) box.innerHTML = html;
}

function sameInto(live, model) {
  const a = live.childNodes;
  const b = model.childNodes;
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) {
    const x = a[i];
    const y = b[i];
    if (x.nodeName !== y.nodeName) return false;
    if (x.nodeType === Node.TEXT_NODE) {
      if (x.data !== y.data) x.data = y.data;
    } else if (x.nodeType === Node.ELEMENT_NODE) {
      for (const { name, value } of y.attributes) if (x.getAttribute(name) !== value) x.setAttribute(name, value);
      if (!sameInto(x, y)) return false;
    }
  }
  return true;
}

// A matrix redrawn with the same cells (a slider moved): its numbers and its colours' paths anew, the chart, its
// labels and table kept. False when the cells are not the same ones.
function patchMatrix(box, key, matrix, from) {
  if (box.dataset.key !== key) return false;
  const svg = box.querySelector("svg");
  const [rows, cols] = JSON.parse(svg.dataset.labels);
  if (rows.length !== matrix.length || cols.length !== (matrix[0]?.length || 0)) return false;
  // the numbers once, on the chart (a cell's <title> reads its own when pointed at: retitle)
  svg.dataset.values = valuesOf(matrix);
  // the paths anew only where a colour changed (lightness in 1% steps: a small step often changes none)
  const cells = svg.querySelector("g.cells");
  const html = cellPaths(matrix, { ...gridOf(svg), from });
  if (cells.drawn !== html) cells.innerHTML = cells.drawn = html;
  const details = box.querySelector("details");
  const id = details?.dataset.table;
  if (id) {
    const labels = tables.get(id).labels;
    tables.get(id).rows = () => matrix.map((row, i) => [labels[i], ...Array.from(row, fmt)]);
    if (details.open) details.querySelector("table").outerHTML = tableBody(id);
  }
  return true;
}

// A matrix chart's row and column labels and where its cells lie, for its cells' titles (retitle) and patchMatrix.
const cellData = (rows, cols, { cell, x0, y0 }) => `data-labels="${esc(JSON.stringify([rows, cols]))}" data-grid="${cell},${x0},${y0}"`;
const gridOf = (svg) => {
  const [cell, x0, y0] = svg.dataset.grid.split(",").map(Number);
  return { cell, x0, y0 };
};
const valuesOf = (matrix) => matrix.map((row) => Array.from(row, (v) => v.toFixed(6)).join(",")).join(",");

function matrixFigure(view, matrix) {
  const labels = state.occurrences.map(occLabel);
  const title = `Cosines between the occurrences of “${state.word}”, ${viewName(view)}`;
  const caption =
    view === 0
      ? "Layer 0 is context-free: every same-spelled pair is 1.000 (the page's own check)."
      : view === "mix"
        ? "The mix of the sliders: moves with them."
        : view === 1
          ? "Lower biLSTM layer: context enters (syntax, mostly)."
          : "Upper biLSTM layer: the sense of the word, mostly.";
  const table = tableHtml(`matrix-${view}`, title, ["", ...labels], () => matrix.map((row, i) => [labels[i], ...Array.from(row, fmt)]));
  tables.get(`matrix-${view}`).labels = labels;
  return `<figure><figcaption><strong>${esc(viewName(view))}</strong>. ${esc(caption)}</figcaption>${matrixSvg(matrix, labels, labels, title, view)}${table}</figure>`;
}

function drawMixViews() {
  const started = performance.now();
  const parts = {};
  let mark = started;
  const lap = (name) => {
    const now = performance.now();
    parts[name] = now - mark;
    mark = now;
  };
  const occ = state.occurrences;
  const { rows, queryNorms, coefs } = mixRows();
  const mixMatrix = rows.map((row) => Float64Array.from(state.fixed.places, (c) => row[c]));
  const labels = state.occurrences.map(occLabel);
  const figureKey = `${state.drawn}|${state.word}|${labels.length}|${low}`;
  if (!patchMatrix($("matrix-mix"), figureKey, mixMatrix, low)) {
    $("matrix-mix").innerHTML = matrixFigure("mix", mixMatrix);
    $("matrix-mix").dataset.key = figureKey;
  }
  const meanNorm = queryNorms.reduce((a, b) => a + b, 0) / Math.max(queryNorms.length, 1);
  $("mix-norm").textContent = `Mixed vectors of “${state.word}”: mean L2 norm ${meanNorm.toFixed(3)}.`;
  lap("matrix");
  const f = state.fixed;
  drawTrails(occ.map((o, a) => V.projectMix(f.pca, f.points.map((layer) => layer[a]), coefs[o.s])));
  lap("trails");
  const near = nearestOf(rows);
  lap("nearest (computed)");
  drawNearest(near);
  lap("nearest (drawn)");
  drawSeparation([...state.fixed.matrices, mixMatrix]);
  lap("separation");
  if (state.heat.view === "mix") drawHeatmap();
  lap("heatmap");
  timings.parts = parts;
  timings.lastViews = performance.now() - started;
}

function drawTrails(mixPoints) {
  const occ = state.occurrences;
  const stages = [...state.fixed.points, mixPoints];
  const all = stages.flat();
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const W = 420;
  const H = 320;
  const pad = 24;
  const sx = (x) => (pad + ((x - x0) / (x1 - x0 || 1)) * (W - 2 * pad)).toFixed(1);
  const sy = (y) => (H - pad - ((y - y0) / (y1 - y0 || 1)) * (H - 2 * pad)).toFixed(1);
  const names = [...Array(state.data.numLayers).keys()].map((l) => `layer ${l}`).concat("mix");
  const title = `Trails of the occurrences of “${state.word}” from layer 0 through the layers to the mix, on one PCA of all layers' vectors`;
  const rows = occ.map((o, i) => [occLabel(o), ...stages.map((stage) => `${fmt(stage[i][0])}, ${fmt(stage[i][1])}`)]);
  const box = $("trails");
  const key = `${state.drawn}|${state.word}|${occ.map(colourOf).join()}`;
  if (box.dataset.key === key) {
    // a slider moved: the same trails, at new places (the axes follow the mix's points)
    const svg = box.querySelector("svg");
    occ.forEach((o, i) => {
      const pts = stages.map((stage) => stage[i]);
      const [line, ...rest] = svg.querySelectorAll(`[data-o="${i}"]`);
      line.setAttribute("points", pts.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "));
      pts.forEach((p, k) => {
        rest[k].setAttribute("cx", sx(p[0]));
        rest[k].setAttribute("cy", sy(p[1]));
      });
      const end = pts[pts.length - 1];
      rest[pts.length].setAttribute("x", (Number(sx(end[0])) + 7).toFixed(1));
      rest[pts.length].setAttribute("y", (Number(sy(end[1])) + 4).toFixed(1));
    });
    tables.get("trails").rows = rows;
    const details = box.querySelector("details");
    if (details.open) details.querySelector("table").outerHTML = tableBody("trails");
    return;
  }
  box.dataset.key = key;
  const parts = [];
  occ.forEach((o, i) => {
    const colour = colourOf(o);
    const pts = stages.map((stage) => stage[i]);
    parts.push(`<polyline data-o="${i}" fill="none" stroke="${colour}" stroke-width="1.5" stroke-opacity="0.7" points="${pts.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" ")}"/>`);
    pts.forEach((p, k) => {
      const last = k === pts.length - 1;
      parts.push(`<circle data-o="${i}" cx="${sx(p[0])}" cy="${sy(p[1])}" r="${last ? 5 : 3}" fill="${last ? colour : "#fff"}" stroke="${colour}" stroke-width="1.5"><title>${esc(occLabel(o))}, ${names[k]}</title></circle>`);
    });
    const end = pts[pts.length - 1];
    parts.push(`<text data-o="${i}" x="${(Number(sx(end[0])) + 7).toFixed(1)}" y="${(Number(sy(end[1])) + 4).toFixed(1)}" fill="${colour}">${o.s + 1}</text>`);
  });
  box.innerHTML = `<svg role="img" id="trails-svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}"><title>${esc(title)}</title>${parts.join("")}</svg>${tableHtml("trails", title, ["occurrence", ...names], rows)}`;
}

// A slider moved: only the mix's column changes, and each of its cells keeps its NEAREST_K entries: their texts
// are set in place (token, sentence, cosine), no element added.
function patchNearest(box, mixNearest) {
  const rows = box.querySelectorAll("tr.occurrence");
  if (rows.length !== mixNearest.length) return false;
  for (let i = 0; i < rows.length; i++) {
    const spans = rows[i].lastElementChild.children;
    if (spans.length !== mixNearest[i].length) return false;
    mixNearest[i].forEach((n, k) => {
      const span = spans[k];
      span.className = n.token === state.word ? "nb same" : "nb";
      span.firstChild.data = n.token;
      span.children[0].textContent = String(n.s + 1);
      span.lastChild.data = ` ${fmt(n.value)}`;
    });
  }
  return true;
}

function drawNearest(mixNearest) {
  const views = VIEWS();
  const lists = [...state.fixed.nearest, mixNearest];
  const cell = (list) => list.map((n) => `<span class="nb${n.token === state.word ? " same" : ""}">${esc(n.token)}<sub>${n.s + 1}</sub> ${fmt(n.value)}</span>`).join(" ");
  const box = $("nearest");
  const key = `${state.drawn}|${state.word}`;
  if (box.dataset.key === key && patchNearest(box, mixNearest)) return;
  box.dataset.key = key;
  const head = `<tr><th scope="col">occurrence</th>${views.map((v) => `<th scope="col">${viewName(v)}</th>`).join("")}</tr>`;
  const body = state.occurrences
    .map((o, i) => {
      const cells = lists.map((list) => `<td>${cell(list[i])}</td>`);
      return `<tr class="occurrence"><th scope="row">${esc(occLabel(o))}</th>${cells.join("")}</tr>`;
    })
    .join("");
  box.innerHTML = `<table class="nearest"><caption>The ${NEAREST_K} nearest tokens (cosine; subscript: sentence) of each occurrence, among all tokens typed</caption>${head}${body}</table>`;
}

function drawSeparation(matrices) {
  const views = VIEWS();
  const groups = state.occurrences.map((o) => state.groups[o.s] || "");
  const values = matrices.map((m) => V.separation(m, groups));
  const box = $("separation");
  if (values.some((v) => v === null)) {
    morph(box, `<p>Mark sentences A and B (the select beside each; the examples come marked) with at least two occurrences in one group and one in the other: the figure shows how far the senses come apart.</p>`);
    return;
  }
  const W = 360;
  const H = 180;
  const top = Math.max(0.05, ...values.map((v) => Math.abs(v.value)));
  const bw = (W - 40) / views.length;
  const zero = H / 2;
  const bars = values.map((v, k) => {
    const h = (Math.abs(v.value) / top) * (H / 2 - 20);
    const y = v.value >= 0 ? zero - h : zero;
    return `<rect x="${30 + k * bw + 6}" y="${y.toFixed(1)}" width="${bw - 12}" height="${h.toFixed(1)}" fill="${views[k] === "mix" ? "#d9480f" : "#1f5fbf"}" data-v="${v.value.toFixed(6)}"><title>${viewName(views[k])}: within ${fmt(v.within)} − between ${fmt(v.between)} = ${fmt(v.value)}</title></rect><text x="${30 + k * bw + bw / 2}" y="${H - 4}" text-anchor="middle">${viewName(views[k])}</text><text x="${30 + k * bw + bw / 2}" y="${(v.value >= 0 ? y - 4 : y + h + 12).toFixed(1)}" text-anchor="middle">${fmt(v.value)}</text>`;
  });
  const title = `Sense separation of “${state.word}”: mean cosine within groups A and B minus mean cosine between them`;
  const rows = values.map((v, k) => [viewName(views[k]), fmt(v.within), fmt(v.between), fmt(v.value)]);
  morph(box, `<svg role="img" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}"><title>${esc(title)}</title><line x1="28" x2="${W}" y1="${zero}" y2="${zero}" stroke="#888"/>${bars.join("")}</svg>${tableHtml("separation", title, ["view", "within", "between", "separation"], rows)}`);
}

function drawHeatmap() {
  const { a, b } = state.heat;
  const view = state.heat.view;
  const sa = state.data.sentences[a];
  const sb = state.data.sentences[b];
  if (!sa || !sb) return;
  const rowsV = sa.tokens.map((_, t) => tokenVector(view, a, t));
  const colsV = sb.tokens.map((_, t) => tokenVector(view, b, t));
  const matrix = V.crossCosines(rowsV, colsV);
  const from = 0; // one scale for every view and pair: the words of two sentences are mostly far apart
  const heatKey = `${state.drawn}|${a}|${b}|${view}`;
  if (patchMatrix($("heatmap"), heatKey, matrix, from)) return;
  const cell = Math.max(8, Math.min(22, Math.floor(360 / Math.max(sa.tokens.length, sb.tokens.length))));
  const left = 90;
  const topPad = 90;
  const grid = { cell, x0: left, y0: topPad, from };
  const rowText = sa.tokens.map((t, i) => `<text x="${left - 4}" y="${topPad + i * cell + cell * 0.7}" text-anchor="end">${esc(t)}</text>`);
  const colText = sb.tokens.map((t, j) => `<text transform="translate(${left + j * cell + cell * 0.7},${topPad - 4}) rotate(-60)">${esc(t)}</text>`);
  const W = left + sb.tokens.length * cell + 10;
  const H = topPad + sa.tokens.length * cell + 10;
  const title = `Token × token cosines of sentences ${a + 1} and ${b + 1}, ${viewName(view)} (white at ${fmt(from)} or below, deep blue at 1.000)`;
  const rows = matrix.map((row, i) => [sa.tokens[i], ...Array.from(row, fmt)]);
  $("heatmap").dataset.key = heatKey;
  const labels = cellData(sa.tokens.map((t) => `${t} (${a + 1})`), sb.tokens.map((t) => `${t} (${b + 1})`), grid);
  $("heatmap").innerHTML = `<svg role="img" class="heatmap" data-values="${valuesOf(matrix)}" ${labels} width="${W}" height="${H}" viewBox="0 0 ${W} ${H}"><title>${esc(title)}</title>${rowText.join("")}${colText.join("")}<g class="cells">${cellPaths(matrix, grid)}</g></svg>${tableHtml("heatmap", title, ["", ...sb.tokens], rows)}`;
  tables.get("heatmap").labels = sa.tokens;
}

// ---- copy as curl / Python: the request that gives the mix on screen

function drawCopy() {
  if (!state.data) return;
  const body = { model: state.data.model, sentences: state.data.texts, output: "mix", weights: state.weights, gamma: state.gamma, normalize: state.normalize, layer_norm: state.layerNorm };
  const base = new URL(".", location.href).href.replace(/\/$/, "");
  const auth = sessionStorage.getItem(KEY_STORE) ? " -H 'authorization: Bearer $ELMO_API_KEY'" : "";
  const json = JSON.stringify(body).replace(/'/g, "'\\''");
  $("copy-curl").textContent = `curl -s ${base}/embed -H 'content-type: application/json'${auth} \\\n     -d '${json}'`;
  const py = (x) => JSON.stringify(x).replace(/\btrue\b/g, "True").replace(/\bfalse\b/g, "False");
  const key = sessionStorage.getItem(KEY_STORE) ? ', api_key=os.environ["ELMO_API_KEY"]' : "";
  $("copy-python").textContent = [
    ...(key ? ["import os", ""] : []),
    "from elmo_client import Client",
    "",
    `with Client(${py(base)}${key}) as client:`,
    "    vectors = client.embed(",
    `        ${py(state.data.texts)},`,
    `        model=${py(state.data.model)},`,
    `        weights=${py(state.weights)}, gamma=${py(state.gamma)},`,
    `        normalize=${py(state.normalize)}, layer_norm=${py(state.layerNorm)},`,
    "    )  # one (tokens, dim) array per sentence: the page's mix",
  ].join("\n");
}

async function copyText(id, button) {
  const text = $(id).textContent;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    // no clipboard (an http page elsewhere than localhost): select it for Ctrl+C instead
    const range = document.createRange();
    range.selectNodeContents($(id));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    button.textContent = "Selected: press Ctrl+C";
  }
  setTimeout(() => (button.textContent = button.dataset.label), 2000);
}

// ---- start

// A matrix's cells are a few paths (cellPaths): the one under the pointer gets the <title> of the cell there (its
// row, column and number, as the chart holds them now: the browser's tooltip), from the chart's labels and numbers.
function retitle(event) {
  const path = event.target;
  const svg = path.parentNode?.parentNode;
  if (path.tagName !== "path" || !path.parentNode.classList.contains("cells") || !svg.dataset.labels) return;
  const { cell, x0, y0 } = gridOf(svg);
  const at = svg.createSVGPoint();
  [at.x, at.y] = [event.clientX, event.clientY];
  const p = at.matrixTransform(svg.getScreenCTM().inverse()); // the pointer in the chart's own units
  const [rows, cols] = JSON.parse(svg.dataset.labels);
  const i = Math.floor((p.y - y0) / cell);
  const j = Math.floor((p.x - x0) / cell);
  if (!(i >= 0 && i < rows.length && j >= 0 && j < cols.length)) return;
  const value = Number(svg.dataset.values.split(",")[i * cols.length + j]);
  const title = path.firstElementChild ?? path.appendChild(document.createElementNS(svg.namespaceURI, "title"));
  title.textContent = `${rows[i]} × ${cols[j]}: ${fmt(value)}`;
}

function wire() {
  document.addEventListener("pointermove", retitle);
  document.addEventListener("toggle", toggled, true); // toggle does not bubble: caught on its way down
  const key = $("key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    if (key.value) sessionStorage.setItem(KEY_STORE, key.value);
    else sessionStorage.removeItem(KEY_STORE);
    drawCopy();
    if (!state.models.length) loadModels();
  });
  const example = $("example");
  example.append(...Object.keys(EXAMPLES).map((w) => new Option(`${w} (two senses)`, w)));
  example.addEventListener("change", () => {
    if (!example.value) return;
    const lines = EXAMPLES[example.value];
    $("sentences").value = lines.join("\n");
    state.word = example.value;
    state.groups = lines.map((_, i) => (i < lines.length / 2 ? "A" : "B"));
    state.colourBy = "group";
  });
  $("embed").addEventListener("click", embed);
  $("sentences").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) embed();
  });
  $("gamma").addEventListener("input", () => {
    state.gamma = Number($("gamma").value);
    remix();
  });
  $("gamma").addEventListener("change", settled);
  $("normalize").addEventListener("change", () => {
    state.normalize = $("normalize").value;
    remix();
    settled();
  });
  $("layer-norm").addEventListener("change", () => {
    state.layerNorm = $("layer-norm").checked;
    remix();
    settled();
  });
  $("colour-by").addEventListener("change", () => {
    state.colourBy = $("colour-by").value;
    redrawWord();
  });
  for (const [id, field] of [["heat-a", "a"], ["heat-b", "b"], ["heat-view", "view"]]) {
    $(id).addEventListener("change", () => {
      const value = $(id).value;
      state.heat[field] = field === "view" && value === "mix" ? "mix" : Number(value);
      saveState();
      if (state.fixed) drawHeatmap();
    });
  }
  for (const [button, target] of [["copy-curl-button", "copy-curl"], ["copy-python-button", "copy-python"]]) {
    $(button).dataset.label = $(button).textContent;
    $(button).addEventListener("click", () => copyText(target, $(button)));
  }
}

// For the console and the tests: the state, the page's mix of a token, and how long the last draws took.
window.elmoExplore = {
  state,
  timings,
  mix: (s, t) => Array.from(tokenVector("mix", s, t)),
  embed,
  pickWord,
  remix,
};

wire();
const restored = loadState();
$("gamma").value = String(state.gamma);
// A link restores the page's text and settings; it embeds on a press of Embed, never on opening: a link is anyone's
// to send, and opening it should not send its text to the server.
loadModels().then((ok) => {
  if (ok && restored) $("status").textContent = "Restored from the link: press Embed to embed these sentences.";
});
