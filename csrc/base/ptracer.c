/* The Yama exception of this process (ptracer.h): a count of connections
 * per peer pid, and the one prctl that states the set. */
#define _GNU_SOURCE
#include "base/ptracer.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

#include "base/log.h"

#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif

struct grant { uint32_t pid; unsigned count; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct grant *grants;
static unsigned ngrants, cap;
static long asked;          /* what the kernel was last told: 0, -1 (any) or a pid */
static int scope = -2;      /* -2: not read yet */

static int yama_scope(void)
{
    if (scope == -2) {
        FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
        scope = -1;
        if (f) {
            if (fscanf(f, "%d", &scope) != 1)
                scope = -1;
            fclose(f);
        }
    }
    return scope;
}

static long wanted(void)
{
    return ngrants == 0 ? 0 : ngrants == 1 ? (long)grants[0].pid : -1;
}

/* Under mu: tell the kernel the set, if it changed. */
static void apply(void)
{
    long want = wanted();
    if (want == asked || yama_scope() != 1) {
        asked = want;
        return;
    }
    unsigned long arg = want == -1 ? PR_SET_PTRACER_ANY : (unsigned long)want;
    if (prctl(PR_SET_PTRACER, arg, 0, 0, 0) < 0) {
        LOG_WARN("prctl(PR_SET_PTRACER, %ld) failed: %s; CMA peers may be refused", want,
                 strerror(errno));
        return;
    }
    asked = want;
}

void uccl__ptracer_grant(uint32_t pid)
{
    if (pid == 0)
        return;
    pthread_mutex_lock(&mu);
    unsigned i = 0;
    while (i < ngrants && grants[i].pid != pid)
        i++;
    if (i == ngrants) {
        if (ngrants == cap) {
            unsigned ncap = cap ? 2 * cap : 8;
            struct grant *g = realloc(grants, ncap * sizeof(*g));
            if (!g) { /* the probe will fail and the ring be used */
                pthread_mutex_unlock(&mu);
                return;
            }
            grants = g, cap = ncap;
        }
        grants[ngrants++] = (struct grant){.pid = pid};
    }
    grants[i].count++;
    apply();
    pthread_mutex_unlock(&mu);
}

void uccl__ptracer_release(uint32_t pid)
{
    pthread_mutex_lock(&mu);
    for (unsigned i = 0; i < ngrants; i++) {
        if (grants[i].pid != pid)
            continue;
        if (--grants[i].count == 0)
            grants[i] = grants[--ngrants];
        apply();
        break;
    }
    pthread_mutex_unlock(&mu);
}

void uccl__ptracer_state(int *scope_p, long *want_p, unsigned *peers_p)
{
    pthread_mutex_lock(&mu);
    *scope_p = yama_scope();
    *want_p = wanted();
    *peers_p = ngrants;
    pthread_mutex_unlock(&mu);
}
