/* What a session names: one table keyed by ref, shared by meshes, streams,
 * tensors and borrows (Monarch's single ref space).
 *
 * Tensors that view the same memory share a storage_t (Monarch's
 * StorageAliases): it holds the access permissions that borrows change and
 * the bytes counted against the session's quota. Dropping a storage frees its
 * tensor records and leaves a 24-byte tombstone per ref (the command that
 * dropped it), so a later use gets DROPPED with its drop site rather than
 * UNKNOWN_REF. The last OBJECTS_GRAVES_MAX drops are kept: past that the older
 * half is forgotten (a use of such a ref is UNKNOWN_REF saying it may have been
 * dropped long ago), so a long session's memory stays flat however many
 * tensors it drops.
 *
 * Not thread-safe: the caller holds the session's lock. */
#ifndef MESHD_OBJECTS_H
#define MESHD_OBJECTS_H

#include <stdbool.h>
#include <stdint.h>
#include "error_kind.h"
#include "mesh.h"
#include "meta_pack.h"
#include "ops.h"
#include "refmap.h"

#define ACCESS_R 1u
#define ACCESS_W 2u

/* The default stream "main" has ref 0: every session has it. */
#define STREAM_MAIN 0

typedef enum { OBJ_MESH = 1, OBJ_STREAM, OBJ_TENSOR, OBJ_BORROW } obj_kind_t;
typedef enum { TENSOR_LIVE = 1, TENSOR_DROPPED = 2, TENSOR_FAILED = 3 } tensor_state_t;

struct obj;

typedef struct storage {
  struct obj *aliases;     /* tensor records viewing it, linked by tensor.next_alias */
  uint64_t id;             /* ref of the tensor that created it */
  int refs;                /* tensor records + borrows pointing here */
  int live_aliases;        /* tensors viewing it that are not dropped */
  unsigned access;         /* ACCESS_R | ACCESS_W */
  int read_borrows;        /* live read borrows taken from it */
  uint64_t mutable_borrow; /* ref of the live mutable borrow taken from it, 0 if none */
  uint64_t borrow;         /* on a borrowed storage: the borrow that made it */
  uint64_t bytes;          /* per rank */
  uint64_t ranks;          /* ranks holding it (bytes * ranks count against the quota) */
  bool shared;             /* viewed by more than one tensor record, ever */
} storage_t;

/* Why a tensor failed: kept apart, since few tensors fail. */
typedef struct tensor_failure {
  error_kind_t kind;       /* REMOTE_FAILURE / DEPENDENT_FAILURE */
  uint64_t root_seq;       /* the command whose failure it is */
  /* Where it came from: the instruction seq on `rank` of an agent's report
   * (rank_seq 0: the server failed it at a command's check). A fetch planned
   * before that instruction was sent reads the value from before it. */
  uint32_t rank;
  uint64_t rank_seq;
  uint64_t rank_command; /* that instruction's client command seq (0: not known) */
  bool ranks;              /* reports of other commands on other ranks: where is not known */
  char msg[];
} tensor_failure_t;

/* A rank's report of a failure of a tensor failed already: the earlier origin
 * is kept (one of the same rank, or any over the server's own check); one
 * command failing on several ranks is one origin (a command's instructions go
 * to its ranks at once). */
static inline void objects_failure_origin(tensor_failure_t *f, uint32_t rank, uint64_t seq,
                                          uint64_t command) {
  if (!seq) return;
  if (!f->rank_seq || (f->rank == rank && seq < f->rank_seq)) {
    f->rank = rank;
    f->rank_seq = seq;
    f->rank_command = command;
  } else if (f->rank != rank && (!command || command != f->rank_command)) {
    f->ranks = true;
  }
}

/* A tensor's record. Its dtype and layout are packed after the record
 * (obj_t.meta): read them with obj_meta. */
