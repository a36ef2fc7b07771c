// This project's ONNX Runtime kernels (domain ai.elmo), each the one-pass form of an op the graphs also define in
// standard ONNX ops (model_export/onnx_graph.py: cell_function, quantize_function).
//
// ElmoCellStep: one step of ELMo's projected LSTM cell, everything between the step's products, in one pass.
//
// ONNX Runtime's CPU kernels make the cell's pointwise work one node at a time: the slice of the step's input
// products, their sum with the state's product and the bias, the 4-way split of the gates, three sigmoids, two
// tanhs, the cell update and its clip, each a pass over (rows, 4 x cell) or (rows, cell) values, at every step
// (docs/performance.md, "The time around the products"). This op reads each gate once and writes the new cell
// state and the cell output once:
//
//   inputs  gates_x (N, 4C) float: the input products of every packed position (no bias);
//           first   (1,) int64:    the first packed row of this step;
//           last    (1,) int64:    past its last (first + n);
//           gates_h (n, 4C) float: the running rows' state products;
//           bias    (4C,) float:   the gates' bias, the forget bias included;
//           c       (B, C) float:  every row's cell state, the n running rows first;
//           sizes   (2,) int64:    [n, B - n] (what the op's standard ops split c by).
//   outputs c_next  (B, C): for the running rows clip(sigmoid(f) * c + sigmoid(i) * tanh(j), cell_clip)
//                   (cell_clip 0: no clip), for the others c's rows as they were;
//           m       (n, C): sigmoid(o) * tanh(c_next), the projection's input.
//   Gates in the order i, j, f, o (model_export/bilm.py).
//
// ElmoScaledCellStep: ElmoCellStep of int8 products that come without their rows' scales, two more inputs:
//           scale_x (N, 1) float:  each packed position's scale of its input product;
//           scale_h (n, 1) float:  each running row's scale of its state product;
//   the gates (gates_x * scale_x + bias) + gates_h * scale_h. ONNX Runtime's MatMulIntegerToFloat applies a scale a
//   row of its input in a pass of its own after the product, on one thread (its ScaleOutput); its scale a column
//   it applies inside the product. So the graph gives it a scale of 1 for the rows, and the step, which reads the
//   gates anyway, multiplies them by the rows' scales: the same products of floats, no pass over (rows, 4C).
//
// ElmoQuantizeRows: int8's quantization of a product's input, each row with a scale of its own (a sentence's
// numbers never depend on its batch), where the standard ops take six nodes and three passes over the rows:
//   input   x (M, K) float;  attributes top (float: 63 or 127), centre (int: 64 or 128);
//   outputs q (M, K) uint8 = saturate(round half to even(x / scale) + centre), scale (M, 1) float = max(max |x|,
//           1e-30) / top, row by row: the standard ops' numbers bit for bit (the same division, and the rounding
//           of ONNX Runtime's QuantizeLinear).
//
// No ONNX Runtime header is needed, nor shipped by its Python wheel: the library binds to the C API by position.
// ONNX Runtime's OrtApi is a table of function pointers that only ever grows at its end (its ABI promise): the
// library asks for version 1 of it, whose positions have not moved since ONNX Runtime 1.0, and for version 17 for
// the one entry it adds (KernelContext_ParallelFor: the session's intra-op threads; without it, one thread).
// The op describes itself as a version 13 OrtCustomOp (no variadic inputs, no shape inference).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>

