/* Elementwise kernels of the cuda backend: binary ops with broadcasting,
 * scalars and alpha; unary ops; where; clamp. The semantics, compute dtypes
 * and float32 fast paths are those of agent/cpu/kernels_elementwise.c, so both
 * backends give the same bits; on the device, products and sums are rounded
 * one by one (no fma contraction) as the cpu rounds them. */
#include <math.h>
#include <string.h>

#include "kernels.cuh"

namespace {

/* ---- arithmetic rounded as the cpu rounds it ---- */

CU_HD double rn_dmul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
CU_HD double rn_dadd(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
CU_HD double rn_dsub(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
CU_HD float rn_fmul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
CU_HD float rn_fadd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
CU_HD float rn_fsub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
/* float exp/log/tanh: glibc's on the host; on the device the double function
 * rounded once, nearer to glibc than CUDA's float versions. */
CU_HD float f_exp(float a) {
#ifdef __CUDA_ARCH__
  return (float)exp((double)a);
#else
  return expf(a);
#endif
}
CU_HD float f_log(float a) {
#ifdef __CUDA_ARCH__
  return (float)log((double)a);
#else
  return logf(a);
#endif
}
CU_HD float f_tanh(float a) {
#ifdef __CUDA_ARCH__
  return (float)tanh((double)a);
#else
  return tanhf(a);
#endif
}
/* The cpu's NAN as a double: positive quiet NaN. */
CU_HD double qnan(void) {
  uint64_t b = UINT64_C(0x7ff8000000000000);
  double d;
  memcpy(&d, &b, 8);
  return d;
}
CU_HD bool is_nan(double v) { return v != v; }

/* ---- operands: a tensor (in the iterator) or a Scalar (by value) ---- */

/* A Scalar argument as the cpu sees it (its 8-byte buffer read in its dtype). */
struct scal_t {
  bool sc; /* a Scalar, not a tensor */
  uint8_t byte0;
  float f32;
  double f;
  int64_t i;
};

typedef union {
  double f;
  int64_t i;
  uint8_t b;
  float f32;
} scalar_buf_t;

static dtype_t scalar_to_buf(const op_value_t *v, scalar_buf_t *buf) {
  memset(buf, 0, sizeof *buf);
  if (v->kind == VAL_FLOAT) {
    buf->f = v->f;
    return DTYPE_FLOAT64;
  }
  if (v->kind == VAL_BOOL) {
    buf->b = v->b;
    return DTYPE_BOOL;
  }
  buf->i = v->i;
  return DTYPE_INT64;
}

static scal_t scal_of(const scalar_buf_t *buf, dtype_t dt) {
  scal_t s;
  const char *p = (const char *)buf;
  s.sc = true;
  s.byte0 = buf->b;
  s.f = cu_ld_f(dt, p);
  s.i = cu_ld_i(dt, p);
  s.f32 = dt == DTYPE_FLOAT32 ? buf->f32 : (float)s.f;
  return s;
}

/* Adds argument param (a tensor or a Scalar) to the iterator. */
static scal_t add_operand(cu_iter_t *it, const cuda_call_t *c, int param) {
  agent_tensor_t *t = cuda_arg(c, param);
  scal_t s;
  memset(&s, 0, sizeof s);
  if (t) {
    cu_iter_add(it, t);
    return s;
  }
  scalar_buf_t buf;
  dtype_t dt = scalar_to_buf(&c->a->v[param], &buf);
  cu_iter_add_scalar(it, NULL, dt);
  return scal_of(&buf, dt);
}

CU_HD double ld_f(const scal_t &s, dtype_t dt, const char *p) {
  return s.sc ? s.f : cu_ld_f(dt, p);
}
CU_HD int64_t ld_i(const scal_t &s, dtype_t dt, const char *p) {
  return s.sc ? s.i : cu_ld_i(dt, p);
}
CU_HD float ld_f32(const scal_t &s, const char *p) { return s.sc ? s.f32 : *(const float *)p; }

/* The tensor written: self for in-place ops, else the fresh result. */
static agent_tensor_t *output_of(const cuda_call_t *c) {
  return c->a->op->is_inplace ? cuda_arg(c, 0) : c->res[0];
}


/* ---- binary ---- */

enum {
  B_ADD, B_SUB, B_MUL, B_DIV, B_DIV_TRUNC, B_DIV_FLOOR, B_POW, B_MAX, B_MIN,
  B_EQ, B_NE, B_LT, B_LE, B_GT, B_GE, B_LAND, B_LOR, B_BAND, B_BOR, B_BXOR
};

static const struct {
  const char *name;
  int op;
} binary_names[] = {
    {"add", B_ADD}, {"sub", B_SUB}, {"mul", B_MUL}, {"div", B_DIV}, {"pow", B_POW},
    {"maximum", B_MAX}, {"minimum", B_MIN}, {"eq", B_EQ}, {"ne", B_NE}, {"lt", B_LT},
    {"le", B_LE}, {"gt", B_GT}, {"ge", B_GE}, {"logical_and", B_LAND}, {"logical_or", B_LOR},
    {"bitwise_and", B_BAND}, {"bitwise_or", B_BOR}, {"bitwise_xor", B_BXOR},
    {"add_", B_ADD}, {"sub_", B_SUB}, {"mul_", B_MUL}, {"div_", B_DIV},
};

CU_HD int64_t ipow(int64_t a, int64_t b) {
  if (b < 0) return a == 1 ? 1 : a == -1 ? (b & 1 ? -1 : 1) : 0;
  uint64_t r = 1, x = (uint64_t)a;
  while (b) {
    if (b & 1) r *= x;
    x *= x;
    b >>= 1;
  }
  return (int64_t)r;
}

/* torch's div_floor_floating. */
CU_HD double floor_div(double a, double b) {
  if (b == 0) return a / b;
  double mod = fmod(a, b), div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
  if (div == 0) return copysign(0.0, a / b);
  double fl = floor(div);
  if (div - fl > 0.5) fl += 1;
  return fl;
}

struct Binary {
  cu_iter_t it; /* out, x, y */
  scal_t s[2];
  int op;
  bool is_int, f32;
  double alpha_f;
  int64_t alpha_i;
  float alpha32;
  int *zero_div; /* device flag, for integer division */

  CU_HD int64_t bin_i(int64_t a, int64_t b) const {
    switch (op) {
      case B_ADD: return (int64_t)((uint64_t)a + (uint64_t)alpha_i * (uint64_t)b);
      case B_SUB: return (int64_t)((uint64_t)a - (uint64_t)alpha_i * (uint64_t)b);
      case B_MUL: return (int64_t)((uint64_t)a * (uint64_t)b);
      case B_DIV_TRUNC:
      case B_DIV_FLOOR: {
        if (b == 0) {
          *zero_div = 1;
          return 0;
        }
        if (b == -1) return (int64_t)(0 - (uint64_t)a); /* INT64_MIN / -1 wraps */
        int64_t q = a / b;
        if (op == B_DIV_FLOOR && a % b != 0 && ((a < 0) != (b < 0))) q--;
        return q;
      }
      case B_POW: return ipow(a, b);
      case B_MAX: return a > b ? a : b;
      case B_MIN: return a < b ? a : b;
      case B_EQ: return a == b;
      case B_NE: return a != b;
      case B_LT: return a < b;
      case B_LE: return a <= b;
      case B_GT: return a > b;
      case B_GE: return a >= b;
      case B_LAND: return a && b;
      case B_LOR: return a || b;
      case B_BAND: return a & b;
      case B_BOR: return a | b;
      case B_BXOR: return a ^ b;
      default: return 0;
    }
  }

  CU_HD double bin_f(double a, double b) const {
    switch (op) {
      case B_ADD: return rn_dadd(a, rn_dmul(alpha_f, b));
      case B_SUB: return rn_dsub(a, rn_dmul(alpha_f, b));
      case B_MUL: return a * b;
      case B_DIV: return a / b;
      case B_DIV_TRUNC: return trunc(a / b);
      case B_DIV_FLOOR: return floor_div(a, b);
      case B_POW: return pow(a, b);
      case B_MAX: return is_nan(a) || is_nan(b) ? qnan() : a > b ? a : b;
      case B_MIN: return is_nan(a) || is_nan(b) ? qnan() : a < b ? a : b;
      case B_EQ: return a == b;
      case B_NE: return a != b;
      case B_LT: return a < b;
      case B_LE: return a <= b;
      case B_GT: return a > b;
      case B_GE: return a >= b;
      case B_LAND: return a != 0 && b != 0;
      case B_LOR: return a != 0 || b != 0;
      default: return 0;
    }
  }

  /* float32 op float32 -> float32, in float as torch computes it. */
  CU_HD float bin_f32(float a, float b) const {
    switch (op) {
      case B_ADD: return alpha32 == 1 ? rn_fadd(a, b) : rn_fadd(a, rn_fmul(alpha32, b));
      case B_SUB: return alpha32 == 1 ? rn_fsub(a, b) : rn_fsub(a, rn_fmul(alpha32, b));
      case B_MUL: return a * b;
      default: return a / b; /* B_DIV */
    }
  }

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    if (f32) {
      *(float *)p[0] = bin_f32(ld_f32(s[0], p[1]), ld_f32(s[1], p[2]));
    } else if (is_int) {
      cu_st_i(it.dt[0], p[0], bin_i(ld_i(s[0], it.dt[1], p[1]), ld_i(s[1], it.dt[2], p[2])));
    } else {
      cu_st_f(it.dt[0], p[0], bin_f(ld_f(s[0], it.dt[1], p[1]), ld_f(s[1], it.dt[2], p[2])));
    }
  }
};

}  // namespace

extern "C" int cuda_kernel_binary(const cuda_call_t *c, meshd_error_t *e) {
  const op_args_t *a = c->a;
  Binary x;
  memset(&x, 0, sizeof x);
  x.op = -1;
  x.alpha_f = 1;
  x.alpha_i = 1;
  for (size_t k = 0; k < sizeof binary_names / sizeof binary_names[0]; k++)
    if (strcmp(binary_names[k].name, cuda_opname(c)) == 0) x.op = binary_names[k].op;
  const op_value_t *vals[2] = {&a->v[0], &a->v[1]};
  dtype_t rt = ops_result_type(vals, 2);
  if (x.op == B_DIV && a->v[2].kind == VAL_STRING)
    x.op = strcmp(a->v[2].s, "floor") == 0 ? B_DIV_FLOOR : B_DIV_TRUNC;
  if ((x.op == B_ADD || x.op == B_SUB) && a->v[2].kind != VAL_NONE) {
    const op_value_t *al = &a->v[2];
    x.alpha_f = al->kind == VAL_FLOAT ? al->f : al->kind == VAL_BOOL ? al->b : (double)al->i;
    x.alpha_i = al->kind == VAL_INT ? al->i : al->kind == VAL_BOOL ? al->b : cu_f2i(al->f);
  }
  x.alpha32 = (float)x.alpha_f;
  x.is_int = x.op == B_DIV || x.op == B_LAND || x.op == B_LOR ? false : cu_is_int(rt);
  if (x.op >= B_BAND) x.is_int = true;
  agent_tensor_t *out = output_of(c);
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  x.s[0] = add_operand(&x.it, c, 0);
  x.s[1] = add_operand(&x.it, c, 1);
  dtype_t o = x.it.dt[0], i0 = x.it.dt[1], i1 = x.it.dt[2];
  bool f32 = o == DTYPE_FLOAT32 && i0 == DTYPE_FLOAT32 && i1 == DTYPE_FLOAT32;
  if (!f32 && o == DTYPE_FLOAT32 && i0 == DTYPE_FLOAT32 && rt == DTYPE_FLOAT32 &&
      a->v[1].kind != VAL_TENSOR) {
    /* A Python scalar against a float32 tensor is a float32 value in torch. */
    scalar_buf_t buf;
    memset(&buf, 0, sizeof buf);
    buf.f32 = x.s[1].f32;
    x.s[1] = scal_of(&buf, DTYPE_FLOAT32);
    x.it.dt[2] = DTYPE_FLOAT32;
    f32 = true;
  }
  /* The cpu's float32 rows cover these four ops; the rest go through double. */
  x.f32 = f32 && (x.op == B_ADD || x.op == B_SUB || x.op == B_MUL || x.op == B_DIV);
  cu_iter_coalesce(&x.it);
  int64_t n = cu_iter_numel(&x.it);
  bool int_div = x.is_int && (x.op == B_DIV_TRUNC || x.op == B_DIV_FLOOR) && n > 0;
  if (!int_div) return cuda_launch(c->b, c->bs, n, x, cuda_opname(c), e);

  int ret = -1, zero_div = 0;
  x.zero_div = (int *)cuda_scratch_alloc(c->b, c->bs, sizeof(int));
  if (!x.zero_div)
    return error_set(e, ERR_QUOTA, "%s: out of device memory (scratch)", cuda_opname(c));
  if (cuda_memset(c->b, c->bs, x.zero_div, 0, sizeof(int), e) ||
      cuda_launch(c->b, c->bs, n, x, cuda_opname(c), e) ||
      cuda_readback(c, &zero_div, x.zero_div, sizeof(int), e))
    goto out;
  if (zero_div) {
    error_set(e, ERR_REMOTE_FAILURE, "%s: ZeroDivisionError: integer division by zero (rank %u)",
              cuda_opname(c), c->rank);
    goto out;
  }
  ret = 0;
out:
  cuda_scratch_free(c->b, c->bs, x.zero_div, sizeof(int));
  return ret;
}

namespace {

/* ---- unary ---- */

enum {
  U_NEG, U_ABS, U_EXP, U_LOG, U_SQRT, U_RSQRT, U_SIN, U_COS, U_TANH, U_SIGMOID, U_RECIP,
  U_RELU, U_GELU, U_GELU_TANH, U_SILU, U_SIGN, U_NOT
};

static const struct {
  const char *name;
  int op;
} unary_names[] = {
    {"neg", U_NEG}, {"abs", U_ABS}, {"exp", U_EXP}, {"log", U_LOG}, {"sqrt", U_SQRT},
    {"rsqrt", U_RSQRT}, {"sin", U_SIN}, {"cos", U_COS}, {"tanh", U_TANH},
    {"sigmoid", U_SIGMOID}, {"reciprocal", U_RECIP}, {"relu", U_RELU}, {"gelu", U_GELU},
    {"silu", U_SILU}, {"sign", U_SIGN}, {"logical_not", U_NOT},
};

struct Unary {
  cu_iter_t it; /* out, in */
  int op;
  bool is_int, f32;