typedef struct tensor_obj {
  storage_t *storage;
  struct obj *next_alias;
  uint64_t mesh;
  uint64_t stream;
  uint64_t state_seq;      /* command that dropped or failed it */
  uint64_t born_seq;       /* client seq of the command that made it */
  tensor_failure_t *fail;  /* when FAILED (NULL if there was no memory to say why) */
} tensor_obj_t;

typedef struct borrow_obj {
  uint64_t origin;         /* the borrowed tensor */
  uint64_t result;         /* the tensor usable on to_stream */
  storage_t *origin_storage;
  /* The handle's (referenced): its views outlive a Release of the handle,
   * and DropBorrow ends them all. */
  storage_t *result_storage;
  bool is_mutable;
  uint64_t from_stream, to_stream;
} borrow_obj_t;

#define OBJ_STREAM_NAME_MAX 63 /* bytes of a stream's name */
/* Bytes of a stream's label in messages (objects_stream_label), its NUL included. */
#define OBJ_STREAM_LABEL_MAX (OBJ_STREAM_NAME_MAX + 32)

/* A stream's name is a label, as Monarch's Stream(name) is: several streams
 * of a session may share one (two modules each making Stream("side")). */
typedef struct stream_obj {
  char *name;       /* owned */
  bool name_shared; /* another stream of the session has this name (default
                     * "main" included): messages add the ref */
} stream_obj_t;

/* One ref's record, as small as its kind allows: a live 1-D tensor takes 84
 * bytes (and its storage 64, the index about 12). */
typedef struct obj {
  uint64_t ref;  /* first: the index's key (refmap.h) */
  uint8_t kind;  /* obj_kind_t */
  uint8_t state; /* a tensor's tensor_state_t */
  union {
    mesh_t *mesh;      /* owned; a pointer keeps tensor records small */
    stream_obj_t stream;
    tensor_obj_t tensor;
    borrow_obj_t borrow;
  };
  uint8_t meta[]; /* a tensor's packed dtype and layout (meta_pack.h) */
} obj_t;

/* A tensor's dtype and layout, unpacked into *out; returns out. */
static inline const tensor_meta_t *obj_meta(const obj_t *t, tensor_meta_t *out) {
  meta_unpack(t->meta, out);
  return out;
}
/* Bytes of one rank's shard of a tensor's shape, contiguous. */
static inline uint64_t obj_nbytes(const obj_t *t) {
  tensor_meta_t m;
  return meta_nbytes(obj_meta(t, &m));
}
/* A failed tensor's kind, root command and message (defaults if unknown). */
static inline error_kind_t obj_fail_kind(const obj_t *t) {
  return t->tensor.fail ? t->tensor.fail->kind : ERR_REMOTE_FAILURE;
}
static inline uint64_t obj_fail_root_seq(const obj_t *t) {
  return t->tensor.fail ? t->tensor.fail->root_seq : t->tensor.state_seq;
}
static inline const char *obj_fail_msg(const obj_t *t) {
  return t->tensor.fail ? t->tensor.fail->msg : "(no memory to keep the message)";
}

/* A dropped ref: when and, for a borrowed handle, by which borrow. A dropped
 * borrow's own record is freed too; its tombstone has borrow == ref. */
typedef struct tombstone {
  uint64_t ref, seq, borrow;
  /* Its failure's kind, message (cut) and where it came from: the record it
   * had failed with, or one of a rank's report after the drop. A fetch planned
   * before the drop fails as the tensor would have (fetch_caught_up). NULL:
   * none (or not kept: see OBJECTS_GRAVE_FAILS_MAX). */
  tensor_failure_t *fail;
  bool failure_noted; /* its failure is told already: by a rank's report, or it had
                       * failed before it was dropped */
  uint64_t storage;   /* its storage's id where the storage had other views (0: none): a
                       * late report fails them too, dropped or live */
} tombstone_t;

