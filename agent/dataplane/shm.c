/* The agents' TCP transport (dataplane.h): same-host messages.
 *
 * Agents on one host reach each other over a unix socket (conn.c), which can
 * pass descriptors. A large broadcast then travels as one memfd: the source
 * copies its bytes in once and seals it (no write, grow or shrink), each
 * member passes the same descriptor on down the chain and maps it over its
 * buffer copy-on-write. So a destination costs a frame and a mapping, not a
 * copy, and the pages exist once on the host until someone writes to them.
 *
 * A peer's descriptor is trusted for nothing but its seals and size: it must
 * be a memfd sealed against writes, growing and shrinking (so no page can
 * change or vanish under a mapping) of exactly the message's length. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dp_internal.h"

#define SEALS_NEEDED (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW)

int dp__shm_create(const void *buf, size_t len) {
  int fd = memfd_create("meshd-dp", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, (off_t)len) != 0) goto fail;
  for (size_t off = 0; off < len;) {
    ssize_t w = pwrite(fd, (const uint8_t *)buf + off, len - off, (off_t)off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) goto fail;
    off += (size_t)w;
  }
  if (fcntl(fd, F_ADD_SEALS, SEALS_NEEDED | F_SEAL_SEAL) != 0) goto fail;
  return fd;
fail:;
  int saved = errno;
  close(fd);
  errno = saved;
  return -1;
}

int dp__shm_land(int fd, uint8_t *buf, size_t len, bool map, char *why, size_t whylen) {
  int seals = fcntl(fd, F_GET_SEALS);
  struct stat st;
  if (seals < 0 || (seals & SEALS_NEEDED) != SEALS_NEEDED) {
    snprintf(why, whylen, "passed a descriptor that is not a memfd sealed against writes and "
                          "resizing");
    return -1;
  }
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != (uint64_t)len) {
    snprintf(why, whylen, "passed a memfd of %lld bytes for a message of %zu",
             (long long)st.st_size, len);
    return -1;
  }
  long page = sysconf(_SC_PAGESIZE);
  if (map && len > 0 && page > 0 && (uintptr_t)buf % (uintptr_t)page == 0) {
    /* The last page may run past the file's end: it reads as zeros there, and
     * the seals keep the file from shrinking under it. */
    size_t span = (len + (size_t)page - 1) / (size_t)page * (size_t)page;
    if (mmap(buf, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0) != MAP_FAILED)
      return 1;
    /* A failed MAP_FIXED may have unmapped the range: put plain memory back. */
    if (mmap(buf, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
        MAP_FAILED) {
      snprintf(why, whylen, "left a buffer we could not map again: %s", strerror(errno));
      return -1;
    }
  }
  for (size_t off = 0; off < len;) {
    ssize_t r = pread(fd, buf + off, len - off, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      snprintf(why, whylen, "passed a memfd we could not read: %s",
               r < 0 ? strerror(errno) : "it ended early");
      return -1;
    }
    off += (size_t)r;
  }
  return 0;
}
