/* Factories (empty zeros ones full arange rand randn rank) and the fills of
 * the cuda backend, with the semantics of agent/cpu/kernels_factory.c: the
 * same values, and the same Philox streams (core/tensor/philox.h) for rand/randn. */
#include <math.h>
#include <string.h>

#include "kernels.cuh"
#include "philox.h" /* its constants only: the generator is ported below */

namespace {

/* ---- Philox4x32-10, as core/tensor/philox.c computes it ---- */

CU_HD void philox_block_hd(uint64_t seed, uint32_t rank, uint64_t block, uint32_t out[4]) {
  uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32), c2 = rank, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    if (r) {
      k0 += PHILOX_W0;
      k1 += PHILOX_W1;
    }
    uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* philox_uniform (philox.h). */
CU_HD float uniform_hd(uint32_t word, int bits) {
  return (float)(word >> (32 - bits)) * (1.0f / (float)(1u << bits));
}

/* ---- fills ---- */

/* Every element of the iterator's one operand gets the same bits. */
template <class T>
struct Fill {
  cu_iter_t it;
  T v;
  CU_HD void operator()(int64_t i) const {
    char *p[CU_MAX_OPS];
    it.at(i, p);
    *(T *)p[0] = v;
  }
};

template <class T>
static int fill_bits(const kernel_call_t *c, const cu_iter_t *it, const char *bits,
                     meshd_error_t *e) {
  Fill<T> f;
  f.it = *it;
  memcpy(&f.v, bits, sizeof(T));
  return cuda_launch(c->b, c->bs, cu_iter_numel(it), f, kernel_opname(c), e);
}

/* Writes the Scalar v into every element of t (any layout). */
static int fill_value(const kernel_call_t *c, agent_tensor_t *t, const op_value_t *v,
                      meshd_error_t *e) {
  char bits[16];
  memset(bits, 0, sizeof bits);
  dtype_t dt = t->meta.dtype;
  if (v->kind == VAL_FLOAT) cu_st_f(dt, bits, v->f);
  else cu_st_i(dt, bits, v->kind == VAL_BOOL ? v->b : v->i);
  cu_iter_t it;
  cu_iter_init(&it, t->meta.layout.sizes, t->meta.layout.ndim);
  cu_iter_add(&it, t);
  cu_iter_coalesce(&it);
  int64_t n = cu_iter_numel(&it);
  int esz = cu_size(dt);
  if (n > 0 && it.nd <= 1 && (it.nd == 0 || it.strides[0][0] == esz)) {
    bool same = true; /* every byte equal: a memset */
    for (int k = 1; k < esz; k++) same = same && bits[k] == bits[0];
    if (same) return cuda_memset(c->b, c->bs, cu_data(t), (unsigned char)bits[0],
                                 (size_t)n * esz, e);
  }
  switch (esz) {
    case 8: return fill_bits<uint64_t>(c, &it, bits, e);
    case 4: return fill_bits<uint32_t>(c, &it, bits, e);
    case 2: return fill_bits<uint16_t>(c, &it, bits, e);
    default: return fill_bits<uint8_t>(c, &it, bits, e);
  }
}

}  // namespace

extern "C" int cuda_kernel_fill(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *t = c->res[0];
  const char *name = kernel_opname(c);
  int64_t n = layout_numel(&t->meta.layout);
  size_t bytes = (size_t)n * cu_size(t->meta.dtype);
  /* Fresh results are contiguous at offset 0. */
  if (strcmp(name, "empty") == 0 || strcmp(name, "zeros") == 0) {
    if (!bytes) return 0;
    return cuda_memset(c->b, c->bs, cu_data(t), 0, bytes, e); /* empty too: no stale memory */
  }
  op_value_t one;
  memset(&one, 0, sizeof one);
  one.kind = VAL_INT;
  one.i = 1;
  return fill_value(c, t, strcmp(name, "ones") == 0 ? &one : &c->a->v[1], e);
}

namespace {

static double scalar_f(const op_value_t *v) {
  return v->kind == VAL_FLOAT ? v->f : v->kind == VAL_BOOL ? (double)v->b : (double)v->i;
}

struct ArangeInt {
  char *p;
  dtype_t dt;
  int64_t start, step;
  CU_HD void operator()(int64_t i) const {
    cu_st_i(dt, p + i * cu_size(dt), (int64_t)((uint64_t)start + (uint64_t)i * (uint64_t)step));
  }
};

struct ArangeFloat {
  char *p;
  dtype_t dt;
  double start, step;
  CU_HD void operator()(int64_t i) const {
#ifdef __CUDA_ARCH__
    double v = __dadd_rn(start, __dmul_rn((double)i, step)); /* no fma: as the cpu rounds */
#else
    double v = start + (double)i * step;
#endif
    cu_st_f(dt, p + i * cu_size(dt), v);
  }
};

}  // namespace