#define OBJECTS_GRAVES_MAX 65536 /* tombstones kept per session (about 5 MiB at most) */
/* Failure records kept by tombstones per session, their messages cut to
 * OBJECTS_GRAVE_FAIL_MSG bytes (about 1.2 MiB at most); past it the older
 * half is let go (their fetches then fail, as when a failure is not known). */
#define OBJECTS_GRAVE_FAILS_MAX 4096
#define OBJECTS_GRAVE_FAIL_MSG 255

typedef struct objects {
  refmap_t table;          /* obj_t records by ref */
  tombstone_t *graves;     /* open addressing by ref; ref 0 = empty slot */
  size_t ngraves, gcap;
  uint64_t graves_forgotten; /* tombstones of refs <= this were let go (0: none) */
  size_t ngrave_fails;     /* tombstones with a failure record (tombstone_t.fail) */
  uint64_t live_tensors;
  uint64_t meshes, streams; /* made so far (neither is ever dropped) */
  bool main_name_shared;   /* a stream of the session besides the default one is named "main" */
  uint64_t live_borrows;   /* borrows not dropped */
  uint64_t bytes;          /* sum over live storages of bytes * ranks */
  uint64_t current_seq;    /* client seq of the command running now (new tensors' born_seq) */
  uint32_t report_rank;    /* the agent report being applied (tensor_failure_t.rank_seq): */
  uint64_t report_seq;     /* its rank, instruction seq (0: none) and client command seq */
  uint64_t report_command;
  meshd_error_t *unreported; /* run-time root failures not yet returned by a Sync */
  uint64_t *unreported_seq;
  size_t nunreported;
  uint8_t *touched;        /* touched[rank]: the rank got instructions of this session */
  uint64_t *last_seq;      /* last_seq[rank]: the seq of its latest one (0: none) */
  uint64_t *opened_seq;    /* opened_seq[rank]: the seq of the Status that opened the
                            * session there for a transfer (0: none; upload_open) */
  size_t ntouched;
  uint64_t sent_bytes;     /* packed bytes of every instruction sent, ever */
  struct flow_window *flow; /* the command service's (flow.h): it opens and closes it */
  uint64_t losses;         /* agent losses the session was told of (ToMesh channels follow it) */
  uint64_t calls;          /* data plane calls emitted (Group.call, SendTensor.call: the last one) */
} objects_t;

/* Queues a run-time root failure for the session's next Sync (at most 256 are
 * kept; later ones are counted in the last message). */
void objects_note_failure(objects_t *o, error_kind_t kind, const char *msg, uint64_t seq);
/* Records that `rank` holds state of this session. Returns false on OOM. */
bool objects_touch(objects_t *o, uint32_t rank);
/* The rank got instruction `seq` of this session, `bytes` long (touches it). */
void objects_sent(objects_t *o, uint32_t rank, uint64_t seq, uint64_t bytes);
/* Whether a live tensor of the session has a shard on rank (its mesh
 * includes it). O(live tensors): for rare events (an agent lost). */
bool objects_holds_on(objects_t *o, uint32_t rank);
/* The seq of the session's latest instruction to rank; 0: none. */
uint64_t objects_last_seq(const objects_t *o, uint32_t rank);

objects_t *objects_create(void);
void objects_destroy(objects_t *o);

const char *obj_kind_name(obj_kind_t k);
/* Refs the session holds live: tensors (views, borrowed handles and failed
 * ones too), meshes, streams and borrows not dropped. */
uint64_t objects_live_refs(const objects_t *o);
obj_t *objects_get(objects_t *o, uint64_t ref);
/* Adds a zeroed record; the ref must be new (the session checked it). NULL on OOM. */
obj_t *objects_add(objects_t *o, uint64_t ref, obj_kind_t kind);
/* A stream record named `name` (at most OBJ_STREAM_NAME_MAX bytes), which the
 * session's other streams may share (they are then marked name_shared). NULL on OOM. */
obj_t *objects_add_stream(objects_t *o, uint64_t ref, const char *name);

