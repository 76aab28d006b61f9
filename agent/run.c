/* What each instruction does on the agent (run.h). */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "load.h"
#include "log.h"
#include "reduction.h"
#include "runtime.h"
#include "run.h"
#include "snapshot.h"
#include "validate.h"

#define MAX_HELD 64
#define MAX_LISTS 8
#define MAX_LIST 64

typedef Meshd__Agent__V1__TensorSpec spec_t;

typedef struct ctx {
  const run_env_t *env;
  session_state_t *s;
  const Meshd__Agent__V1__Instruction *ins;
  backend_t *b;
  backend_stream_t *bs; /* the instruction's stream on the backend (NULL: cpu) */
  run_failures_t *out;
  /* The instruction entered its data plane call, or refused it: its peers
   * learn of a failure there (refuse_group, refuse_link). */
  bool joined;
} ctx_t;

/* ------------------------------------------------------------------ failures */

static void report(ctx_t *c, error_kind_t kind, const char *msg, uint64_t ref) {
  if (c->out->n == RUN_MAX_FAILURES) return;
  run_failure_t *f = &c->out->v[c->out->n++];
  f->kind = kind;
  f->seq = c->ins->seq;
  f->ref = ref;
  snprintf(f->msg, sizeof f->msg, "%.*s", (int)sizeof f->msg - 1, msg); /* cut if longer */
}

static void fail_refs(ctx_t *c, const uint64_t *refs, size_t n, const ref_failure_t *f) {
  for (size_t i = 0; i < n; i++)
    if (refs[i]) refs_fail(&c->s->refs, refs[i], f);
}

/* A root failure of this instruction: marks refs, reports once. Its kind is
 * e's where that says more than REMOTE_FAILURE (keep: always e's). */
static void root_failure_kind(ctx_t *c, const uint64_t *refs, size_t n, const meshd_error_t *e,
                              bool keep) {
  ref_failure_t f = {.kind = keep || e->kind == ERR_QUOTA || e->kind == ERR_AGENT_LOST
                                 ? e->kind
                                 : ERR_REMOTE_FAILURE,
                     .root_seq = c->ins->seq,
                     .root_ref = n ? refs[0] : 0};
  snprintf(f.msg, sizeof f.msg, "%s", e->msg);
  fail_refs(c, refs, n, &f);
  log_event(LOG_LEVEL_DEBUG, "run", &(log_fields_t){.session = c->s->id, .seq = c->ins->seq},
            "session %.8s seq %" PRIu64 ": %s", c->s->id, c->ins->seq, e->msg);
  report(c, f.kind, f.msg, f.root_ref);
  /* Its other results (max's indices) and what it wrote in place fail with it
   * on the server too: each told, with the same root (the server keeps one
   * note of it for Sync); only the first was, and the rest stayed live there. */
  for (size_t i = 1; i < n; i++) {
    bool told = refs[i] == 0;
    for (size_t k = 0; k < i && !told; k++) told = refs[k] == refs[i];
    if (!told) report(c, f.kind, f.msg, refs[i]);
  }
}

static void root_failure(ctx_t *c, const uint64_t *refs, size_t n, const meshd_error_t *e) {
  root_failure_kind(c, refs, n, e, false);
}

/* refs depend on `input`, which failed with *root. Not reported again. */
static void dependent_failure(ctx_t *c, const uint64_t *refs, size_t n, uint64_t input,
                              const ref_failure_t *root) {
  ref_failure_t f = *root;
  if (root->kind != ERR_DEPENDENT_FAILURE) {
    f.kind = ERR_DEPENDENT_FAILURE;
    snprintf(f.msg, sizeof f.msg, "depends on tensor %llu, which failed (seq %llu): %.500s",
             (unsigned long long)input, (unsigned long long)root->root_seq, root->msg);
  }
  fail_refs(c, refs, n, &f);
  /* Reported too (marked DEPENDENT_FAILURE, so the server does not count them
   * as roots): a reader on another rank that computed fine must learn that the
   * value failed somewhere (DESIGN §6: it fails on fetch from every rank). */
  for (size_t i = 0; i < n; i++)
    if (refs[i]) report(c, ERR_DEPENDENT_FAILURE, f.msg, refs[i]);
}

/* Records t as ref's value. The table out of memory: the result fails
 * (QUOTA, reported), instead of staying undefined here while the server holds
 * it defined. */
static void define(ctx_t *c, uint64_t ref, const agent_tensor_t *t, const char *what) {
  if (refs_put(&c->s->refs, ref, t) == 0) return;
  meshd_error_t e;
  error_set(&e, ERR_QUOTA, "%s: agent out of memory recording result ref %llu", what,
            (unsigned long long)ref);
  root_failure(c, &ref, 1, &e);
}

static void count_bytes(ctx_t *c, uint64_t bytes) {
  if (c->env->stats) atomic_fetch_add(&c->env->stats->collective_bytes, bytes);
}

static int need_backend(ctx_t *c, const char *what, meshd_error_t *e) {
  if (c->b) return 0;
  return error_set(e, ERR_REMOTE_FAILURE, "%s: this agent has no compute backend", what);
}

static void meta_of_spec(const spec_t *sp, tensor_meta_t *m) {
  memset(m, 0, sizeof *m);
  m->dtype = (dtype_t)sp->dtype;
  m->layout.ndim = (int)(sp->n_shape < LAYOUT_MAX_DIMS ? sp->n_shape : LAYOUT_MAX_DIMS);
  for (int i = 0; i < m->layout.ndim; i++) m->layout.sizes[i] = sp->shape[i];
  layout_make_contiguous(&m->layout);
}

static bool same_meta(const tensor_meta_t *a, const tensor_meta_t *b) {
  return a->dtype == b->dtype && layout_same_shape(&a->layout, &b->layout);
}

/* "<what> is float32 [4] ... but <other> is float32 [3]" into e. */
static int differs(meshd_error_t *e, const char *what, const tensor_meta_t *got, const char *other,
                   const tensor_meta_t *want) {
  char g[LAYOUT_SHAPE_BUF], w[LAYOUT_SHAPE_BUF];
  layout_format_shape(got->layout.sizes, got->layout.ndim, g, sizeof g);
  layout_format_shape(want->layout.sizes, want->layout.ndim, w, sizeof w);
  return error_set(e, ERR_REMOTE_FAILURE, "%s is %s %s but %s is %s %s", what,
                   dtype_name(got->dtype), g, other, dtype_name(want->dtype), w);
}

/* A result names a ref not yet defined in the session (the server never
 * reuses one): 0, or -1 with e. Such a refusal fails no ref: the live one
 * keeps its value. */
static int check_fresh(ctx_t *c, uint64_t ref, const char *what, meshd_error_t *e) {
  agent_tensor_t t;
  int rc = refs_get(&c->s->refs, ref, &t, NULL);
  if (rc < 0) return 0;
  if (rc == 0) storage_release(t.storage);
  return error_set(e, ERR_REMOTE_FAILURE,
                   "%s: result ref %llu is already defined on this agent (seq %llu names a ref "
                   "in use)", what, (unsigned long long)ref, (unsigned long long)c->ins->seq);
}

/* ------------------------------------------------------------------ factory */