namespace {

// ---- the C API by position (version 1) ----------------------------------------------------------------------
struct OrtApi;
struct OrtStatus;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

enum ElementType : int { kFloat = 1, kUint8 = 2, kInt64 = 7 };  // ONNXTensorElementDataType: ONNX's TensorProto numbering

struct OrtCustomOp {  // the fields of version 13 of the API: a runtime reads no more of an op that says 13
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  ElementType (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  ElementType (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);  // 0: required
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);  // 0: the provider's default
};

// positions in OrtApi (onnxruntime_c_api.h, `struct OrtApi`, counted from 0)
enum Position : size_t {
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kGetTensorMutableData = 51,
  kGetTensorTypeAndShape = 65,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kReleaseTensorTypeAndShapeInfo = 99,
  kReleaseStatus = 93,
  kKernelContextParallelFor = 274,  // version 17 (ONNX Runtime 1.17)
};

const OrtApi* g_api17 = nullptr;  // version 17 of the table, where the runtime has it

template <typename F>
F entry(const OrtApi* api, Position at) {
  return reinterpret_cast<F>(reinterpret_cast<void* const*>(api)[at]);
}

void check(const OrtApi* api, OrtStatus* status) {
  if (status == nullptr) return;
  std::string message = entry<const char* (*)(const OrtStatus*)>(api, kGetErrorMessage)(status);
  entry<void (*)(OrtStatus*)>(api, kReleaseStatus)(status);
  throw std::runtime_error("ai.elmo: " + message);
}

struct Tensor {
  float* data = nullptr;
  int64_t dims[2] = {0, 0};
  size_t rank = 0;
};

Tensor input(const OrtApi* api, OrtKernelContext* context, size_t index) {
  const OrtValue* value = nullptr;
  check(api, entry<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(api, kKernelContextGetInput)(
                 context, index, &value));
  Tensor t;
  void* data = nullptr;
  check(api, entry<OrtStatus* (*)(OrtValue*, void**)>(api, kGetTensorMutableData)(const_cast<OrtValue*>(value), &data));
  t.data = static_cast<float*>(data);
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api, entry<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(api, kGetTensorTypeAndShape)(value, &info));
  OrtStatus* status = entry<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(api, kGetDimensionsCount)(info, &t.rank);
  if (status == nullptr && t.rank <= 2)
    status = entry<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(api, kGetDimensions)(info, t.dims, t.rank);
  entry<void (*)(OrtTensorTypeAndShapeInfo*)>(api, kReleaseTensorTypeAndShapeInfo)(info);
  check(api, status);
  if (t.rank > 2) throw std::runtime_error("ai.elmo: input " + std::to_string(index) + " has rank > 2");
  return t;
}

template <typename T = float>
T* output(const OrtApi* api, OrtKernelContext* context, size_t index, int64_t rows, int64_t columns) {
  const int64_t dims[2] = {rows, columns};
  OrtValue* value = nullptr;
  check(api, entry<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
                 api, kKernelContextGetOutput)(context, index, dims, 2, &value));
  void* data = nullptr;
  check(api, entry<OrtStatus* (*)(OrtValue*, void**)>(api, kGetTensorMutableData)(value, &data));
  return static_cast<T*>(data);
}

// A kernel's work as `total` pieces, on the session's intra-op threads where the runtime lends them.
void parallel(const OrtApi* api, OrtKernelContext* context, void (*piece)(void*, size_t), size_t total, void* work) {
  if (g_api17 != nullptr && total > 1) {
    check(api, entry<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
                   g_api17, kKernelContextParallelFor)(context, piece, total, 0, work));
  } else {
    for (size_t index = 0; index < total; ++index) piece(work, index);
  }
}

// A node's attribute `name`, or `otherwise` where the node has none; `at`: KernelInfoGetAttribute_float's or _int64's.
template <typename T>
T attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name, T otherwise, Position at) {
  T value = otherwise;
  OrtStatus* status = entry<OrtStatus* (*)(const OrtKernelInfo*, const char*, T*)>(api, at)(info, name, &value);
  if (status == nullptr) return value;
  entry<void (*)(OrtStatus*)>(api, kReleaseStatus)(status);  // no such attribute
  return otherwise;
}

// What both ops answer alike: the CPU provider's (no other), inputs and outputs all required, the provider's own
// memory for the inputs (0 for each: OrtCustomOpInputOutputCharacteristic's and OrtMemType's defaults)
const char* cpu_provider(const OrtCustomOp*) { return nullptr; }
int required_in_default_memory(const OrtCustomOp*, size_t) { return 0; }

