/* The data plane's wire format as pure functions: bytes in, a decision out.
 * conn.c and transfer.c use them on every byte a peer sends before it is
 * trusted, and tests/fuzz/fuzz_dataplane.c runs them on arbitrary input.
 * No sockets, no locks, no logging; nothing here allocates.
 *
 * The handshake on a new connection (the dialer sends, the acceptor receives):
 *
 *   acceptor -> dialer  challenge  {magic MDPN, version, nonce_a[16]}           24 bytes
 *   dialer -> acceptor  hello      {magic MDPH, version, to, from, comm_id, call,
 *                                   nonce_d[16], mac[32]}                       80 bytes
 *   acceptor -> dialer  ack        {magic MDPK, version, mac[32]}               40 bytes
 *
 *   hello.mac = HMAC-SHA256(secret, "meshd-dp-hello" || hello[0, 48) || nonce_a)
 *   ack.mac   = HMAC-SHA256(secret, "meshd-dp-ack"   || hello[0, 48) || nonce_a)
 *
 * `secret` is the group's (dp_group_t.secret, from the instruction). The hello
 * proves to the acceptor that the dialer holds it for this comm_id, from this
 * rank, to this rank, now (nonce_a is fresh per connection: a recorded hello
 * proves nothing on another one). The ack proves the same of the acceptor to
 * the dialer (nonce_d, inside hello[0, 48), is fresh per dial), so bytes are
 * only ever sent to a member. `call` is the call the dialer dialed for (see
 * below). Then frames follow, dialer to acceptor:
 *
 *   frame header {magic MDPD (data) or MDPA (abort), length, comm_id, call, seq}  32 bytes
 *
 * `call` names the call of the comm the frame belongs to: the server numbers
 * the session's collectives and sends (Group.call, SendTensor.call) and every
 * member tags its frames with that number (dp_group_t.call), so a member that
 * falls behind its group (its peers gave up on a call it starts late) can
 * never pair with the peers' next call: a receiver skips frames of an older
 * call and fails on one of a newer call (transfer.c). `seq` counts data frames
 * on the connection, whatever their call.
 *
 * A dialer that closes an idle connection (it keeps at most so many,
 * dataplane_max_links) first sends {magic MDPB, 0, comm_id, 0, seq}: a
 * receiver that already took it for a call waits for the next dial instead
 * of failing.
 *
 * On a same-host connection (a unix socket, conn.c) a whole message may
 * instead travel as one shared-memory frame: header {magic MDPS, length 8,
 * comm_id, call, seq} and the message's byte count (u64), with a sealed memfd
 * holding those bytes passed alongside (SCM_RIGHTS; transfer.c checks it).
 *
 * All integers little-endian. */
#ifndef MESHD_AGENT_DATAPLANE_WIRE_H
#define MESHD_AGENT_DATAPLANE_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "dataplane.h" /* DP_SECRET_LEN */

#define DP_WIRE_VERSION 2u /* 2: frames carry the call */
#define DP_MAGIC_CHALLENGE 0x4d44504eu /* "MDPN" */
#define DP_MAGIC_HELLO 0x4d445048u     /* "MDPH" */
#define DP_MAGIC_ACK 0x4d44504bu       /* "MDPK" */
#define DP_MAGIC_DATA 0x4d445044u      /* "MDPD" */
#define DP_MAGIC_ABORT 0x4d445041u     /* "MDPA" */
#define DP_MAGIC_SHM 0x4d445053u       /* "MDPS" */
#define DP_MAGIC_BYE 0x4d445042u       /* "MDPB" */
#define DP_SHM_PAYLOAD 8               /* a shared-memory frame's payload: the byte count */
#define DP_NONCE_LEN 16
#define DP_MAC_LEN 32
#define DP_CHALLENGE_LEN (8 + DP_NONCE_LEN)
#define DP_HELLO_SIGNED 48 /* the hello's fields the mac covers: all but the mac */
#define DP_HELLO_LEN (DP_HELLO_SIGNED + DP_MAC_LEN)
#define DP_ACK_LEN (8 + DP_MAC_LEN)
#define DP_HDR_LEN 32
#define DP_ABORT_MAX 480 /* bytes of root cause carried in an abort frame */

/* A parse of bytes that may still be arriving: MORE (a valid prefix; read on),
 * OK (complete and well-formed), BAD (no continuation can make it valid; the
 * reason is in `why`). */
typedef enum { DP_PARSE_MORE, DP_PARSE_OK, DP_PARSE_BAD } dp_parse_t;

typedef struct dp_hello {
  uint32_t to, from;
  uint64_t comm_id, call;
} dp_hello_t;

/* A group this agent takes part in now, against which hellos are checked. */
typedef struct dp_wire_group {
  uint64_t comm_id;
  const uint32_t *ranks; /* its members */
  size_t n;
  const uint8_t *secret; /* DP_SECRET_LEN bytes */
  /* n * DP_SECRET_LEN bytes, or NULL: member i proves entry i (our link's
   * secret with it) instead of `secret` */
  const uint8_t *member_secrets;
  /* The call it runs (dp_group_t.call): a wrong mac on a hello for another
   * call of the comm is no bad proof, for that call may prove another secret
   * (the other direction of a ToMesh channel): it is held as a hello for a
   * call not started here yet. */
  uint64_t call;
} dp_wire_group_t;

/* What the acceptor does with a hello. */
typedef enum {
  DP_ADMIT_MORE,          /* a valid prefix: read on */
  DP_ADMIT_OK,            /* proven for groups[*which] */
  DP_ADMIT_MALFORMED,     /* not a hello of this version, or not for this rank */
  DP_ADMIT_BAD_PROOF,     /* a group with that comm_id and member exists; the mac is wrong */
  DP_ADMIT_UNKNOWN_GROUP, /* no group here (yet) has that comm_id with `from` in it */
} dp_admit_t;