  CU_HD int64_t un_i(int64_t v) const {
    switch (op) {
      case U_NEG: return (int64_t)(0 - (uint64_t)v);
      case U_ABS: return v < 0 ? (int64_t)(0 - (uint64_t)v) : v;
      case U_RELU: return v > 0 ? v : 0;
      case U_SIGN: return (v > 0) - (v < 0);
      case U_NOT: return !v;
      default: return 0;
    }
  }

  CU_HD double un_f(double v) const {
    switch (op) {
      case U_NEG: return -v;
      case U_ABS: return fabs(v);
      case U_EXP: return exp(v);
      case U_LOG: return log(v);
      case U_SQRT: return sqrt(v);
      case U_RSQRT: return 1.0 / sqrt(v);
      case U_SIN: return sin(v);
      case U_COS: return cos(v);
      case U_TANH: return tanh(v);
      case U_SIGMOID: return 1.0 / (1.0 + exp(-v));
      case U_RECIP: return 1.0 / v;
      case U_RELU: return is_nan(v) ? v : v > 0 ? v : 0;
      case U_GELU: return 0.5 * v * (1.0 + erf(v * M_SQRT1_2));
      case U_GELU_TANH: {
        double k = M_SQRT2 * M_2_SQRTPI * 0.5; /* sqrt(2 / pi) */
        double inner = rn_dadd(v, rn_dmul(rn_dmul(rn_dmul(0.044715, v), v), v));
        return 0.5 * v * (1.0 + tanh(k * inner));
      }
      case U_SILU: return v / (1.0 + exp(-v));
      case U_SIGN: return is_nan(v) ? v : (double)((v > 0) - (v < 0));
      case U_NOT: return v == 0;
      default: return 0;
    }
  }

