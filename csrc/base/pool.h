/* A small pool of helper threads per endpoint, for splitting one large copy
 * over several cores without starting threads per copy. */
#ifndef UCCL_POOL_H
#define UCCL_POOL_H

#include <pthread.h>

struct uccl__pool;

/* nthreads helpers (0: none; every job then runs on its caller). */
struct uccl__pool *uccl__pool_new(int nthreads);
/* Stops the helpers once they finish what they run; NULL is fine. */
void uccl__pool_free(struct uccl__pool *p);
/* How many parts a job can usefully have (helpers + the caller). */
int uccl__pool_width(const struct uccl__pool *p);
/* Run fn(arg, i) for every i in [0, n): the caller takes parts too, and
 * does every part no helper took; returns when all n have run. */
void uccl__pool_run(struct uccl__pool *p, int n, void (*fn)(void *arg, int i), void *arg);

/* An endpoint's copy helpers, made at the first use (most endpoints never
 * split a copy, and threads per endpoint add up in a test run): one helper
 * on a machine of up to 4 cores, else min(8, cores / 2) - 1. */
struct uccl__pool_lazy {
    pthread_mutex_t mu;
    struct uccl__pool *pool;
    int closed;                  /* no pool is made any more */
};
void uccl__pool_lazy_init(struct uccl__pool_lazy *l);
/* The pool, made now if need be; NULL once closed or if none could be made. */
struct uccl__pool *uccl__pool_lazy_get(struct uccl__pool_lazy *l);
/* From now on get() makes no pool (the owner is closing). */
void uccl__pool_lazy_close(struct uccl__pool_lazy *l);
/* Free the pool: nobody may be copying with it. */
void uccl__pool_lazy_free(struct uccl__pool_lazy *l);

#endif