static void run_factory(ctx_t *c) {
  const Meshd__Agent__V1__FactoryOp *fo = c->ins->factory;
  const Meshd__V1__Factory *f = fo->factory;
  uint64_t ref = fo->result ? fo->result->ref : f->ref;
  meshd_error_t e = {0};
  op_args_t args;
  op_infer_t inf;
  agent_tensor_t t = {0};
  if (check_fresh(c, ref, "Factory", &e)) {
    report(c, e.kind, e.msg, ref);
    return;
  }
  if (need_backend(c, "Factory", &e) || ops_bind_factory(f, &args, &e) || ops_infer(&args, &inf, &e))
    goto fail;
  if (tensor_alloc(c->b, c->bs, &inf.results[0].meta, &t, "Factory", &e)) goto fail;
  agent_tensor_t *rp = &t;
  if (c->b->ops->run_op(c->b, c->bs, &args, &rp, 1, &inf, fo->mesh_rank, fo->coordinate, &e))
    goto fail;
  define(c, ref, &t, "Factory");
  storage_release(t.storage);
  return;
fail:
  storage_release(t.storage);
  root_failure(c, &ref, 1, &e);
}

/* ------------------------------------------------------------------ literals and loads */

/* Fills a fresh tensor's bytes: 0, or -1 with e. */
typedef int (*fill_fn)(ctx_t *c, agent_tensor_t *t, meshd_error_t *e);

/* The result of `spec`, defined only once fill put all its bytes in: a fill
 * that fails leaves a failed ref, never a half-filled one (with fill's own
 * kind when own_kind: PERMISSION_DENIED, UNAVAILABLE...). */
static void define_filled(ctx_t *c, const spec_t *spec, const char *what, fill_fn fill,
                          bool own_kind) {
  uint64_t ref = spec->ref;
  meshd_error_t e = {0};
  agent_tensor_t t = {0};
  tensor_meta_t m;
  if (check_fresh(c, ref, what, &e)) {
    report(c, e.kind, e.msg, ref);
    return;
  }
  meta_of_spec(spec, &m);
  if (need_backend(c, what, &e) || tensor_alloc(c->b, c->bs, &m, &t, what, &e) || fill(c, &t, &e)) {
    storage_release(t.storage);
    root_failure_kind(c, &ref, 1, &e, own_kind && e.kind != ERR_REMOTE_FAILURE);
    return;
  }
  define(c, ref, &t, what);
  storage_release(t.storage);
}

/* A Literal's bytes came in the instruction (validated: exactly the result's). */
static int fill_literal(ctx_t *c, agent_tensor_t *t, meshd_error_t *e) {
  const ProtobufCBinaryData *d = &c->ins->literal->data;
  return d->len ? c->b->ops->from_host(c->b, c->bs, t, d->data, e) : 0;
}

static void run_literal(ctx_t *c) {
  define_filled(c, c->ins->literal->result, "Literal", fill_literal, false);
}

/* A load's download stops once its session ended: nobody reads the tensor. */
static bool session_gone(void *s) { return session_state_closing(s); }

static int fill_load(ctx_t *c, agent_tensor_t *t, meshd_error_t *e) {
  return load_run(c->b, c->bs, c->ins->session_id, c->ins->load, t, session_gone, c->s, e);
}

static void run_load(ctx_t *c) { define_filled(c, c->ins->load->result, "Load", fill_load, true); }

/* ------------------------------------------------------------------ op calls */

typedef struct held {
  agent_tensor_t t[MAX_HELD];
  uint64_t ref[MAX_HELD];
  int n;
  const tensor_meta_t *lists[MAX_LISTS][MAX_LIST];
  int nlists;
  /* the first input that failed or is missing */
  bool failed;
  uint64_t failed_ref;
  ref_failure_t why;
} held_t;

/* A call's held inputs, about 23 KiB: one per worker thread (runtime.h),
 * since a calloc of that size per instruction cost more than a tiny op's
 * kernel. Reset for each call; NULL out of memory. */
static held_t *held_get(void) {
  static runtime_scratch_t scratch = RUNTIME_SCRATCH_INIT(sizeof(held_t));
  held_t *h = runtime_scratch(&scratch);
  if (h) {
    h->n = h->nlists = 0;
    h->failed = false;
    h->failed_ref = 0;
  }
  return h;
}

static void held_release(held_t *h) {
  for (int i = 0; i < h->n; i++) storage_release(h->t[i].storage);
  h->n = 0;
}

/* A tensor argument; NULL when it failed (h->failed says why) or on overflow. */
static const tensor_meta_t *hold(ctx_t *c, held_t *h, uint64_t ref, meshd_error_t *e) {
  if (h->n == MAX_HELD) {
    error_set(e, ERR_REMOTE_FAILURE, "too many tensor arguments");
    return NULL;
  }
  int rc = session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, ref, &h->t[h->n],
                             &h->why);
  if (rc == 0) {
    h->ref[h->n] = ref;
    return &h->t[h->n++].meta;
  }
  if (!h->failed) {
    h->failed = true;
    h->failed_ref = ref;
    if (rc < 0) { /* never defined here: a root failure of its own */
      h->why.kind = ERR_REMOTE_FAILURE;
      h->why.root_seq = c->ins->seq;
      snprintf(h->why.msg, sizeof h->why.msg, "tensor %llu is not on the agent",
               (unsigned long long)ref);
    }
  }
  return NULL;
}

static int resolve(ctx_t *c, held_t *h, const Meshd__V1__Arg *a, op_value_t *v, meshd_error_t *e) {
  memset(v, 0, sizeof *v);
  switch (a->value_case) {
    case MESHD__V1__ARG__VALUE_REF:
      v->kind = VAL_TENSOR;
      v->tensor = hold(c, h, a->ref, e);
      return v->tensor ? 0 : -1;
    case MESHD__V1__ARG__VALUE_REFS: {
      if (h->nlists == MAX_LISTS || a->refs->n_refs > MAX_LIST)
        return error_set(e, ERR_REMOTE_FAILURE, "too many tensor lists");
      const tensor_meta_t **list = h->lists[h->nlists++];
      for (size_t i = 0; i < a->refs->n_refs; i++)
        if (!(list[i] = hold(c, h, a->refs->refs[i], e))) return -1;
      v->kind = VAL_TENSORS;
      v->tensors = list;
      v->ntensors = a->refs->n_refs;
      return 0;
    }
    default: {
      int rc = op_value_from_arg(a, v);
      if (rc < 0) return error_set(e, ERR_REMOTE_FAILURE, "unknown dtype %d", (int)a->dtype);
      if (rc > 0) v->kind = VAL_NONE; /* no value: None */
      return 0;
    }
  }
}

static uint64_t ref_of_meta(const held_t *h, const tensor_meta_t *m) {
  for (int i = 0; i < h->n; i++)
    if (&h->t[i].meta == m) return h->ref[i];
  return 0;
}

static int injected(ctx_t *c, const char *where, const char *what, meshd_error_t *e);

/* Appends to refs[0..n) (room for cap) the tensors call writes in place: the
 * parameters the server named in `mutates` (self, out=...), given by position
 * or by keyword; not `skip` (a failed input keeps its own root). Returns the
 * new count. Safe on an instruction that failed validation (a missing arg, an
 * unknown op: by position only). */
static size_t call_written_refs(const Meshd__Agent__V1__OpCall *call, uint64_t skip,
                                uint64_t *refs, size_t n, size_t cap) {
  const op_def_t *op = call->op ? ops_find(call->op) : NULL;
  for (size_t m = 0; m < call->n_mutates && n < cap; m++) {
    uint64_t p = call->mutates[m];
    const Meshd__V1__Arg *a = NULL;
    if (p < call->n_args) a = call->args[p];
    for (size_t k = 0; !a && op && p < (uint64_t)op->nparams && k < call->n_kwargs; k++) {
      const Meshd__V1__Kwarg *kw = call->kwargs[k];
      if (kw && kw->name && strcmp(kw->name, op->params[p].name) == 0) a = kw->value;
    }
    if (a && a->value_case == MESHD__V1__ARG__VALUE_REF && a->ref && a->ref != skip)
      refs[n++] = a->ref;
  }
  return n;
}