// ---- the arithmetic ------------------------------------------------------------------------------------------
// Where a product and a sum round once (an FMA) is written out, `madd`, not left to the compiler: the step's gates
// must round each product before its sum, as the op's function (a Mul, then an Add) does, or an ulp of a partial
// sum near 100 (x * scale + bias, before it cancels against h * scale) shows as 5e-6 in m; the polynomials, and
// the cell update f * c + i * j (bounded by the clip, nothing to cancel), keep the FMAs they had. kFma: the target
// has them (a loop of plain products and sums where it has not, no call to a software fma).
template <bool kFma>
__attribute__((always_inline)) inline float madd(float a, float b, float c) {
  if constexpr (kFma) return __builtin_fmaf(a, b, c);
  return a * b + c;  // two roundings: the library is built with -ffp-contract=off
}

// exp by range reduction, x = n ln2 + r with |r| <= ln2 / 2, and exp(r) by its Taylor series to r^7 (relative
// error 5e-9, below float's 6e-8): plain arithmetic, so the compiler vectorizes the row's loop for each target.
template <bool kFma>
__attribute__((always_inline)) inline float exp_reduced(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // not fmin/fmax: their NaN rules keep loops scalar
  // n = round(x / ln2) by adding and taking away 1.5 * 2^23 (float's rounding to nearest does the rounding): SSE2
  // has no vector floor, and every vector width has adds
  const float shifted = madd<kFma>(x, 1.44269504088896341f, 12582912.0f);
  const float n = shifted - 12582912.0f;
  // ln2 in two parts, n * hi exact
  const float r = madd<kFma>(-n, 1.428606765330187e-06f, madd<kFma>(-n, 0.693145751953125f, x));
  float p = 1.0f / 5040;
  p = madd<kFma>(p, r, 1.0f / 720);
  p = madd<kFma>(p, r, 1.0f / 120);
  p = madd<kFma>(p, r, 1.0f / 24);
  p = madd<kFma>(p, r, 1.0f / 6);
  p = madd<kFma>(p, r, 0.5f);
  p = madd<kFma>(p, r, 1.0f);
  p = madd<kFma>(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <bool kFma>
__attribute__((always_inline)) inline float sigmoid(float x) {
  return 1.0f / (1.0f + exp_reduced<kFma>(-x));
}
template <bool kFma>
__attribute__((always_inline)) inline float tanh_(float x) {
  return 2.0f / (1.0f + exp_reduced<kFma>(-2.0f * x)) - 1.0f;
}

// `count` cells of one row: gate g of cell k at x[g * stride + k] (and h's); c, c_next and m at [k].
template <bool kFma, bool kScaled>
__attribute__((always_inline)) inline void cells_of(const float* __restrict x, const float* __restrict h,
                                                    const float* __restrict bias, const float* __restrict c,
                                                    float* __restrict c_next, float* __restrict m, int64_t stride,
                                                    int64_t count, float clip, float sx, float sh) {
  const float lo = clip > 0 ? -clip : -INFINITY;
  const float hi = clip > 0 ? clip : INFINITY;
  for (int64_t k = 0; k < count; ++k) {
    // (input product * its row's scale + bias) + state product * its row's scale, each rounded: the op's standard
    // ops. ElmoCellStep's products come scaled: (x + bias) + h
    float gate[4];
    for (int64_t g = 0; g < 4; ++g) {
      const int64_t at = g * stride + k;
      gate[g] = kScaled ? (x[at] * sx + bias[at]) + h[at] * sh : (x[at] + bias[at]) + h[at];
    }
    const float i = sigmoid<kFma>(gate[0]), j = tanh_<kFma>(gate[1]), f = sigmoid<kFma>(gate[2]),
                o = sigmoid<kFma>(gate[3]);
    float next = madd<kFma>(f, c[k], i * j);
    next = next < lo ? lo : (next > hi ? hi : next);
    c_next[k] = next;
    m[k] = o * tanh_<kFma>(next);
  }
}

template <bool kFma>
__attribute__((always_inline)) inline void cells_any(const float* x, const float* h, const float* bias,
                                                     const float* c, float* c_next, float* m, int64_t stride,
                                                     int64_t count, float clip, float sx, float sh) {
  // x * 1 is x to the bit: ElmoCellStep's loop only leaves the multiplications out
  if (sx == 1.0f && sh == 1.0f) return cells_of<kFma, false>(x, h, bias, c, c_next, m, stride, count, clip, sx, sh);
  cells_of<kFma, true>(x, h, bias, c, c_next, m, stride, count, clip, sx, sh);
}

// one library for every x86-64: the loop compiled for AVX-512, for AVX2 with FMA and for plain SSE2, the CPU's
// own chosen when the library loads (function multiversioning; by feature lists, which GCC and Clang both take
// there, where Clang refuses an arch=x86-64-vN)
#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))) void cells(
    const float* x, const float* h, const float* bias, const float* c, float* c_next, float* m, int64_t stride,
    int64_t count, float clip, float sx, float sh) {
  cells_any<true>(x, h, bias, c, c_next, m, stride, count, clip, sx, sh);
}
__attribute__((target("avx2,fma"))) void cells(const float* x, const float* h, const float* bias, const float* c,
                                               float* c_next, float* m, int64_t stride, int64_t count, float clip,
                                               float sx, float sh) {
  cells_any<true>(x, h, bias, c, c_next, m, stride, count, clip, sx, sh);
}
__attribute__((target("default"))) void cells(const float* x, const float* h, const float* bias, const float* c,
                                              float* c_next, float* m, int64_t stride, int64_t count, float clip,
                                              float sx, float sh) {
  cells_any<false>(x, h, bias, c, c_next, m, stride, count, clip, sx, sh);
}
#else
void cells(const float* x, const float* h, const float* bias, const float* c, float* c_next, float* m,
           int64_t stride, int64_t count, float clip, float sx, float sh) {
#if defined(__FP_FAST_FMAF)
  cells_any<true>(x, h, bias, c, c_next, m, stride, count, clip, sx, sh);
#else
  cells_any<false>(x, h, bias, c, c_next, m, stride, count, clip, sx, sh);
#endif
}
#endif

// A step's work in blocks of a row's cells, for the thread pool: a block is 1,024 cells (about 5 us of one core).
constexpr int64_t kBlock = 1024;

struct Step {
  const float *gates_x, *gates_h, *bias, *c;
  const float *scale_x, *scale_h;  // the step's rows' scales (ElmoScaledCellStep), or null: 1
  float *c_next, *m;
  int64_t cell, blocks;
  float clip;
};

void run_block(void* data, size_t index) {
  const Step& s = *static_cast<const Step*>(data);
  const int64_t row = static_cast<int64_t>(index) / s.blocks, k = static_cast<int64_t>(index) % s.blocks * kBlock;
  const int64_t count = std::min(kBlock, s.cell - k);
  cells(s.gates_x + row * 4 * s.cell + k, s.gates_h + row * 4 * s.cell + k, s.bias + k, s.c + row * s.cell + k,
        s.c_next + row * s.cell + k, s.m + row * s.cell + k, s.cell, count, s.clip,
        s.scale_x ? s.scale_x[row] : 1.0f, s.scale_h ? s.scale_h[row] : 1.0f);
}

struct Kernel {
  const OrtApi* api;
  float clip;
};

void* create_kernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info) {
  return new Kernel{api, attribute(api, info, "cell_clip", 0.0f, kKernelInfoGetAttributeFloat)};  // 0: no clip
}

