/* The data plane's wire format (wire.h): pure functions over bytes. */
#include "wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <string.h>

static const char HELLO_LABEL[] = "meshd-dp-hello";
static const char ACK_LABEL[] = "meshd-dp-ack";

/* HMAC-SHA256(secret, label || signed || nonce_a). */
static void mac(uint8_t out[DP_MAC_LEN], const char *label, const uint8_t signed_[DP_HELLO_SIGNED],
                const uint8_t nonce_a[DP_NONCE_LEN], const uint8_t secret[DP_SECRET_LEN]) {
  uint8_t msg[32 + DP_HELLO_SIGNED + DP_NONCE_LEN];
  size_t ll = strlen(label), n = 0;
  memcpy(msg, label, ll);
  n += ll;
  memcpy(msg + n, signed_, DP_HELLO_SIGNED);
  n += DP_HELLO_SIGNED;
  memcpy(msg + n, nonce_a, DP_NONCE_LEN);
  n += DP_NONCE_LEN;
  unsigned int outlen = DP_MAC_LEN;
  if (!HMAC(EVP_sha256(), secret, DP_SECRET_LEN, msg, n, out, &outlen))
    memset(out, 0, DP_MAC_LEN); /* a mac nobody can match by chance: every check fails */
}

/* Magic and version, checked as soon as they have arrived. */
static dp_parse_t parse_head(const uint8_t *buf, size_t len, uint32_t magic, const char *what,
                             char *why, size_t whylen) {
  if (len >= 4 && dp__get32(buf) != magic) {
    if (why && whylen)
      snprintf(why, whylen, "not a data plane %s (magic %08x, expected %08x)", what,
               dp__get32(buf), magic);
    return DP_PARSE_BAD;
  }
  if (len >= 8 && dp__get32(buf + 4) != DP_WIRE_VERSION) {
    if (why && whylen)
      snprintf(why, whylen, "%s of data plane version %u (this agent speaks %u)", what,
               dp__get32(buf + 4), DP_WIRE_VERSION);
    return DP_PARSE_BAD;
  }
  return len >= 8 ? DP_PARSE_OK : DP_PARSE_MORE;
}

void dp_wire_challenge(uint8_t out[DP_CHALLENGE_LEN], const uint8_t nonce[DP_NONCE_LEN]) {
  dp__put32(out, DP_MAGIC_CHALLENGE);
  dp__put32(out + 4, DP_WIRE_VERSION);
  memcpy(out + 8, nonce, DP_NONCE_LEN);
}

dp_parse_t dp_wire_parse_challenge(const uint8_t *buf, size_t len, uint8_t nonce[DP_NONCE_LEN],
                                   char *why, size_t whylen) {
  dp_parse_t r = parse_head(buf, len, DP_MAGIC_CHALLENGE, "challenge", why, whylen);
  if (r != DP_PARSE_OK) return r;
  if (len < DP_CHALLENGE_LEN) return DP_PARSE_MORE;
  memcpy(nonce, buf + 8, DP_NONCE_LEN);
  return DP_PARSE_OK;
}

void dp_wire_hello(uint8_t out[DP_HELLO_LEN], uint32_t to, uint32_t from, uint64_t comm_id,
                   uint64_t call, const uint8_t nonce_d[DP_NONCE_LEN], const uint8_t nonce_a[DP_NONCE_LEN],
                   const uint8_t secret[DP_SECRET_LEN]) {
  dp__put32(out, DP_MAGIC_HELLO);
  dp__put32(out + 4, DP_WIRE_VERSION);
  dp__put32(out + 8, to);
  dp__put32(out + 12, from);
  dp__put64(out + 16, comm_id);
  dp__put64(out + 24, call);
  memcpy(out + 32, nonce_d, DP_NONCE_LEN);
  mac(out + DP_HELLO_SIGNED, HELLO_LABEL, out, nonce_a, secret);
}

dp_parse_t dp_wire_parse_hello(const uint8_t *buf, size_t len, dp_hello_t *h, char *why,
                               size_t whylen) {
  dp_parse_t r = parse_head(buf, len, DP_MAGIC_HELLO, "hello", why, whylen);
  if (r != DP_PARSE_OK) return r;
  if (len < DP_HELLO_LEN) return DP_PARSE_MORE;
  h->to = dp__get32(buf + 8);
  h->from = dp__get32(buf + 12);
  h->comm_id = dp__get64(buf + 16);
  h->call = dp__get64(buf + 24);
  return DP_PARSE_OK;
}

const uint8_t *dp_wire_secret_of(const dp_wire_group_t *g, uint32_t from) {
  for (size_t k = 0; k < g->n; k++)
    if (g->ranks[k] == from) return g->member_secrets ? g->member_secrets + k * DP_SECRET_LEN : g->secret;
  return NULL;
}