extern "C" int cuda_kernel_arange(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *t = c->res[0];
  const op_value_t *start = &c->a->v[0], *step = &c->a->v[2];
  op_value_t zero;
  memset(&zero, 0, sizeof zero);
  zero.kind = VAL_INT;
  if (c->a->v[1].kind == VAL_NONE) start = &zero;
  dtype_t dt = t->meta.dtype;
  int64_t n = t->meta.layout.sizes[0];
  if (cu_is_int(dt)) {
    /* torch truncates float bounds for integer dtypes */
    ArangeInt f = {cu_data(t), dt, start->kind == VAL_INT ? start->i : cu_f2i(scalar_f(start)),
                   step->kind == VAL_INT ? step->i : cu_f2i(scalar_f(step))};
    return cuda_launch(c->b, c->bs, n, f, kernel_opname(c), e);
  }
  ArangeFloat f = {cu_data(t), dt, scalar_f(start), scalar_f(step)};
  return cuda_launch(c->b, c->bs, n, f, kernel_opname(c), e);
}

namespace {

/* One Philox block (4 elements) per call, counted from the draw's offset. */
struct Rand {
  char *out;
  dtype_t dt;
  bool normal;
  int bits;
  uint64_t seed, offset;
  uint32_t rank;
  int64_t n;

  CU_HD void operator()(int64_t blk) const {
    uint64_t g0 = offset + (uint64_t)blk * 4; /* element index of lane 0 */
    uint32_t w[4];
    philox_block_hd(seed, rank, g0 / 4, w);
    double v[4];
    if (normal) {
      for (int pr = 0; pr < 2; pr++) {
        double u1 = uniform_hd(w[2 * pr], 24), u2 = uniform_hd(w[2 * pr + 1], 24);
        double rad = sqrt(-2.0 * log(1.0 - u1)), th = 2.0 * M_PI * u2;
        v[2 * pr] = rad * cos(th);
        v[2 * pr + 1] = rad * sin(th);
      }
    } else {
      for (int j = 0; j < 4; j++) v[j] = uniform_hd(w[j], bits);
    }
    int esz = cu_size(dt);
    for (int j = 0; j < 4; j++) {
      int64_t i = blk * 4 + j;
      if (i < n) cu_st_f(dt, out + i * esz, v[j]);
    }
  }
};

}  // namespace

extern "C" int cuda_kernel_rand(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *t = c->res[0];
  dtype_t dt = t->meta.dtype;
  Rand r;
  memset(&r, 0, sizeof r);
  r.out = cu_data(t);
  r.dt = dt;
  r.normal = strcmp(kernel_opname(c), "randn") == 0;
  r.bits = dt == DTYPE_FLOAT16 ? 11 : dt == DTYPE_BFLOAT16 ? 8 : 24;
  r.rank = c->rank;
  r.n = layout_numel(&t->meta.layout);
  const op_value_t *seed = &c->a->v[2];
  if (seed->kind == VAL_INT) {
    r.seed = (uint64_t)seed->i;
  } else {
    r.seed = PHILOX_DEFAULT_SEED;
    cuda_state_t *st = cuda_state(c->b);
    pthread_mutex_lock(&st->mu);
    r.offset = st->rand_offset;
    st->rand_offset += ((uint64_t)r.n + 3) / 4 * 4;
    pthread_mutex_unlock(&st->mu);
  }
  /* The offset is a multiple of 4, so blocks of the draw are whole blocks. */
  return cuda_launch(c->b, c->bs, (r.n + 3) / 4, r, kernel_opname(c), e);
}

namespace {

struct Rank {
  char *p;
  int64_t v;
  CU_HD void operator()(int64_t) const { cu_st_i(DTYPE_INT64, p, v); }
};

}  // namespace

extern "C" int cuda_kernel_rank(const kernel_call_t *c, meshd_error_t *e) {
  Rank f = {cu_data(c->res[0]), c->coordinate};
  return cuda_launch(c->b, c->bs, 1, f, kernel_opname(c), e);
}

extern "C" int cuda_kernel_fill_(const kernel_call_t *c, meshd_error_t *e) {
  agent_tensor_t *self = kernel_arg(c, 0);
  if (strcmp(kernel_opname(c), "zero_") == 0) {
    op_value_t zero;
    memset(&zero, 0, sizeof zero);
    zero.kind = VAL_INT;
    return fill_value(c, self, &zero, e);
  }
  agent_tensor_t *v = kernel_arg(c, 1);
  if (v) return cuda_copy_broadcast(c->b, c->bs, self, v, e);
  return fill_value(c, self, &c->a->v[1], e);
}
