/* One status model for the whole engine.
 * 0 is success, 1 "in progress", every error is negative.  The human-readable
 * reason lives in a thread-local buffer that is set only where the error is
 * first detected, so callers propagate the status and never overwrite the why. */
#ifndef UCCL_STATUS_H
#define UCCL_STATUS_H

#include <stddef.h>
#include <stdint.h>

/* X-macro: name, value, default text.  The Python layer maps the classes:
 * INVALID/NOTFOUND/MISMATCH/CLOSED -> ValueError, TIMEOUT -> UcclTimeoutError,
 * everything else -> UcclError. */
#define UCCL_STATUS_LIST(X)                                                  \
    X(UCCL_OK,          0,   "success")                                      \
    X(UCCL_INPROGRESS,  1,   "in progress")                                  \
    X(UCCL_ERR_INVALID, -1,  "invalid argument")                             \
    X(UCCL_ERR_NOTFOUND, -2, "unknown identifier")                           \
    X(UCCL_ERR_MISMATCH, -3, "send/recv size mismatch")                      \
    X(UCCL_ERR_CLOSED,  -4,  "endpoint or connection closed")                \
    X(UCCL_ERR_NOMEM,   -5,  "out of memory")                                \
    X(UCCL_ERR_IO,      -6,  "transfer failed")                              \
    X(UCCL_ERR_TIMEOUT, -7,  "timed out")                                    \
    X(UCCL_ERR_PROTO,   -8,  "protocol error from peer")                     \
    X(UCCL_ERR_AUTH,    -9,  "authentication failed")                        \
    X(UCCL_ERR_UNAVAIL, -10, "transport unavailable")                        \
    X(UCCL_ERR_ACCESS,  -11, "remote access outside the advertised range")

typedef enum {
#define UCCL_X_ENUM(name, val, text) name = val,
    UCCL_STATUS_LIST(UCCL_X_ENUM)
#undef UCCL_X_ENUM
} uccl_status_t;

const char *uccl_status_str(int status);

/* Record why an error happened (printf-style) and return `status`, so that
 * detection sites read `return uccl__err(UCCL_ERR_INVALID, "...", ...);`. */
int uccl__err(int status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The last message recorded on this thread ("" if none). */
const char *uccl_last_error(void);

/* Monotonic clock in nanoseconds: every deadline of the engine is on it. */
uint64_t uccl__now_ns(void);

/* A random non-zero 64-bit value (getrandom): tokens, segment names. */
uint64_t uccl__random64(void);
/* len bytes from the kernel's random source (nonces, keys). */
void uccl__random_bytes(void *buf, size_t len);

#endif
