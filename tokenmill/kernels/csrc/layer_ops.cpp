// Fused per-layer ops of the Llama family on the CPU: RMSNorm (alone and after the residual add),
// SiLU-and-mul, rotary embeddings applied in place; and the greedy pick over the logits (argmax). Each is one pass over its rows where torch
// runs several ops (and allocates between them). Arithmetic in float32; results are rounded to the
// storage dtype where the torch reference rounds, so bfloat16 outputs match it step for step.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "ops.h"

namespace {

// One row: dst = weight * T(src * rsqrt(mean(src^2) + eps)). dst may alias src.
template <typename T>
inline void norm_row(const float* src, const T* weight, T* dst, int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) sq += src[i] * src[i];
  const float r = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(static_cast<float>(weight[i]) * round_trip<T>(src[i] * r));
}

// Rows are the leading dims of a 2-D [N, n] or 3-D [N, M, n] tensor whose last dim is contiguous.
struct Rows {
  int64_t outer, inner, s0, s1;
  explicit Rows(const at::Tensor& x)
      : outer(x.size(0)), inner(x.dim() == 3 ? x.size(1) : 1), s0(x.stride(0)), s1(x.dim() == 3 ? x.stride(1) : 0) {}
  int64_t offset(int64_t row) const { return (row / inner) * s0 + (row % inner) * s1; }
  int64_t count() const { return outer * inner; }
};

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const Rows xs(x), os(out);
  const int64_t n = x.size(-1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, xs.count(), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(xp + xs.offset(r), row.data(), n);
      norm_row<T>(row.data(), wp, op + os.offset(r), n, static_cast<float>(eps));
    }
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> a(n), b(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * x.stride(0);
      T* rr = rp + r * residual.stride(0);
      to_float(xr, a.data(), n);
      to_float(rr, b.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        rr[i] = from_float<T>(a[i] + b[i]);
        b[i] = static_cast<float>(rr[i]);
      }
      norm_row<T>(b.data(), wp, xr, n, static_cast<float>(eps));
    }
  });
}

// g[i] = T(silu(g[i])) * u[i]. Arithmetic-bound (an exp and a division an element): on AVX-512 CPUs
// 16 lanes a vector, where GCC would pick 8 (twice the elements an instruction; measured faster on the
// peer model's prompt chunks).
template <typename T>
void silu_mul_row(float* __restrict g, const float* __restrict u, int64_t n) {
#if defined(__AVX512F__)
#pragma omp simd simdlen(16)
#else
#pragma omp simd
#endif
  for (int64_t i = 0; i < n; ++i) g[i] = round_trip<T>(g[i] * sigmoid(g[i])) * u[i];
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t x_row = x.stride(0), out_row = out.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(n), up(n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(xp + r * x_row, gate.data(), n);
      to_float(xp + r * x_row + n, up.data(), n);
      silu_mul_row<T>(gate.data(), up.data(), n);
      from_float_row(gate.data(), op + r * out_row, n);
    }
  });
}

// x [T, heads, D] in place: x * cos + rotate_half(x) * sin with cos/sin [max_pos, D] float32 rows
// picked by positions [T] int64 (rounded to the storage dtype first, as the reference does).
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  // strides read once: a tensor's accessors inside the loops are calls that keep them scalar
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> cv(dim), sv(dim), vv(dim);
    float* __restrict c = cv.data();
    float* __restrict s = sv.data();
    float* __restrict v = vv.data();
    for (int64_t t = begin; t < end; ++t) {
      const float* crow = cp + pos[t] * cs0;
      const float* srow = sp + pos[t] * ss0;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        c[d] = round_trip<T>(crow[d]);
        s[d] = round_trip<T>(srow[d]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* __restrict row = xp + t * xs0 + h * xs1;
        to_float(row, v, dim);
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float lo = v[d], hi = v[d + half];
          row[d] = from_float<T>(round_trip<T>(lo * c[d]) + round_trip<T>(-hi * s[d]));
          row[d + half] = from_float<T>(round_trip<T>(hi * c[d + half]) + round_trip<T>(lo * s[d + half]));
        }
      }
    }
  });
}