// ElmoCellStep (`scaled` false) and ElmoScaledCellStep (true: inputs 7 and 8, the products' rows' scales)
template <bool scaled>
constexpr const char* cell_op_name() {
  return scaled ? "ElmoScaledCellStep" : "ElmoCellStep";
}

// Either op's step
template <bool scaled>
void compute(void* state, OrtKernelContext* context) {
  const auto* kernel = static_cast<Kernel*>(state);
  const OrtApi* api = kernel->api;
  const char* name = cell_op_name<scaled>();
  const Tensor gates_x = input(api, context, 0), first = input(api, context, 1), last = input(api, context, 2),
               gates_h = input(api, context, 3), bias = input(api, context, 4), c = input(api, context, 5),
               sizes = input(api, context, 6);
  const int64_t rows = gates_h.dims[0], batch = c.dims[0], cell = c.dims[1];
  const int64_t start = *reinterpret_cast<const int64_t*>(first.data);
  const int64_t end = *reinterpret_cast<const int64_t*>(last.data);
  const auto* split = reinterpret_cast<const int64_t*>(sizes.data);
  if (gates_x.rank != 2 || gates_h.rank != 2 || c.rank != 2 || bias.rank != 1 || sizes.rank != 1 ||
      sizes.dims[0] != 2 || gates_x.dims[1] != 4 * cell || gates_h.dims[1] != 4 * cell || bias.dims[0] != 4 * cell ||
      rows > batch || split[0] != rows || split[1] != batch - rows || start < 0 || end != start + rows ||
      end > gates_x.dims[0])
    throw std::runtime_error(std::string(name) + ": inputs of inconsistent shapes");
  Tensor scale_x, scale_h;
  if (scaled) {
    scale_x = input(api, context, 7);
    scale_h = input(api, context, 8);
    if (scale_x.rank != 2 || scale_x.dims[0] != gates_x.dims[0] || scale_x.dims[1] != 1 || scale_h.rank != 2 ||
        scale_h.dims[0] != rows || scale_h.dims[1] != 1)
      throw std::runtime_error(std::string(name) + ": scales of inconsistent shapes");
  }
  float* c_next = output(api, context, 0, batch, cell);
  // the finished rows' state, as it was (a copy: ONNX Runtime's inputs are read-only)
  std::memcpy(c_next + rows * cell, c.data + rows * cell, sizeof(float) * static_cast<size_t>((batch - rows) * cell));
  Step step{gates_x.data + start * 4 * cell, gates_h.data, bias.data, c.data,
            scaled ? scale_x.data + start : nullptr, scaled ? scale_h.data : nullptr,
            c_next, output(api, context, 1, rows, cell), cell, (cell + kBlock - 1) / kBlock, kernel->clip};
  parallel(api, context, run_block, static_cast<size_t>(rows * step.blocks), &step);
}