/* The acceptor's challenge around a fresh nonce. */
void dp_wire_challenge(uint8_t out[DP_CHALLENGE_LEN], const uint8_t nonce[DP_NONCE_LEN]);
/* The dialer reads the challenge: its nonce into `nonce` once OK. */
dp_parse_t dp_wire_parse_challenge(const uint8_t *buf, size_t len, uint8_t nonce[DP_NONCE_LEN],
                                   char *why, size_t whylen);

/* The dialer's hello, proving `secret` against the acceptor's nonce_a. */
void dp_wire_hello(uint8_t out[DP_HELLO_LEN], uint32_t to, uint32_t from, uint64_t comm_id,
                   uint64_t call,
                   const uint8_t nonce_d[DP_NONCE_LEN], const uint8_t nonce_a[DP_NONCE_LEN],
                   const uint8_t secret[DP_SECRET_LEN]);
/* The hello's fields, checking magic and version as soon as they are in
 * (a stranger's bytes are refused after 8 of them). */
dp_parse_t dp_wire_parse_hello(const uint8_t *buf, size_t len, dp_hello_t *h, char *why,
                               size_t whylen);
/* The acceptor's decision on buf[0, len): MORE until DP_HELLO_LEN bytes are in
 * (or MALFORMED earlier). A complete hello must be addressed to my_rank, come
 * from a member (other than my_rank) of a group with its comm_id, and carry
 * that group's mac over nonce_a (compared in constant time); the first group
 * it proves is *which (its member_secrets' entry for the sender, where it has
 * them). BAD_PROOF only when a group of the hello's call, too, has that
 * comm_id and member (else UNKNOWN_GROUP). `why` says what was wrong. */
dp_admit_t dp_wire_admit(const uint8_t *buf, size_t len, uint32_t my_rank,
                         const uint8_t nonce_a[DP_NONCE_LEN], const dp_wire_group_t *groups,
                         size_t ngroups, size_t *which, char *why, size_t whylen);

/* The secret member `from` of g proves: its member_secrets' entry, or the
 * group's; NULL when it is not a member. */
const uint8_t *dp_wire_secret_of(const dp_wire_group_t *g, uint32_t from);

/* The acceptor's answer to a proven hello; the dialer checks it (len must be
 * DP_ACK_LEN, compared in constant time). */
void dp_wire_ack(uint8_t out[DP_ACK_LEN], const uint8_t hello[DP_HELLO_LEN],
                 const uint8_t nonce_a[DP_NONCE_LEN], const uint8_t secret[DP_SECRET_LEN]);
bool dp_wire_ack_proves(const uint8_t *buf, size_t len, const uint8_t hello[DP_HELLO_LEN],
                        const uint8_t nonce_a[DP_NONCE_LEN], const uint8_t secret[DP_SECRET_LEN]);

/* ------------------------------------------------------------------ frames */

typedef enum {
  DP_FRAME_DATA,    /* the frame expected next: `want_len` bytes follow */
  DP_FRAME_ABORT,   /* an abort notice: f->len (at most DP_ABORT_MAX) bytes of text follow */
  DP_FRAME_FOREIGN, /* not data of this comm (another magic or comm_id) */
  DP_FRAME_SKEWED,  /* data of this comm, but not frame want_seq of want_len bytes */
  DP_FRAME_SHM,     /* frame want_seq as shared memory: DP_SHM_PAYLOAD bytes follow */
  DP_FRAME_STALE,   /* data of this comm for an older call (f->len bytes follow): skip it */
  DP_FRAME_AHEAD,   /* data of this comm for a newer call: this member fell behind */
  DP_FRAME_BYE,     /* the sender closes this idle connection: it dials again for its next call */
} dp_frame_kind_t;

typedef struct dp_frame {
  uint32_t magic, len;
  uint64_t comm_id, call, seq;
} dp_frame_t;

void dp_wire_frame(uint8_t hdr[DP_HDR_LEN], uint32_t magic, uint32_t len, uint64_t comm_id,
                   uint64_t call, uint64_t seq);
/* An abort notice of call `call` carrying why (cut at DP_ABORT_MAX bytes)
 * into out: its length, header included. */
size_t dp_wire_abort(uint8_t out[DP_HDR_LEN + DP_ABORT_MAX], uint64_t comm_id, uint64_t call,
                     const char *why);
/* Classifies a received header for call `call` of comm_id, which expects
 * frame want_seq of want_len bytes; f gets its fields (an abort's len capped
 * at DP_ABORT_MAX). An abort is ABORT whatever its call (its sender closes
 * the connection after it). Data or shared memory of another call is STALE
 * or AHEAD when it is well-formed (data: at most max_len bytes, shared
 * memory: DP_SHM_PAYLOAD) and numbered want_seq, else SKEWED. */
dp_frame_kind_t dp_wire_parse_frame(const uint8_t hdr[DP_HDR_LEN], uint64_t comm_id, uint64_t call,
                                    uint64_t want_seq, size_t want_len, size_t max_len,
                                    dp_frame_t *f);

/* An MDPS frame's memfd rides on its first byte as SCM_RIGHTS: the control
 * buffer for one descriptor, and dp_wire_attach_fd putting fd in it for mh. */
typedef union {
  struct cmsghdr h;
  char b[CMSG_SPACE(sizeof(int))];
} dp_fd_ctl_t;
void dp_wire_attach_fd(struct msghdr *mh, dp_fd_ctl_t *ctl, int fd);

/* Little-endian fields. */
static inline void dp__put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void dp__put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t dp__get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static inline uint64_t dp__get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

#endif