static void run_call(ctx_t *c) {
  const Meshd__Agent__V1__OpCall *call = c->ins->call;
  held_t *h = held_get();
  meshd_error_t e = {0};
  uint64_t outs[OP_MAX_RESULTS * 2];
  size_t nouts = 0;
  for (size_t i = 0; i < call->n_results && i < OP_MAX_RESULTS; i++) outs[nouts++] = call->results[i]->ref;
  if (!h) {
    error_set(&e, ERR_QUOTA, "%s: agent out of memory", call->op);
    root_failure(c, outs, nouts, &e);
    return;
  }
  op_value_t pos[16];
  op_kwarg_t kw[16];
  size_t npos = call->n_args < 16 ? call->n_args : 16, nkw = call->n_kwargs < 16 ? call->n_kwargs : 16;
  agent_tensor_t res[OP_MAX_RESULTS] = {0};
  agent_tensor_t *resp[OP_MAX_RESULTS];
  op_args_t args;
  op_infer_t inf = {0};
  const op_def_t *op = ops_find(call->op);
  for (size_t i = 0; i < call->n_results; i++) {
    if (!check_fresh(c, call->results[i]->ref, call->op, &e)) continue;
    report(c, e.kind, e.msg, call->results[i]->ref);
    return;
  }
  int rc = need_backend(c, call->op, &e);
  if (!rc && !op) rc = error_set(&e, ERR_REMOTE_FAILURE, "Call: unknown op '%s'", call->op);
  for (size_t i = 0; !rc && i < npos; i++) rc = resolve(c, h, call->args[i], &pos[i], &e);
  for (size_t i = 0; !rc && i < nkw; i++) {
    kw[i].name = call->kwargs[i]->name;
    rc = call->kwargs[i]->value ? resolve(c, h, call->kwargs[i]->value, &kw[i].value, &e) : -1;
  }
  if (h->failed) {
    /* What it writes in place fails with it; not the failed input itself,
     * which keeps its own root. */
    nouts = call_written_refs(call, h->failed_ref, outs, nouts, OP_MAX_RESULTS * 2);
    if (h->why.root_seq == c->ins->seq) {
      error_set(&e, ERR_REMOTE_FAILURE, "%s: %.500s", call->op, h->why.msg);
      root_failure(c, outs, nouts, &e);
    } else {
      dependent_failure(c, outs, nouts, h->failed_ref, &h->why);
    }
    goto out;
  }
  if (rc || ops_bind(op, pos, npos, kw, nkw, &args, &e) || ops_infer(&args, &inf, &e)) goto fail;
  /* The server ran the same rule: the results it named are the ones it gives. */
  if (call->n_results != (size_t)inf.nresults && !(op->is_inplace && call->n_results == 0)) {
    error_set(&e, ERR_REMOTE_FAILURE, "%s returns %d tensor%s but the instruction names %zu result%s",
              call->op, inf.nresults, inf.nresults == 1 ? "" : "s", call->n_results,
              call->n_results == 1 ? "" : "s");
    goto fail;
  }
  for (size_t i = 0; i < call->n_results; i++) {
    tensor_meta_t m;
    if (validate_spec_meta(call->results[i], "", &m, &e) == 0 && same_meta(&m, &inf.results[i].meta))
      continue;
    char what[48]; /* named only on failure: formatting it is most of the check's cost */
    snprintf(what, sizeof what, "%s: results[%zu]", call->op, i);
    if (validate_spec_meta(call->results[i], what, &m, &e) == 0)
      differs(&e, what, &m, "what its inputs give", &inf.results[i].meta);
    goto fail;
  }
  for (int i = 0; i < inf.nresults; i++) {
    const op_result_t *r = &inf.results[i];
    resp[i] = &res[i];
    if (r->alias_param >= 0 && args.v[r->alias_param].kind == VAL_TENSOR) {
      res[i].meta = r->meta;
      res[i].storage = agent_tensor_of(args.v[r->alias_param].tensor)->storage;
      storage_retain(res[i].storage);
    } else if (tensor_alloc(c->b, c->bs, &r->meta, &res[i], call->op, &e)) {
      goto fail;
    }
  }
  for (int m = 0; m < inf.nmutates && nouts < OP_MAX_RESULTS * 2; m++)
    if (args.v[inf.mutates[m]].kind == VAL_TENSOR) outs[nouts++] = ref_of_meta(h, args.v[inf.mutates[m]].tensor);
  /* Where its kernel would fail (fault.h: call:fail), what it writes in
   * place failing with it. */
  if (injected(c, "call", call->op, &e) != 0) goto fail;
  /* A Fetch still reading what this op overwrites keeps the value it was
   * promised (snapshot.h). */
  for (int m = 0; m < inf.nmutates; m++)
    if (args.v[inf.mutates[m]].kind == VAL_TENSOR &&
        snapshot_before_write(c->b, agent_tensor_of(args.v[inf.mutates[m]].tensor)->storage, &e))
      goto fail;
  /* Kernel messages name the rank: this agent's world rank (-1: not known yet). */
  int64_t me = c->env->rank ? atomic_load(c->env->rank) : -1;
  if (c->b->ops->run_op(c->b, c->bs, &args, resp, inf.nresults, &inf, me < 0 ? 0 : (uint32_t)me, 0,
                        &e))
    goto fail;
  for (size_t i = 0; i < call->n_results && i < (size_t)inf.nresults; i++)
    define(c, call->results[i]->ref, &res[i], call->op);
  goto out;
fail:
  root_failure(c, outs, nouts, &e);
out:
  for (int i = 0; i < OP_MAX_RESULTS; i++) storage_release(res[i].storage);
  held_release(h);
}

/* ------------------------------------------------------------------ refs, borrows */

static void run_delete(ctx_t *c) {
  const Meshd__Agent__V1__DeleteRefs *d = c->ins->delete_refs;
  for (size_t i = 0; i < d->n_refs; i++)
    session_state_delete(c->s, c->ins->stream, c->ins->seq, c->bs, d->refs[i]);
}