ElementType cell_input_type(const OrtCustomOp*, size_t index) {
  return index == 1 || index == 2 || index == 6 ? kInt64 : kFloat;
}

// ElmoCellStep's table and ElmoScaledCellStep's: their names, their count of inputs and their compute
template <bool scaled>
constexpr OrtCustomOp cell_op() {
  return {
      13,
      create_kernel,
      [](const OrtCustomOp*) { return cell_op_name<scaled>(); },
      cpu_provider,
      cell_input_type,
      [](const OrtCustomOp*) -> size_t { return scaled ? 9 : 7; },
      [](const OrtCustomOp*, size_t) { return kFloat; },
      [](const OrtCustomOp*) -> size_t { return 2; },
      compute<scaled>,
      [](void* kernel) { delete static_cast<Kernel*>(kernel); },
      required_in_default_memory,  // GetInputCharacteristic
      required_in_default_memory,  // GetOutputCharacteristic
      required_in_default_memory,  // GetInputMemoryType
  };
}

constexpr OrtCustomOp kCellStep = cell_op<false>();
constexpr OrtCustomOp kScaledCellStep = cell_op<true>();

// ---- ElmoQuantizeRows ---------------------------------------------------------------------------------------

#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void quantize_row(const float* __restrict x, uint8_t* __restrict q, float* __restrict scale, int64_t count, float top,
                  float centre) {
  float peak = 0;
#pragma omp simd reduction(max : peak)  // a max the compiler may reorder (-fopenmp-simd): no NaN to keep in order
  for (int64_t k = 0; k < count; ++k) {
    const float magnitude = x[k] < 0 ? -x[k] : x[k];
    peak = magnitude > peak ? magnitude : peak;
  }
  const float s = (peak > 1e-30f ? peak : 1e-30f) / top;
  *scale = s;
  const float lo = -centre, hi = 255.0f - centre;
  for (int64_t k = 0; k < count; ++k) {
    float v = x[k] / s;  // divided, as QuantizeLinear does, not times the reciprocal
    v = v < lo ? lo : (v > hi ? hi : v);
    v = (v + 12582912.0f) - 12582912.0f;  // to the nearest integer, ties to even
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(v + centre));
  }
}