  CU_HD float un_f32(float a) const {
    switch (op) {
      case U_NEG: return -a;
      case U_ABS: return fabsf(a);
      case U_EXP: return f_exp(a);
      case U_LOG: return f_log(a);
      case U_SQRT: return sqrtf(a);
      case U_RELU: return a > 0 ? a : (a != a ? a : 0.0f);
      case U_SIGMOID: return 1.0f / (1.0f + f_exp(-a));
      case U_SILU: return a / (1.0f + f_exp(-a));
      default: return f_tanh(a); /* U_TANH */
    }
  }

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    if (f32) *(float *)p[0] = un_f32(*(const float *)p[1]);
    else if (is_int) cu_st_i(it.dt[0], p[0], un_i(cu_ld_i(it.dt[1], p[1])));
    else cu_st_f(it.dt[0], p[0], un_f(cu_ld_f(it.dt[1], p[1])));
  }
};

}  // namespace

extern "C" int cuda_kernel_unary(const cuda_call_t *c, meshd_error_t *e) {
  Unary x;
  memset(&x, 0, sizeof x);
  x.op = -1;
  for (size_t k = 0; k < sizeof unary_names / sizeof unary_names[0]; k++)
    if (strcmp(unary_names[k].name, cuda_opname(c)) == 0) x.op = unary_names[k].op;
  if (x.op == U_GELU && c->a->v[1].kind == VAL_STRING && strcmp(c->a->v[1].s, "tanh") == 0)
    x.op = U_GELU_TANH;
  agent_tensor_t *out = c->res[0], *in = cuda_arg(c, 0);
  /* logical_not reads any dtype as double; the others compute in their result dtype. */
  x.is_int = x.op != U_NOT && cu_is_int(out->meta.dtype);
  x.f32 = out->meta.dtype == DTYPE_FLOAT32 && in->meta.dtype == DTYPE_FLOAT32 &&
          (x.op == U_NEG || x.op == U_ABS || x.op == U_EXP || x.op == U_LOG || x.op == U_SQRT ||
           x.op == U_RELU || x.op == U_SIGMOID || x.op == U_SILU || x.op == U_TANH);
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  cu_iter_add(&x.it, in);
  cu_iter_coalesce(&x.it);
  return cuda_launch(c->b, c->bs, cu_iter_numel(&x.it), x, cuda_opname(c), e);
}

