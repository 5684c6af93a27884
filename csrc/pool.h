/* A small pool of helper threads per endpoint, for splitting one large copy
 * over several cores without starting threads per copy. */
#ifndef UCCL_POOL_H
#define UCCL_POOL_H

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

#endif