struct Quantizer {
  const OrtApi* api;
  float top, centre;
};

struct Rows {
  const float* x;
  uint8_t* q;
  float* scale;
  int64_t columns, per_piece, rows;
  float top, centre;
};

void quantize_rows(void* data, size_t index) {
  const Rows& r = *static_cast<const Rows*>(data);
  const int64_t end = std::min(r.rows, static_cast<int64_t>(index + 1) * r.per_piece);
  for (int64_t row = static_cast<int64_t>(index) * r.per_piece; row < end; ++row)
    quantize_row(r.x + row * r.columns, r.q + row * r.columns, r.scale + row, r.columns, r.top, r.centre);
}

void* create_quantizer(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info) {
  return new Quantizer{api, attribute(api, info, "top", 127.0f, kKernelInfoGetAttributeFloat),
                       static_cast<float>(attribute<int64_t>(api, info, "centre", 128, kKernelInfoGetAttributeInt64))};
}

void quantize(void* state, OrtKernelContext* context) {
  const auto* kernel = static_cast<Quantizer*>(state);
  const OrtApi* api = kernel->api;
  const Tensor x = input(api, context, 0);
  if (x.rank != 2) throw std::runtime_error("ElmoQuantizeRows: x is not a matrix");
  const int64_t rows = x.dims[0], columns = x.dims[1];
  // pieces of about 4,096 values: a piece on another thread is worth that much work
  const int64_t per_piece = std::max<int64_t>(1, 4096 / std::max<int64_t>(columns, 1));
  Rows work{x.data, output<uint8_t>(api, context, 0, rows, columns), output(api, context, 1, rows, 1), columns,
            per_piece, rows, kernel->top, kernel->centre};
  parallel(api, context, quantize_rows, static_cast<size_t>((rows + per_piece - 1) / per_piece), &work);
}

const OrtCustomOp kQuantizeRows = {
    13,
    create_quantizer,
    [](const OrtCustomOp*) { return "ElmoQuantizeRows"; },
    cpu_provider,
    [](const OrtCustomOp*, size_t) { return kFloat; },
    [](const OrtCustomOp*) -> size_t { return 1; },
    [](const OrtCustomOp*, size_t index) { return index == 0 ? kUint8 : kFloat; },
    [](const OrtCustomOp*) -> size_t { return 2; },
    quantize,
    [](void* kernel) { delete static_cast<Quantizer*>(kernel); },
    required_in_default_memory,  // GetInputCharacteristic
    required_in_default_memory,  // GetOutputCharacteristic
    required_in_default_memory,  // GetInputMemoryType
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(1);
  g_api17 = base->GetApi(17);  // null on a runtime older than 1.17
  static std::mutex made;  // two sessions made at once, on two threads: one of them makes the domain
  static OrtCustomOpDomain* domain = nullptr;  // lives as long as the process: sessions keep pointing at it
  const std::lock_guard<std::mutex> hold(made);
  if (domain == nullptr) {
    OrtCustomOpDomain* ops = nullptr;
    OrtStatus* status = entry<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(api, kCreateCustomOpDomain)(
        "ai.elmo", &ops);
    for (const OrtCustomOp* op : {&kCellStep, &kScaledCellStep, &kQuantizeRows}) {
      if (status != nullptr) return status;
      status = entry<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(api, kCustomOpDomainAdd)(ops, op);
    }
    if (status != nullptr) return status;
    domain = ops;
  }
  return entry<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(api, kAddCustomOpDomain)(options, domain);
}