static void run_borrow(ctx_t *c) {
  const Meshd__Agent__V1__BorrowOp *b = c->ins->borrow;
  switch (b->phase) {
    case MESHD__AGENT__V1__BORROW_OP__PHASE__CREATE: {
      agent_tensor_t t;
      ref_failure_t why;
      meshd_error_t e;
      if (check_fresh(c, b->result, "Borrow", &e)) {
        report(c, e.kind, e.msg, b->result);
        break;
      }
      int rc = session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, b->tensor, &t, &why);
      if (rc == 0) {
        define(c, b->result, &t, "Borrow");
        storage_release(t.storage);
      } else if (rc == 1) {
        /* Reported, as any reader's: the server may have accepted the Borrow
         * before it learned of the failure, and must fail the handle on
         * every rank (a borrow of a failed tensor is a failed handle). */
        dependent_failure(c, &b->result, 1, b->tensor, &why);
        /* Failed before the borrow (by_sharing: through a view, reported for
         * that view, whose aliases the server fails): the handle brings it no
         * failure, and its last use must not report it for the origin again
         * (a second rank's report under another command: 'failed on several
         * ranks', and a fetch planned before the failure failed). */
        refs_told(&c->s->refs, b->tensor);
      } else { /* never defined here: a root failure, as any reader's (hold) */
        error_set(&e, ERR_REMOTE_FAILURE, "Borrow: tensor %llu is not on the agent",
                  (unsigned long long)b->tensor);
        root_failure(c, &b->result, 1, &e);
      }
      break;
    }
    case MESHD__AGENT__V1__BORROW_OP__PHASE__LAST_USE: {
      /* A failure written into the handle (a mutable borrow: a read one fails
       * only with its origin) is the origin's too, the same memory (Monarch's
       * last use makes the origin depend on the handle). The agent fails the
       * origin with it; the server learns of it only from a report for the
       * origin, since it may have dropped the borrow, and with it the link
       * from the handle to the origin, before the handle's report came. */
      agent_tensor_t h = {0}, org = {0};
      ref_failure_t why = {0}, owhy;
      int rc = session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, b->result, &h, &why);
      if (rc == 0) storage_release(h.storage);
      /* A handle dropped before (Drop, then DropBorrow): its failure failed
       * the origin here already (refs: the same storage). */
      int orc = rc != 0 ? refs_get(&c->s->refs, b->tensor, &org, &owhy) : -1;
      if (orc == 0) storage_release(org.storage);
      if (orc == 0 && rc == 1) {
        dependent_failure(c, &b->tensor, 1, b->result, &why);
      } else if (orc == 1 && owhy.by_sharing) {
        /* Failed with the handle here (the same memory), and reported for the
         * handle only: the server hears of it for the origin now. An origin
         * that failed on its own (a read borrow of a failed tensor) was
         * reported when it failed: a second report would name the borrow's
         * seq and command, and make a fetch planned before count it. */
        char msg[sizeof why.msg];
        if (rc != 1) why = owhy;
        if (why.kind == ERR_DEPENDENT_FAILURE) snprintf(msg, sizeof msg, "%s", why.msg);
        else
          snprintf(msg, sizeof msg, "depends on tensor %llu, which failed (seq %llu): %.500s",
                   (unsigned long long)b->result, (unsigned long long)why.root_seq, why.msg);
        report(c, ERR_DEPENDENT_FAILURE, msg, b->tensor);
      }
      session_state_delete(c->s, c->ins->stream, c->ins->seq, c->bs, b->result);
      break;
    }
    case MESHD__AGENT__V1__BORROW_OP__PHASE__DROP:
      session_state_end_borrow(c->s, b->borrow, c->ins->stream, c->ins->seq, c->bs);
      break;
    default:
      break;
  }
}

/* ------------------------------------------------------------------ data plane */

/* Collectives and sends run on device buffers (the backend's memory):
 * contiguous tensors allocated on the instruction's stream. */

/* A fresh contiguous tensor of m's shape on the instruction's stream holding
 * src's values, or zeros when src is NULL (a failed input takes part as
 * zeros). */
static int staged(ctx_t *c, const tensor_meta_t *m, const agent_tensor_t *src, agent_tensor_t *out,
                  const char *what, meshd_error_t *e) {
  if (tensor_alloc(c->b, c->bs, m, out, what, e)) return -1;
  if (src) return c->b->ops->copy(c->b, c->bs, out, src, e);
  size_t n = tensor_nbytes(m);
  void *zeros = calloc(1, n ? n : 1);
  if (!zeros) return error_set(e, ERR_QUOTA, "%s: agent out of host memory", what);
  int rc = c->b->ops->from_host(c->b, c->bs, out, zeros, e);
  free(zeros);
  return rc;
}

/* A one-element device tensor holding v (int64); *out released by the caller. */
/* A call of several data-plane steps failed midway (a local error between
 * them): the comm's connections go, so that the peers fail now instead of
 * waiting out --comm-timeout-ms. (A frame left in them could not mislead the
 * next call on the comm anyway: it carries this call's number.) */
static void abandon_comm(ctx_t *c, uint64_t comm_id) {
  if (c->b->net) dataplane_drop_comm(c->b->net, comm_id);
}

/* The same for one transfer of a ToMesh, whose channel other pairs share
 * (and this agent's other streams): only its link to (or from) the peer. */
static void abandon_link(ctx_t *c, uint64_t comm_id, uint32_t peer, bool outgoing) {
  if (c->b->net) dataplane_drop_link(c->b->net, comm_id, peer, outgoing);
}

static int scalar_tensor(ctx_t *c, int64_t v, agent_tensor_t *out, meshd_error_t *e) {
  tensor_meta_t m = {.dtype = DTYPE_INT64, .layout = {.ndim = 0}};
  layout_make_contiguous(&m.layout);
  if (tensor_alloc(c->b, c->bs, &m, out, "data plane", e)) return -1;
  return c->b->ops->from_host(c->b, c->bs, out, &v, e);
}

static int my_index(ctx_t *c, const Meshd__Agent__V1__Group *g, size_t *me) {
  const run_env_t *env = c->env;
  int64_t rank = env->rank ? atomic_load(env->rank) : -1;
  for (size_t i = 0; i < g->n_ranks; i++) {
    if (rank >= 0 && g->ranks[i] == (uint32_t)rank) {
      *me = i;
      return 0;
    }
    if (rank < 0 && env->data_address && i < g->n_addresses &&
        !strcmp(g->addresses[i], env->data_address)) {
      *me = i;
      return 0;
    }
  }
  return -1;
}

/* Runs the reduction r over the group on `work` (im's elements, contiguous).
 * The result, rm's elements, is `work` itself (in-place variants, one
 * member) or a fresh tensor; *res holds a reference either way.
 * *any_failed becomes whether any member's input failed. */
/* Fault injection (fault.h) for an instruction of kind `where`: 0 to run it
 * as is, 1 to run it as if its input had failed with e (so that its peers,
 * which take part as usual, stay in step), -1 with e after a hang. */
static int injected(ctx_t *c, const char *where, const char *what, meshd_error_t *e) {
  int ms = 0;
  int64_t rank = c->env->rank ? atomic_load(c->env->rank) : -1;
  switch (fault_hit(c->env->fault, where, rank, &ms)) {
    case FAULT_NONE:
    case FAULT_OLD: return 0; /* hello:old is the registration's */
    case FAULT_SLOW: {
      struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
      return 0;
    }
    case FAULT_FAIL:
      error_set(e, ERR_REMOTE_FAILURE, "%s: injected fault (MESHD_FAULT) (rank %lld)", what,
                (long long)rank);
      return 1;
    case FAULT_HANG: {
      log_warn("run", "session %.8s seq %" PRIu64 ": %s hangs (injected fault)", c->s->id,
               c->ins->seq, what);
      bool ended = session_state_wait_lost(c->s, ms > 0 ? ms : 3600000);
      return error_set(e, ERR_REMOTE_FAILURE, "%s: injected hang on rank %lld ended (%s)", what,
                       (long long)rank, ended ? "a peer was lost or the session ended" : "timed out");
    }
  }
  return 0;
}

/* Data plane calls an instruction may make, in order (a collective and its
 * failure flag; a header and a body): each gets its own number, the server's
 * Group.call (SendTensor.call) times this plus its step. */
#define CALL_STEPS 4

/* The data plane group of an instruction's Group, for member `me`: its
 * addresses into addrs[256] and its secret, checked; the comm noted for the
 * session's end. 0, or -1 with e naming `what`. */
