#define _POSIX_C_SOURCE 200809L
#include "base/status.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#define UCCL_ERRMSG_MAX 512

/* The only mutable global besides the loader tables: per thread, so engine
 * threads never race with the caller's message. */
static _Thread_local char tls_errmsg[UCCL_ERRMSG_MAX];

const char *uccl_status_str(int status)
{
    switch (status) {
#define UCCL_X_CASE(name, val, text) case name: return text;
        UCCL_STATUS_LIST(UCCL_X_CASE)
#undef UCCL_X_CASE
    }
    return "unknown status";
}

int uccl__err(int status, const char *fmt, ...)
{
    /* Format aside first: callers often pass uccl_last_error() itself as an
     * argument ("...: %s"), and formatting a buffer into itself is undefined. */
    char msg[UCCL_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    memcpy(tls_errmsg, msg, sizeof(msg));
    return status;
}

const char *uccl_last_error(void)
{
    return tls_errmsg;
}

uint64_t uccl__random64(void)
{
    uint64_t v = 0;
    while (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v))
        ;
    return v ? v : 1;
}

void uccl__random_bytes(void *buf, size_t len)
{
    /* getrandom() of up to 256 bytes never returns short once the pool is
     * ready; the loop covers EINTR and larger requests. */
    for (size_t done = 0; done < len;) {
        ssize_t n = getrandom((char *)buf + done, len - done, 0);
        if (n > 0)
            done += (size_t)n;
    }
}

uint64_t uccl__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
