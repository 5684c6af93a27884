/* Helper threads for parallel copies (pool.h).  A job is a count of parts
 * claimed with an atomic counter, so the caller and any idle helper share it
 * without a lock per part; helpers sleep on a condition variable between
 * jobs (a 2-core machine must not lose a core to idle helpers). */
#define _GNU_SOURCE
#include "base/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/queue.h>
#include <unistd.h>

#define POOL_MAX 16

struct job {
    void (*fn)(void *, int);
    void *arg;
    int n;
    atomic_int next;             /* the next part to claim */
    int done, users;             /* parts run; helpers inside (both under mu) */
    TAILQ_ENTRY(job) link;       /* in the pool's list while parts may be unclaimed */
    int listed;
};

struct uccl__pool {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    TAILQ_HEAD(, job) jobs;      /* jobs with parts not yet claimed */
    int nthreads, stop;
    pthread_t th[POOL_MAX];
};

/* Claim and run parts of j until none is left; returns how many it ran. */
static int work_on(struct job *j)
{
    int ran = 0;
    for (int i; (i = atomic_fetch_add(&j->next, 1)) < j->n; ran++)
        j->fn(j->arg, i);
    return ran;
}

/* Under mu: take j off the list if it is there. */
static void unlink_job(struct uccl__pool *p, struct job *j)
{
    if (j->listed)
        TAILQ_REMOVE(&p->jobs, j, link);
    j->listed = 0;
}

static void *helper_main(void *arg)
{
    struct uccl__pool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && TAILQ_EMPTY(&p->jobs))
            pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->stop)
            break;
        struct job *j = TAILQ_FIRST(&p->jobs);
        if (atomic_load(&j->next) >= j->n) { /* all claimed: stop offering it */
            unlink_job(p, j);
            continue;
        }
        j->users++; /* the caller's j lives until no helper is inside */
        pthread_mutex_unlock(&p->mu);
        int ran = work_on(j);
        pthread_mutex_lock(&p->mu);
        j->done += ran;
        if (--j->users == 0 && j->done == j->n)
            pthread_cond_broadcast(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

struct uccl__pool *uccl__pool_new(int nthreads)
{
    struct uccl__pool *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    TAILQ_INIT(&p->jobs);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    if (nthreads > POOL_MAX)
        nthreads = POOL_MAX;
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&p->th[i], NULL, helper_main, p))
            break;
        p->nthreads++;
    }
    return p;
}

void uccl__pool_free(struct uccl__pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++)
        pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    free(p);
}

int uccl__pool_width(const struct uccl__pool *p) { return p ? p->nthreads + 1 : 1; }

void uccl__pool_run(struct uccl__pool *p, int n, void (*fn)(void *arg, int i), void *arg)
{
    struct job j = {.fn = fn, .arg = arg, .n = n};
    if (!p || p->nthreads == 0 || n <= 1) {
        for (int i = 0; i < n; i++)
            fn(arg, i);
        return;
    }
    pthread_mutex_lock(&p->mu);
    TAILQ_INSERT_TAIL(&p->jobs, &j, link);
    j.listed = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    int ran = work_on(&j);
    pthread_mutex_lock(&p->mu);
    unlink_job(p, &j);
    j.done += ran;
    while (j.done < n || j.users > 0)
        pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

void uccl__pool_lazy_init(struct uccl__pool_lazy *l)
{
    pthread_mutex_init(&l->mu, NULL);
    l->pool = NULL;
    l->closed = 0;
}

struct uccl__pool *uccl__pool_lazy_get(struct uccl__pool_lazy *l)
{
    pthread_mutex_lock(&l->mu);
    if (!l->pool && !l->closed) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        int helpers = ncpu <= 4 ? 1 : (int)(ncpu / 2 < 8 ? ncpu / 2 : 8) - 1;
        l->pool = uccl__pool_new(helpers);
    }
    struct uccl__pool *p = l->pool;
    pthread_mutex_unlock(&l->mu);
    return p;
}

void uccl__pool_lazy_close(struct uccl__pool_lazy *l)
{
    pthread_mutex_lock(&l->mu);
    l->closed = 1;
    pthread_mutex_unlock(&l->mu);
}

void uccl__pool_lazy_free(struct uccl__pool_lazy *l)
{
    uccl__pool_free(l->pool);
    l->pool = NULL;
    pthread_mutex_destroy(&l->mu);
}