static int join_group(ctx_t *c, const Meshd__Agent__V1__Group *g, size_t me, const uint64_t *since,
                      const char *what, const char **addrs, dp_group_t *out, meshd_error_t *e) {
  size_t n = g->n_ranks;
  if (g->n_addresses < n || n > 256)
    return error_set(e, ERR_REMOTE_FAILURE, "%s: the group lacks data plane addresses", what);
  for (size_t i = 0; i < n; i++) addrs[i] = g->addresses[i];
  if (g->secret.len != DP_SECRET_LEN)
    return error_set(e, ERR_BAD_ARGUMENT,
                     "%s: the instruction's group has a %zu-byte secret where %d bytes are "
                     "needed to join its data plane connections (a server older than this agent "
                     "sends none: upgrade the server)",
                     what, g->secret.len, DP_SECRET_LEN);
  *out = (dp_group_t){.comm_id = g->comm_id, .call = g->call * CALL_STEPS, .session = c->s->key,
                      .ranks = g->ranks, .addrs = addrs, .n = n, .me = me, .since = since,
                      .secret = g->secret.data,
                      .pair_secrets = g->pair_secrets.len == n * DP_SECRET_LEN
                                          ? g->pair_secrets.data
                                          : NULL};
  session_state_note_comm(c->s, g->comm_id);
  return 0;
}

void run_expect(const run_env_t *env, const Meshd__Agent__V1__Instruction *ins) {
  const Meshd__Agent__V1__Group *g = NULL;
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE && ins->reduce)
    g = ins->reduce->group;
  else if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST && ins->broadcast)
    g = ins->broadcast->group;
  dataplane_t *net = env->backend ? env->backend->net : NULL;
  if (!g || !net || g->n_ranks < 2 || g->secret.len != DP_SECRET_LEN) return;
  dp_group_t dg = {.comm_id = g->comm_id, .ranks = g->ranks, .n = g->n_ranks,
                   .secret = g->secret.data,
                   .pair_secrets = g->pair_secrets.len == g->n_ranks * DP_SECRET_LEN
                                       ? g->pair_secrets.data
                                       : NULL};
  dataplane_expect(net, &dg); /* best effort: without it, early hellos wait as before */
}

/* The instruction fails on this agent before it joined the data plane call
 * of group g (a collective or a broadcast) that its peers run: they are told
 * why now (backend refuse, dataplane.h's dp_refuse), instead of waiting out
 * --comm-timeout-ms for it. Blocks as the call would have, until each peer
 * reached the call. Nothing when it joined already, or when it could not
 * have (not a member, no secret: its peers fail the same way). */
static void refuse_group(ctx_t *c, const Meshd__Agent__V1__Group *g, const uint64_t *since,
                         const char *what, const meshd_error_t *why) {
  size_t me = 0;
  const char *addrs[256];
  dp_group_t grp;
  meshd_error_t ignored;
  if (c->joined || !c->b || !c->b->ops->refuse || !g || g->n_ranks < 2 ||
      session_state_closing(c->s) || my_index(c, g, &me) ||
      join_group(c, g, me, since, what, addrs, &grp, &ignored))
    return;
  c->joined = true;
  c->b->ops->refuse(c->b, &grp, DP_REFUSE_GROUP, CALL_STEPS, why->msg);
}

/* The same for a ToMesh transfer's side (st: this agent's SendTensor). */
static void refuse_link(ctx_t *c, const Meshd__Agent__V1__SendTensor *st, const meshd_error_t *why) {
  if (c->joined || !c->b || !c->b->ops->refuse || !st->input == !st->result ||
      st->secret.len != DP_SECRET_LEN || !st->peer_address || session_state_closing(c->s))
    return;
  uint32_t peer = st->input ? st->to_rank : st->from_rank;
  const char *addrs[1] = {st->peer_address};
  dp_group_t g = {.comm_id = st->comm_id, .call = st->call * CALL_STEPS, .session = c->s->key,
                  .ranks = &peer, .addrs = addrs, .n = 1, .secret = st->secret.data};
  session_state_note_comm(c->s, st->comm_id);
  c->joined = true;
  c->b->ops->refuse(c->b, &g, st->input ? DP_REFUSE_SEND : DP_REFUSE_RECV, CALL_STEPS, why->msg);
}

static int collective(ctx_t *c, const Meshd__Agent__V1__ReduceOp *ro, reduction_t red,
                      const Meshd__Agent__V1__Group *g, agent_tensor_t *work,
                      const tensor_meta_t *rm, agent_tensor_t *res, int *any_failed,
                      const uint64_t *since, meshd_error_t *e) {
  const Meshd__V1__Reduce *r = ro->reduce;
  size_t n = g->n_ranks, me = 0, in_count = (size_t)layout_numel(&work->meta.layout);
  dtype_t dt = work->meta.dtype;
  bool stack = !reduction_combines(red);
  const backend_ops_t *ops = c->b->ops;
  bool gather_root = ro->rooted && stack && ops->gather_root;
  if (n > 1 && my_index(c, g, &me))
    return error_set(e, ERR_REMOTE_FAILURE, "Reduce: this agent is not in the group it was sent");
  if (n <= 1 || (!stack && !r->scatter)) { /* one member: every variant is the identity */
    *res = (agent_tensor_t){.meta = *rm, .storage = work->storage};
    layout_make_contiguous(&res->meta.layout);
    storage_retain(res->storage);
    if (n <= 1) return 0;
  } else if (gather_root && me != ro->root) {
    /* Only the root receives a rooted gather (n times the input): the others
     * send and allocate nothing, as the server's room check counts them. */
  } else if (tensor_alloc(c->b, c->bs, rm, res, "Reduce", e)) {
    return -1;
  }
  if (!c->b->net)
    return error_set(e, ERR_REMOTE_FAILURE, "Reduce: this agent has no data plane");
  const char *addrs[256];
  dp_group_t grp;
  if (join_group(c, g, me, since, "Reduce", addrs, &grp, e)) return -1;
  void *in = work->storage->data, *out = res->storage ? res->storage->data : NULL;
  int rc;
  c->joined = true;
  if (gather_root)
    rc = ops->gather_root(c->b, c->bs, &grp, ro->root, in, out, in_count, dt, e);
  else if (ro->rooted && !stack && ops->reduce_root)
    rc = ops->reduce_root(c->b, c->bs, &grp, ro->root, in, in_count, dt, red, e);
  else if (stack && !r->scatter) rc = c->b->ops->allgather(c->b, c->bs, &grp, in, out, in_count, dt, e);
  else if (stack) rc = c->b->ops->alltoall(c->b, c->bs, &grp, in, out, in_count / n, dt, e);
  else if (r->scatter)
    rc = c->b->ops->reduce_scatter(c->b, c->bs, &grp, in, out, in_count / n, dt, red, e);
  else
    rc = c->b->ops->allreduce(c->b, c->bs, &grp, in, in_count, dt, red, e);
  if (rc) return rc;
  count_bytes(c, (uint64_t)(in_count * dtype_size(dt)));
  /* A failure on any member fails the result everywhere. */
  agent_tensor_t flag = {0};
  int64_t f = *any_failed;
  rc = scalar_tensor(c, f, &flag, e);
  if (rc) abandon_comm(c, grp.comm_id); /* the peers are in the flag's allreduce */
  grp.call++;
  if (!rc) rc = c->b->ops->allreduce(c->b, c->bs, &grp, flag.storage->data, 1, DTYPE_INT64, RED_MAX, e);
  if (!rc) rc = c->b->ops->to_host(c->b, c->bs, &flag, &f, e);
  storage_release(flag.storage);
  *any_failed = rc ? *any_failed : (int)f;
  return rc;
}

/* A tensor the instruction reads, held in *t, is what its spec says (the
 * spec is what the kernels and the peers go by): 0, or -1 with why filled
 * as this instruction's root failure. */