/* Looks up ref as kind; `what` names the argument for the message:
 * UNKNOWN_REF "Call add: argument 'other' is ref 7, which this session never
 * defined" or "... is a mesh, not a tensor". */
obj_t *objects_expect(objects_t *o, uint64_t ref, obj_kind_t kind, const char *what,
                      meshd_error_t *e);
/* A stream's name by ref (0 = main); "?" where ref is not a stream. */
const char *objects_stream_name(objects_t *o, uint64_t ref);
/* A stream as messages name it, into buf (OBJ_STREAM_LABEL_MAX bytes do):
 * "'side'", or "'side' (ref 3)" where another stream of the session is named
 * "side" too, so that a message about two same-named streams tells them apart.
 * Returns buf. */
const char *objects_stream_label(objects_t *o, uint64_t ref, char *buf, size_t size);

/* A mesh record holding a copy of *mesh. NULL on OOM. */
obj_t *objects_add_mesh(objects_t *o, uint64_t ref, const mesh_t *mesh);
/* The tombstone of a dropped tensor ref, or NULL. */
const tombstone_t *objects_dropped(const objects_t *o, uint64_t ref);
/* A rank reported a root failure of `ref`, which is dropped or released:
 * true for the first such report (the one Sync tells of; the other ranks' are
 * the same failure), false after it, and for a ref without a tombstone. */
bool objects_dropped_failure_first(objects_t *o, uint64_t ref);
/* A rank's report of a failure of `ref`, which is dropped or released: its
 * tombstone keeps where the failure came from (as objects_failure_origin does
 * for a live tensor), its kind and message. No-op for a ref without one. */
void objects_dropped_failure_origin(objects_t *o, uint64_t ref, error_kind_t kind, uint32_t rank,
                                    uint64_t seq, uint64_t command, const char *msg);
/* A live tensor viewing the storage of `ref`, which is released, or NULL (a
 * late report of ref's failure fails it, and so every alias). O(live refs):
 * for a released view's report only. */
obj_t *objects_dropped_live_alias(objects_t *o, uint64_t ref);
/* The tombstone of a dropped borrow ref, or NULL. */
const tombstone_t *objects_dropped_borrow(const objects_t *o, uint64_t ref);
/* Frees a borrow's record, leaving its tombstone (borrow_drop's last step). */
void objects_bury_borrow(objects_t *o, obj_t *borrow, uint64_t seq);
/* Whether ref is not live and old enough that its tombstone, if it had one,
 * was let go (see OBJECTS_GRAVES_MAX). */
bool objects_forgotten(const objects_t *o, uint64_t ref);

/* A new tensor on a fresh storage (bytes from its layout). */
obj_t *objects_new_tensor(objects_t *o, uint64_t ref, const tensor_meta_t *meta, uint64_t mesh,
                          uint64_t stream, uint64_t ranks);
/* A new tensor viewing `base`'s storage (aliases it). */
obj_t *objects_new_view(objects_t *o, uint64_t ref, const tensor_meta_t *meta, obj_t *base);
/* A tensor on a new storage that borrows from `origin` (see borrow.c). */
obj_t *objects_new_borrowed(objects_t *o, uint64_t ref, const tensor_meta_t *meta, obj_t *origin,
                            uint64_t stream, uint64_t borrow);

/* Drops every tensor viewing `storage` (Monarch's drop drops all aliases): their
 * records are freed (tombstones remain), the bytes return to the quota, and the
 * storage is freed once no borrow refers to it. */
void objects_drop_storage(objects_t *o, storage_t *storage, uint64_t seq);
/* Lets go of one tensor record (Release): its ref gets a tombstone, and its
 * storage's bytes leave the quota with its last alias. */
void objects_release(objects_t *o, obj_t *t, uint64_t seq);
/* Marks a tensor failed (its storage's other aliases too). */
void objects_fail_tensor(objects_t *o, obj_t *t, uint64_t seq, error_kind_t kind,
                         uint64_t root_seq, const char *msg);

#endif