template <template <typename> class F, typename... Args>
void dispatch(at::ScalarType dtype, const char* name, Args&&... args) {
  if (dtype == at::kFloat) {
    F<float>::run(args...);
  } else if (dtype == at::kBFloat16) {
    F<c10::BFloat16>::run(args...);
  } else {
    TORCH_CHECK(false, name, ": float32 and bfloat16 only");
  }
}

template <typename T>
struct RmsNorm {
  static void run(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
    rms_norm_impl<T>(out, x, w, eps);
  }
};
template <typename T>
struct AddRmsNorm {
  static void run(at::Tensor& x, at::Tensor& r, const at::Tensor& w, double eps) { add_rms_norm_impl<T>(x, r, w, eps); }
};
template <typename T>
struct SiluAndMul {
  static void run(at::Tensor& out, const at::Tensor& x) { silu_and_mul_impl<T>(out, x); }
};
template <typename T>
struct Rotary {
  static void run(at::Tensor& x, const at::Tensor& p, const at::Tensor& c, const at::Tensor& s) {
    rotary_impl<T>(x, p, c, s);
  }
};

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, name, " must be 2-D or 3-D, last dim contiguous");
}

}  // namespace

// The ops' entry points, also called from decode_layer.cpp (declared in ops.h).
namespace tokenmill {

// out = RMSNorm(x) * weight; out may be x itself (in place). x and out [N, n] or [N, M, n].
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.is_contiguous() && weight.size(0) == x.size(-1),
              "rms_norm: out, x and weight shapes do not match");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "rms_norm: one dtype");
  dispatch<RmsNorm>(x.scalar_type(), "rms_norm", out, x, weight, eps);
}

// residual += x; x = RMSNorm(residual) * weight. Both [N, n], in place.
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && x.stride(1) == 1 && residual.stride(1) == 1,
              "add_rms_norm: x and residual must be [N, n], last dim contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.size(0) == x.size(1), "add_rms_norm: weight must be [n]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: one dtype");
  dispatch<AddRmsNorm>(x.scalar_type(), "add_rms_norm", x, residual, weight, eps);
}

// out [N, n] = silu(x[:, :n]) * x[:, n:] for x [N, 2n].
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "silu_and_mul: 2-D rows");
  TORCH_CHECK(x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1) && x.scalar_type() == out.scalar_type(),
              "silu_and_mul: x must be [N, 2n] for out [N, n], one dtype");
  dispatch<SiluAndMul>(x.scalar_type(), "silu_and_mul", out, x);
}

void rotary(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary: x must be [T, heads, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == x.size(0),
              "rotary: positions must be int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.stride(1) == 1 &&
                  sin.stride(1) == 1 && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "rotary: cos and sin must be float32 [max_positions, D]");
  dispatch<Rotary>(x.scalar_type(), "rotary", x, positions, cos, sin);
}

// out [N] int64 = the index of each row's largest value in x [N, V] float32 (the first of equal
// ones, as torch.argmax; NaN counts as the largest, as there). One pass per row, rows in parallel.
void argmax_rows(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "argmax_rows: x must be [N, V] float32");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.scalar_type() == at::kLong && out.is_contiguous(),
              "argmax_rows: out must be int64 [N]");
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * x.stride(0);
      float best = row[0];
      int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
      for (int64_t i = 0; i < n; ++i) {
        best = row[i] > best ? row[i] : best;
        nan |= row[i] != row[i];
      }
      // the first index holding it (the first NaN if any): whole vectors compared, then one by one
      int64_t at = 0;
      for (; at + 16 <= n; at += 16) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t k = 0; k < 16; ++k) hit |= nan ? row[at + k] != row[at + k] : row[at + k] == best;
        if (hit) break;
      }
      while (nan ? row[at] == row[at] : row[at] != best) ++at;
      op[r] = at;
    }
  });
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &tokenmill::argmax_rows);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &tokenmill::rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &tokenmill::add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &tokenmill::silu_and_mul);
  m.def("rotary(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary", c10::DispatchKey::CPU, &tokenmill::rotary);
}