static int matches_spec(ctx_t *c, const agent_tensor_t *t, const spec_t *sp, const char *what,
                        ref_failure_t *why) {
  tensor_meta_t m;
  meta_of_spec(sp, &m);
  if (same_meta(&t->meta, &m)) return 0;
  meshd_error_t e;
  char field[64], actual[64];
  snprintf(field, sizeof field, "%s: the instruction's input", what);
  snprintf(actual, sizeof actual, "tensor %llu on this agent", (unsigned long long)sp->ref);
  differs(&e, field, &m, actual, &t->meta);
  why->kind = ERR_REMOTE_FAILURE;
  why->root_seq = c->ins->seq;
  why->root_ref = sp->ref;
  snprintf(why->msg, sizeof why->msg, "%s", e.msg);
  return -1;
}

/* Rules of the instruction alone (shapes, dtypes, the group, the result the
 * reduction gives) were checked before it was queued (validate.h): every
 * member gets the same instruction, so all of them agree on that outcome and
 * none is left waiting in the collective. What this agent holds is checked
 * here; a mismatch counts as a failed input, which still takes part (as
 * zeros) so that the peers are not left waiting either. */
static void run_reduce(ctx_t *c) {
  const Meshd__Agent__V1__ReduceOp *ro = c->ins->reduce;
  const Meshd__V1__Reduce *r = ro->reduce;
  uint64_t res_ref = ro->result->ref;
  meshd_error_t e = {0};
  agent_tensor_t in = {0}, work = {0}, res = {0}, target = {0};
  ref_failure_t why = {0};
  tensor_meta_t im, rm;
  meta_of_spec(ro->input, &im);
  meta_of_spec(ro->result, &rm);
  reduction_t red = reduction_parse(r->reduction);
  bool in_place = r->inplace, into_out = r->out && res_ref == r->out;
  /* Onto a sub-mesh, the members outside it take part and keep nothing. */
  size_t me = 0;
  bool keep = !ro->rooted || (!my_index(c, ro->group, &me) && me == ro->root);
  if (keep && !in_place && !into_out && check_fresh(c, res_ref, "Reduce", &e)) {
    refuse_group(c, ro->group, NULL, "Reduce", &e);
    report(c, e.kind, e.msg, res_ref);
    return;
  }
  /* The generation first: a peer lost after it fails the collective itself. */
  uint64_t since = c->b && c->b->net ? dataplane_generation(c->b->net) : 0;
  /* A peer lost: every member learns it from the server; nobody to tell. */
  bool tell = false;
  if (need_backend(c, "Reduce", &e) ||
      session_state_check_peers(c->s, ro->group->ranks, ro->group->n_ranks, c->ins->seq,
                                "Reduce", &e))
    goto fail;
  tell = true;
  int got =
      session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, ro->input->ref, &in, &why);
  if (got < 0) {
    why.kind = ERR_REMOTE_FAILURE;
    why.root_seq = c->ins->seq;
    snprintf(why.msg, sizeof why.msg, "Reduce: tensor %llu is not on the agent",
             (unsigned long long)ro->input->ref);
  } else if (got == 0 && matches_spec(c, &in, ro->input, "Reduce", &why)) {
    got = 1;
  }
  int failed = got != 0;
  meshd_error_t fault = {0};
  int inj = injected(c, "reduce", "Reduce", &fault);
  if (inj < 0) { /* after a hang: the peers are long gone, or learn it from the server */
    e = fault;
    tell = false;
    goto fail;
  }
  if (inj > 0) failed = 1; /* the peers learn it through the failure flag */
  if (staged(c, &im, got == 0 && !inj ? &in : NULL, &work, "Reduce", &e) ||
      collective(c, ro, red, ro->group, &work, &rm, &res, &failed, &since, &e))
    goto fail;
  if (inj > 0) {
    e = fault;
    goto fail;
  }
  if (failed && got != 0 && why.root_seq == c->ins->seq) { /* this instruction's own failure */
    error_set(&e, ERR_REMOTE_FAILURE, "%s", why.msg);
    goto fail;
  }
  if (!keep) { /* the result does not live here: tell the server, record nothing */
    if (got != 0) {
      char msg[sizeof why.msg];
      if (why.kind == ERR_DEPENDENT_FAILURE) snprintf(msg, sizeof msg, "%s", why.msg);
      else snprintf(msg, sizeof msg, "depends on tensor %llu, which failed (seq %llu): %.480s",
                    (unsigned long long)ro->input->ref, (unsigned long long)why.root_seq, why.msg);
      report(c, ERR_DEPENDENT_FAILURE, msg, res_ref);
    }
    goto out;
  }
  if ((in_place && got == 0) || r->out) {
    if (in_place && got == 0) {
      target = in;
      storage_retain(target.storage);
    } else if (session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, r->out, &target,
                                 NULL) != 0) {
      error_set(&e, ERR_REMOTE_FAILURE, "Reduce: out tensor %llu is not usable on the agent",
                (unsigned long long)r->out);
      goto fail;
    } else if (!same_meta(&target.meta, &rm)) {
      char what[64];
      snprintf(what, sizeof what, "Reduce: out tensor %llu", (unsigned long long)r->out);
      differs(&e, what, &target.meta, "the result", &rm);
      goto fail;
    }
    agent_tensor_t view = {.meta = target.meta, .storage = res.storage};
    layout_make_contiguous(&view.meta.layout);
    if (snapshot_before_write(c->b, target.storage, &e) ||
        c->b->ops->copy(c->b, c->bs, &target, &view, &e))
      goto fail;
  } else {
    target = res;
    storage_retain(target.storage);
  }
  if (failed) {
    if (got != 0) dependent_failure(c, &res_ref, 1, ro->input->ref, &why);
    else {
      ref_failure_t f = {.kind = ERR_DEPENDENT_FAILURE, .root_seq = c->ins->seq};
      snprintf(f.msg, sizeof f.msg, "Reduce: the input failed on another member of the group");
      refs_fail(&c->s->refs, res_ref, &f);
    }
  } else {
    define(c, res_ref, &target, "Reduce");
  }
  goto out;
fail:
  if (tell) refuse_group(c, ro->group, &since, "Reduce", &e);
  if (keep) root_failure(c, &res_ref, 1, &e);
  else report(c, e.kind == ERR_QUOTA || e.kind == ERR_AGENT_LOST ? e.kind : ERR_REMOTE_FAILURE,
              e.msg, res_ref); /* told, not recorded: the result does not live here */
out:
  storage_release(in.storage);
  storage_release(work.storage);
  storage_release(res.storage);
  storage_release(target.storage);
}

/* to_mesh's broadcast (BroadcastOp): a failure flag, then the bytes (zeros
 * when the source's input failed), down the chain; the destinations keep
 * them, or a failed result. A destination's own failure (an injected fault)
 * fails its result only after it forwarded, so the chain below it completes. */