dp_admit_t dp_wire_admit(const uint8_t *buf, size_t len, uint32_t my_rank,
                         const uint8_t nonce_a[DP_NONCE_LEN], const dp_wire_group_t *groups,
                         size_t ngroups, size_t *which, char *why, size_t whylen) {
  dp_hello_t h;
  dp_parse_t r = dp_wire_parse_hello(buf, len, &h, why, whylen);
  if (r == DP_PARSE_MORE) return DP_ADMIT_MORE;
  if (r == DP_PARSE_BAD) return DP_ADMIT_MALFORMED;
  if (h.to != my_rank) {
    if (why && whylen)
      snprintf(why, whylen, "hello addressed to rank %u, but this is rank %u", h.to, my_rank);
    return DP_ADMIT_MALFORMED;
  }
  bool member = false;
  for (size_t g = 0; g < ngroups; g++) {
    const dp_wire_group_t *grp = &groups[g];
    if (grp->comm_id != h.comm_id || !grp->secret || h.from == my_rank) continue;
    const uint8_t *secret = dp_wire_secret_of(grp, h.from);
    if (!secret) continue;
    uint8_t want[DP_MAC_LEN];
    mac(want, HELLO_LABEL, buf, nonce_a, secret);
    if (CRYPTO_memcmp(want, buf + DP_HELLO_SIGNED, DP_MAC_LEN) == 0) {
      if (which) *which = g;
      return DP_ADMIT_OK;
    }
    /* A hello for another call of the comm may prove another secret (wire.h). */
    if (grp->call == h.call) member = true;
  }
  if (why && whylen)
    snprintf(why, whylen,
             member ? "hello from rank %u on comm %llu does not prove the group's secret"
                    : "hello from rank %u on comm %llu, which no call here has with that member",
             h.from, (unsigned long long)h.comm_id);
  return member ? DP_ADMIT_BAD_PROOF : DP_ADMIT_UNKNOWN_GROUP;
}

void dp_wire_ack(uint8_t out[DP_ACK_LEN], const uint8_t hello[DP_HELLO_LEN],
                 const uint8_t nonce_a[DP_NONCE_LEN], const uint8_t secret[DP_SECRET_LEN]) {
  dp__put32(out, DP_MAGIC_ACK);
  dp__put32(out + 4, DP_WIRE_VERSION);
  mac(out + 8, ACK_LABEL, hello, nonce_a, secret);
}

bool dp_wire_ack_proves(const uint8_t *buf, size_t len, const uint8_t hello[DP_HELLO_LEN],
                        const uint8_t nonce_a[DP_NONCE_LEN], const uint8_t secret[DP_SECRET_LEN]) {
  if (len != DP_ACK_LEN || parse_head(buf, len, DP_MAGIC_ACK, "ack", NULL, 0) != DP_PARSE_OK)
    return false;
  uint8_t want[DP_ACK_LEN];
  dp_wire_ack(want, hello, nonce_a, secret);
  return CRYPTO_memcmp(want + 8, buf + 8, DP_MAC_LEN) == 0;
}

void dp_wire_frame(uint8_t hdr[DP_HDR_LEN], uint32_t magic, uint32_t len, uint64_t comm_id,
                   uint64_t call, uint64_t seq) {
  dp__put32(hdr, magic);
  dp__put32(hdr + 4, len);
  dp__put64(hdr + 8, comm_id);
  dp__put64(hdr + 16, call);
  dp__put64(hdr + 24, seq);
}

size_t dp_wire_abort(uint8_t out[DP_HDR_LEN + DP_ABORT_MAX], uint64_t comm_id, uint64_t call,
                     const char *why) {
  size_t len = strlen(why);
  if (len > DP_ABORT_MAX) len = DP_ABORT_MAX;
  dp_wire_frame(out, DP_MAGIC_ABORT, (uint32_t)len, comm_id, call, 0);
  memcpy(out + DP_HDR_LEN, why, len);
  return DP_HDR_LEN + len;
}

dp_frame_kind_t dp_wire_parse_frame(const uint8_t hdr[DP_HDR_LEN], uint64_t comm_id, uint64_t call,
                                    uint64_t want_seq, size_t want_len, size_t max_len,
                                    dp_frame_t *f) {
  f->magic = dp__get32(hdr);
  f->len = dp__get32(hdr + 4);
  f->comm_id = dp__get64(hdr + 8);
  f->call = dp__get64(hdr + 16);
  f->seq = dp__get64(hdr + 24);
  if (f->magic == DP_MAGIC_ABORT) {
    if (f->len > DP_ABORT_MAX) f->len = DP_ABORT_MAX;
    return DP_FRAME_ABORT;
  }
  if (f->magic == DP_MAGIC_BYE && f->comm_id == comm_id && f->len == 0) return DP_FRAME_BYE;
  if ((f->magic != DP_MAGIC_DATA && f->magic != DP_MAGIC_SHM) || f->comm_id != comm_id)
    return DP_FRAME_FOREIGN;
  bool shm = f->magic == DP_MAGIC_SHM;
  if (f->call != call) {
    bool formed = shm ? f->len == DP_SHM_PAYLOAD : f->len <= max_len;
    if (!formed || f->seq != want_seq) return DP_FRAME_SKEWED;
    return f->call < call ? DP_FRAME_STALE : DP_FRAME_AHEAD;
  }
  if (shm) return f->seq == want_seq && f->len == DP_SHM_PAYLOAD ? DP_FRAME_SHM : DP_FRAME_SKEWED;
  if (f->seq != want_seq || f->len != want_len) return DP_FRAME_SKEWED;
  return DP_FRAME_DATA;
}

void dp_wire_attach_fd(struct msghdr *mh, dp_fd_ctl_t *ctl, int fd) {
  memset(ctl, 0, sizeof *ctl);
  mh->msg_control = ctl->b;
  mh->msg_controllen = sizeof ctl->b;
  struct cmsghdr *cm = CMSG_FIRSTHDR(mh);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &fd, sizeof(int));
}