namespace {

/* ---- where, clamp ---- */

struct Where {
  cu_iter_t it; /* out, cond, x, y */
  scal_t s[3];
  bool is_int;

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    bool take = (s[0].sc ? s[0].byte0 : *(const uint8_t *)p[1]) != 0;
    if (is_int)
      cu_st_i(it.dt[0], p[0], take ? ld_i(s[1], it.dt[2], p[2]) : ld_i(s[2], it.dt[3], p[3]));
    else
      cu_st_f(it.dt[0], p[0], take ? ld_f(s[1], it.dt[2], p[2]) : ld_f(s[2], it.dt[3], p[3]));
  }
};

}  // namespace

extern "C" int cuda_kernel_where(const cuda_call_t *c, meshd_error_t *e) {
  agent_tensor_t *out = c->res[0];
  Where x;
  memset(&x, 0, sizeof x);
  x.is_int = cu_is_int(out->meta.dtype);
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  for (int k = 0; k < 3; k++) x.s[k] = add_operand(&x.it, c, k);
  cu_iter_coalesce(&x.it);
  return cuda_launch(c->b, c->bs, cu_iter_numel(&x.it), x, cuda_opname(c), e);
}

namespace {

struct Clamp {
  cu_iter_t it; /* out, self, min, max */
  scal_t s[3];
  bool is_int, has_lo, has_hi;

  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    if (is_int) {
      int64_t r = ld_i(s[0], it.dt[1], p[1]);
      if (has_lo) {
        int64_t l = ld_i(s[1], it.dt[2], p[2]);
        r = r < l ? l : r;
      }
      if (has_hi) {
        int64_t h = ld_i(s[2], it.dt[3], p[3]);
        r = r > h ? h : r;
      }
      cu_st_i(it.dt[0], p[0], r);
    } else {
      double r = ld_f(s[0], it.dt[1], p[1]);
      if (has_lo) {
        double l = ld_f(s[1], it.dt[2], p[2]);
        r = is_nan(r) || is_nan(l) ? qnan() : r < l ? l : r;
      }
      if (has_hi) {
        double h = ld_f(s[2], it.dt[3], p[3]);
        r = is_nan(r) || is_nan(h) ? qnan() : r > h ? h : r;
      }
      cu_st_f(it.dt[0], p[0], r);
    }
  }
};

}  // namespace

extern "C" int cuda_kernel_clamp(const cuda_call_t *c, meshd_error_t *e) {
  const op_value_t *vals[3] = {&c->a->v[0], &c->a->v[1], &c->a->v[2]};
  dtype_t rt = ops_result_type(vals, 3);
  agent_tensor_t *out = output_of(c);
  Clamp x;
  memset(&x, 0, sizeof x);
  x.is_int = cu_is_int(rt);
  x.has_lo = c->a->v[1].kind != VAL_NONE;
  x.has_hi = c->a->v[2].kind != VAL_NONE;
  cu_iter_init(&x.it, out->meta.layout.sizes, out->meta.layout.ndim);
  cu_iter_add(&x.it, out);
  for (int k = 0; k < 3; k++) x.s[k] = add_operand(&x.it, c, k);
  cu_iter_coalesce(&x.it);
  return cuda_launch(c->b, c->bs, cu_iter_numel(&x.it), x, cuda_opname(c), e);
}