static void run_broadcast(ctx_t *c) {
  const Meshd__Agent__V1__BroadcastOp *bo = c->ins->broadcast;
  const Meshd__Agent__V1__Group *g = bo->group;
  meshd_error_t e = {0}, fault = {0};
  agent_tensor_t in = {0}, buf = {0}, hdr_t = {0};
  ref_failure_t why = {0};
  size_t me = 0;
  if (my_index(c, g, &me)) {
    error_set(&e, ERR_REMOTE_FAILURE, "ToMesh: this agent is not in the broadcast it was sent");
    report(c, e.kind, e.msg, bo->result->ref);
    return;
  }
  bool source = me == 0;
  uint64_t res_ref = source ? 0 : bo->result->ref;
  if (!source && check_fresh(c, res_ref, "ToMesh", &e)) {
    refuse_group(c, g, NULL, "ToMesh", &e);
    report(c, e.kind, e.msg, res_ref);
    return;
  }
  uint64_t since = c->b && c->b->net ? dataplane_generation(c->b->net) : 0;
  bool tell = false; /* as in run_reduce */
  if (need_backend(c, "ToMesh", &e) ||
      session_state_check_peers(c->s, g->ranks, g->n_ranks, c->ins->seq, "ToMesh", &e))
    goto fail;
  tell = true;
  if (!c->b->net) {
    error_set(&e, ERR_REMOTE_FAILURE, "ToMesh: this agent has no data plane");
    goto fail;
  }
  const char *addrs[256];
  dp_group_t grp;
  if (join_group(c, g, me, &since, "ToMesh", addrs, &grp, &e)) goto fail;
  int got = 1;
  if (source) {
    got = session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, bo->input->ref, &in, &why);
    if (got < 0) {
      why.kind = ERR_REMOTE_FAILURE;
      why.root_seq = c->ins->seq;
      snprintf(why.msg, sizeof why.msg, "ToMesh: tensor %llu is not on the agent",
               (unsigned long long)bo->input->ref);
    } else if (got == 0 && matches_spec(c, &in, bo->input, "ToMesh", &why)) {
      got = 1;
    }
  }
  int inj = injected(c, "send", "ToMesh", &fault);
  if (inj < 0) {
    e = fault;
    tell = false;
    goto fail;
  }
  if (source && inj > 0) { /* the destinations get the failure flag, the server the root */
    report(c, fault.kind, fault.msg, 0);
    got = 1;
  } else if (source && got != 0 && why.root_seq == c->ins->seq) {
    report(c, why.kind, why.msg, 0);
  }
  tensor_meta_t m;
  meta_of_spec(bo->result, &m);
  int64_t hdr = 0;
  if (scalar_tensor(c, source ? got != 0 : 0, &hdr_t, &e) ||
      (source ? staged(c, &m, got == 0 ? &in : NULL, &buf, "ToMesh", &e)
              : tensor_alloc(c->b, c->bs, &m, &buf, "ToMesh", &e)))
    goto fail;
  c->joined = true;
  if (c->b->ops->broadcast(c->b, c->bs, &grp, hdr_t.storage->data, sizeof(int64_t), &e) ||
      (grp.call++, c->b->ops->broadcast(c->b, c->bs, &grp, buf.storage->data, tensor_nbytes(&m), &e)) ||
      c->b->ops->to_host(c->b, c->bs, &hdr_t, &hdr, &e))
    goto fail;
  if (source) {
    count_bytes(c, (uint64_t)tensor_nbytes(&m));
    goto out;
  }
  if (inj > 0) {
    e = fault;
    goto fail;
  }
  if (hdr) {
    ref_failure_t f = {.kind = ERR_DEPENDENT_FAILURE, .root_seq = c->ins->seq};
    snprintf(f.msg, sizeof f.msg, "ToMesh: the source tensor failed on rank %u", g->ranks[0]);
    refs_fail(&c->s->refs, res_ref, &f);
    /* Told: no one else does (the source knows no result ref), and the
     * server fails the result on every rank. */
    report(c, ERR_DEPENDENT_FAILURE, f.msg, res_ref);
    goto out;
  }
  define(c, res_ref, &buf, "ToMesh");
  goto out;
fail:
  if (tell) refuse_group(c, g, &since, "ToMesh", &e);
  if (res_ref) root_failure(c, &res_ref, 1, &e);
  else log_warn("run", "session %.8s seq %" PRIu64 ": broadcast failed: %s", c->s->id, c->ins->seq,
                e.msg);
out:
  storage_release(in.storage);
  storage_release(buf.storage);
  storage_release(hdr_t.storage);
}

/* A ToMesh's peer declared lost since the data plane's generation was
 * `since` (read before the instruction checked its peers): the transfer
 * would wait out the comm timeout for it. 0, or -1 with e (AGENT_LOST). The
 * executor records a loss in the session before the data plane counts it,
 * so a changed generation finds it there. */
static int lost_since(ctx_t *c, uint32_t peer, uint64_t since, meshd_error_t *e) {
  if (dataplane_generation(c->b->net) == since) return 0;
  return session_state_check_peers(c->s, &peer, 1, c->ins->seq, "ToMesh", e);
}

static void run_send(ctx_t *c) {
  const Meshd__Agent__V1__SendTensor *st = c->ins->send;
  meshd_error_t e = {0};
  agent_tensor_t in = {0}, out = {0}, hdr_t = {0};
  ref_failure_t why = {0};
  uint64_t res_ref = st->result ? st->result->ref : 0;
  int got = -1;
  if (res_ref && check_fresh(c, res_ref, "ToMesh", &e)) {
    refuse_link(c, st, &e);
    report(c, e.kind, e.msg, res_ref);
    return;
  }
  bool tell = false; /* as in run_reduce */
  if (need_backend(c, "ToMesh", &e)) goto fail;
  if (st->input) {
    got = session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, st->input->ref, &in,
                            &why);
    if (got < 0) {
      why.kind = ERR_REMOTE_FAILURE;
      why.root_seq = c->ins->seq;
      snprintf(why.msg, sizeof why.msg, "ToMesh: tensor %llu is not on the agent",
               (unsigned long long)st->input->ref);
    } else if (got == 0 && matches_spec(c, &in, st->input, "ToMesh", &why)) {
      got = 1;
    }
  }
  bool own = got != 0 && why.root_seq == c->ins->seq; /* failed here, not upstream */
  if (st->input && st->result) { /* same agent: a deep copy */
    if (own) {
      error_set(&e, ERR_REMOTE_FAILURE, "%s", why.msg);
      goto fail;
    }
    if (got != 0) {
      dependent_failure(c, &res_ref, 1, st->input->ref, &why);
      goto out;
    }
    tensor_meta_t rm;
    meta_of_spec(st->result, &rm);
    if (tensor_alloc(c->b, c->bs, &rm, &out, "ToMesh", &e) ||
        c->b->ops->copy(c->b, c->bs, &out, &in, &e))
      goto fail;
    define(c, res_ref, &out, "ToMesh");
    goto out;
  }
  if (!c->b->net) {
    error_set(&e, ERR_REMOTE_FAILURE, "ToMesh: this agent has no data plane");
    goto fail;
  }
  if (st->secret.len != DP_SECRET_LEN) {
    error_set(&e, ERR_BAD_ARGUMENT,
              "ToMesh: the instruction has a %zu-byte secret where %d bytes are needed to join "
              "its data plane channel (a server older than this agent sends none: upgrade the "
              "server)",
              st->secret.len, DP_SECRET_LEN);
    goto fail;
  }
  uint32_t peer = st->input ? st->to_rank : st->from_rank;
  /* The generation first, as a collective's: a loss declared after it is
   * checked for again just before the transfer (sends take no `since`). */
  uint64_t since = dataplane_generation(c->b->net);
  if (session_state_check_peers(c->s, &peer, 1, c->ins->seq, "ToMesh", &e)) goto fail;
  meshd_error_t fault = {0};
  int inj = injected(c, "send", "ToMesh", &fault);
  if (inj < 0 || (inj > 0 && !st->input)) { /* a receiver's fault: its result fails */
    e = fault;
    tell = inj > 0; /* after a hang, the sender is long gone */
    goto fail;
  }
  tell = true;
  if (inj > 0) { /* a sender's: the receiver gets the failure flag, the server the root */
    report(c, fault.kind, fault.msg, 0);
    got = 1;
  } else if (own && st->input) { /* likewise */
    report(c, why.kind, why.msg, 0);
  }
  tensor_meta_t m;
  meta_of_spec(st->input ? st->input : st->result, &m);
  size_t bytes = tensor_nbytes(&m);
  uint64_t key = c->s->key;
  session_state_note_comm(c->s, st->comm_id);
  /* Two data plane calls: the header, then the body. A call that fails has
   * settled its own link (dataplane.h); a local failure closes the pair's
   * link, so that the peer fails now rather than at the timeout. */
  uint64_t call = st->call * CALL_STEPS;
  if (st->input) { /* sender: a failure flag, then the bytes (zeros if failed) */
    bool local = scalar_tensor(c, got != 0, &hdr_t, &e) ||
                 staged(c, &m, got == 0 ? &in : NULL, &out, "ToMesh", &e);
    if (local) refuse_link(c, st, &e);
    else if (lost_since(c, peer, since, &e)) local = true; /* nobody to tell */
    else c->joined = true;
    if (local ||
        c->b->ops->send(c->b, c->bs, key, st->comm_id, call, st->secret.data, st->to_rank,
                        st->peer_address, hdr_t.storage->data, sizeof(int64_t), &e) ||
        c->b->ops->send(c->b, c->bs, key, st->comm_id, call + 1, st->secret.data, st->to_rank,
                        st->peer_address, out.storage->data, bytes, &e)) {
      log_event(LOG_LEVEL_WARN, "run", &(log_fields_t){.session = c->s->id, .seq = c->ins->seq},
                "session %.8s seq %" PRIu64 ": send to rank %u failed: %s", c->s->id,
                c->ins->seq, st->to_rank, e.msg);
    } else {
      count_bytes(c, (uint64_t)bytes);
    }
    goto out;
  }
  int64_t hdr = 0;
  /* Both tensors before the first recv, so that no local failure falls
   * between the header and the body. */
  if (scalar_tensor(c, 0, &hdr_t, &e) || tensor_alloc(c->b, c->bs, &m, &out, "ToMesh", &e))
    goto fail;
  if (lost_since(c, peer, since, &e)) { /* the sender is gone: nobody to tell */
    tell = false;
    goto fail;
  }
  c->joined = true;
  if (c->b->ops->recv(c->b, c->bs, key, st->comm_id, call, st->secret.data, st->from_rank,
                      st->peer_address, hdr_t.storage->data, sizeof(int64_t), &e))
    goto fail;
  if (c->b->ops->to_host(c->b, c->bs, &hdr_t, &hdr, &e)) {
    abandon_link(c, st->comm_id, st->from_rank, false);
    goto fail;
  }
  if (c->b->ops->recv(c->b, c->bs, key, st->comm_id, call + 1, st->secret.data, st->from_rank,
                      st->peer_address, out.storage->data, bytes, &e))
    goto fail;
  if (hdr) {
    ref_failure_t f = {.kind = ERR_DEPENDENT_FAILURE, .root_seq = c->ins->seq};
    snprintf(f.msg, sizeof f.msg, "ToMesh: the source tensor failed on rank %u", st->from_rank);
    refs_fail(&c->s->refs, res_ref, &f);
    report(c, ERR_DEPENDENT_FAILURE, f.msg, res_ref); /* as a broadcast's receiver */
    goto out;
  }
  define(c, res_ref, &out, "ToMesh");
  goto out;
fail:
  if (tell) refuse_link(c, st, &e);
  if (res_ref) root_failure(c, &res_ref, 1, &e);
  else log_event(LOG_LEVEL_WARN, "run", &(log_fields_t){.session = c->s->id, .seq = c->ins->seq},
                 "session %.8s seq %" PRIu64 ": %s", c->s->id, c->ins->seq, e.msg);
out:
  storage_release(in.storage);
  storage_release(out.storage);
  storage_release(hdr_t.storage);
}

/* ------------------------------------------------------------------ snapshots */

/* Pins the ref as this point of the stream leaves it, for the Read of
 * (seq, ref) (snapshot.h). A failed or missing ref is kept as such. */
static void run_snapshot(ctx_t *c) {
  uint64_t ref = c->ins->snapshot->ref;
  agent_tensor_t t = {0};
  ref_failure_t why = {0};
  int rc = session_state_get(c->s, c->ins->stream, c->ins->seq, c->bs, ref, &t, &why);
  snapshot_t *snap = NULL;
  if (rc == 0 && c->b) {
    meshd_error_t e = {0};
    snap = snapshot_pin(c->b, c->bs, &t, &e);
    if (!snap) {
      rc = 1;
      why = (ref_failure_t){.kind = e.kind, .root_seq = c->ins->seq, .root_ref = ref};
      snprintf(why.msg, sizeof why.msg, "Snapshot of tensor %llu: %.400s",
               (unsigned long long)ref, e.msg);
    }
  } else if (rc == 0) {
    rc = 1;
    why = (ref_failure_t){.kind = ERR_REMOTE_FAILURE, .root_seq = c->ins->seq, .root_ref = ref};
    snprintf(why.msg, sizeof why.msg, "Snapshot: this agent has no compute backend");
  }
  storage_release(t.storage);
  session_state_keep_snapshot(c->s, c->ins->seq, ref, snap, rc, rc == 1 ? &why : NULL);
}

void run_instruction(const run_env_t *env, session_state_t *s, backend_stream_t *bs,
                     const Meshd__Agent__V1__Instruction *ins, run_failures_t *out) {
  ctx_t c = {env, s, ins, env->backend, bs, out, false};
  if (env->stats) atomic_fetch_add(&env->stats->instructions, 1);
  switch (ins->body_case) {
    case MESHD__AGENT__V1__INSTRUCTION__BODY_FACTORY: run_factory(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LOAD: run_load(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_LITERAL: run_literal(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_CALL: run_call(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_DELETE_REFS: run_delete(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BORROW: run_borrow(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE: run_reduce(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SEND: run_send(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST: run_broadcast(&c); break;
    case MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT: run_snapshot(&c); break;
    /* DropSnapshot, like RevokeGrants, is done as it arrives (executor.c),
     * never queued. */
    default: break;
  }
}

void run_refused(const run_env_t *env, session_state_t *s, const Meshd__Agent__V1__Instruction *ins,
                 const meshd_error_t *why, bool tell_peers, run_failures_t *out) {
  ctx_t c = {env, s, ins, env->backend, NULL, out, false};
  uint64_t refs[OP_MAX_RESULTS * 2 + 1];
  size_t cap = sizeof refs / sizeof refs[0];
  size_t n = validate_result_refs(ins, refs, cap);
  /* What a Call would have written in place (add_'s self) fails with it
   * too, as when it fails running (run_call): a later reader of it (a
   * Fetch's Snapshot) would read its old value as fine. */
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_CALL && ins->call)
    n = call_written_refs(ins->call, 0, refs, n, cap);
  /* Peers that run it wait for this agent in its data plane call: told. */
  bool reduce = ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_REDUCE && ins->reduce;
  bool bcast = ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_BROADCAST && ins->broadcast;
  bool send = ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_SEND && ins->send;
  if (tell_peers && (reduce || bcast))
    refuse_group(&c, reduce ? ins->reduce->group : ins->broadcast->group, NULL,
                 reduce ? "Reduce" : "ToMesh", why);
  else if (tell_peers && send)
    refuse_link(&c, ins->send, why);
  root_failure(&c, refs, n, why);
  if (ins->body_case == MESHD__AGENT__V1__INSTRUCTION__BODY_SNAPSHOT && ins->snapshot) {
    /* Its Read answers with the reason. */
    ref_failure_t f = {.kind = why->kind, .root_seq = ins->seq, .root_ref = ins->snapshot->ref};
    snprintf(f.msg, sizeof f.msg, "%s", why->msg);
    session_state_keep_snapshot(s, ins->seq, ins->snapshot->ref, NULL, 1, &f);
  }
}
