/* A device for the stream-ordered group harnesses (sgdev/sg_dev.h's
 * contract) that runs nothing on any stream but checks what the group asks
 * of it: a write lands at once (so the group's own words move on), a wait
 * passes, and every copy, reduction and word write must stay inside this
 * rank's own memory (its buffers, its arena, the page) or what map() gave
 * for a peer; map() itself asks the harness whether the peer published
 * that range under that key (sgfake_allowed).  Nothing is read or written
 * through a peer's address: the harness hands out the peer's bytes as they
 * came. */
#ifndef UCCL_FUZZ_SGFAKE_H
#define UCCL_FUZZ_SGFAKE_H

#include "fuzz.h"
#include "sg/sgroup.h"

#define SGFAKE_RANGES 64
struct sgfake_range {
    uintptr_t lo;
    size_t len;
};
static struct sgfake_range own[SGFAKE_RANGES], mapped[SGFAKE_RANGES];
static int nown, nmapped, live_maps;
static uint64_t next_reg;
/* The harness: did `peer` publish [addr, +len) under key? */
static int sgfake_allowed(int peer, uint64_t key, uint64_t addr, size_t len);

static void sgfake_reset(void)
{
    nown = nmapped = live_maps = 0;
    next_reg = 0;
}

static void sgfake_own(uintptr_t lo, size_t len)
{
    if (nown < SGFAKE_RANGES)
        own[nown++] = (struct sgfake_range){lo, len};
}

static int sgfake_in(const struct sgfake_range *rs, int n, uintptr_t lo, size_t len)
{
    for (int i = 0; i < n; i++)
        if (lo >= rs[i].lo && lo - rs[i].lo <= rs[i].len && len <= rs[i].len - (lo - rs[i].lo))
            return 1;
    return 0;
}

static int sgfake_reach(uintptr_t lo, size_t len) /* this rank's, or mapped from a peer */
{
    return sgfake_in(own, nown, lo, len) || sgfake_in(mapped, nmapped, lo, len);
}

static int f_memops(void *d, uintptr_t stream, const struct uccl__sg_memop *ops, int n)
{
    (void)d, (void)stream;
    for (int i = 0; i < n; i++) {
        if (ops[i].wait)
            continue; /* a peer's word, or this rank's: passes (nothing waits here) */
        CHECK(sgfake_in(own, nown, (uintptr_t)ops[i].addr, 4));
        __atomic_store_n(ops[i].addr, ops[i].value, __ATOMIC_RELEASE);
    }
    return 0;
}

static int f_copies(void *d, uintptr_t stream, const struct uccl_sg_copy *cs, int n)
{
    (void)d, (void)stream;
    for (int i = 0; i < n; i++) {
        CHECK(sgfake_reach(cs[i].dst, cs[i].len));
        CHECK(sgfake_reach(cs[i].src, cs[i].len));
    }
    return 0;
}

static int f_reduce(void *d, uintptr_t stream, const struct uccl__sg_red_args *a)
{
    (void)d, (void)stream;
    size_t nb = a->count * uccl_dtype_size(a->dtype);
    CHECK(a->nsrc >= 1 && a->nsrc <= UCCL_SG_MAX_RANKS);
    CHECK(sgfake_in(own, nown, a->out, nb));
    for (int r = 0; r < a->nsrc; r++)
        CHECK(sgfake_reach(a->src[r], nb));
    return 0;
}

static int f_event_new(void *d, void **ev_p)
{
    (void)d;
    *ev_p = malloc(1);
    return *ev_p ? 0 : -5;
}
static void f_event_free(void *d, void *ev) { (void)d, free(ev); }
static int f_record(void *d, void *ev, uintptr_t s) { (void)d, (void)ev, (void)s; return 0; }
static int f_wait_event(void *d, uintptr_t s, void *ev) { (void)d, (void)ev, (void)s; return 0; }
static int f_query(void *d, void *ev) { (void)d, (void)ev; return 1; }
static int f_reg(void *d, uintptr_t ptr, size_t len, uint64_t *reg_p)
{
    (void)d;
    CHECK(sgfake_in(own, nown, ptr, len));
    *reg_p = ++next_reg;
    return 0;
}
static int f_key(void *d, uint64_t reg, uintptr_t ptr, size_t len, uint64_t *key_p)
{
    (void)d, (void)ptr, (void)len;
    *key_p = reg * 0x9E3779B97F4A7C15ull;
    return 0;
}
static void f_dereg(void *d, uint64_t reg) { (void)d, (void)reg; }
static int f_map(void *d, int peer, uint64_t key, uint64_t addr, size_t len, uintptr_t *ptr_p,
                 void **imp_p)
{
    (void)d;
    CHECK(addr + len >= addr); /* a range, not a wrap round the address space */
    CHECK(sgfake_allowed(peer, key, addr, len));
    if (nmapped < SGFAKE_RANGES)
        mapped[nmapped++] = (struct sgfake_range){(uintptr_t)addr, len};
    live_maps++;
    *ptr_p = (uintptr_t)addr;
    *imp_p = &live_maps; /* anything not NULL */
    return 0;
}
static void f_unmap(void *d, void *imp)
{
    (void)d, (void)imp;
    CHECK(--live_maps >= 0); /* never one unmap too many */
}
static void f_destroy(void *d) { (void)d; }

static const struct uccl__sg_dev sgfake_ops = {
    .memops = f_memops, .copies = f_copies, .reduce = f_reduce, .event_new = f_event_new,
    .event_free = f_event_free, .record = f_record, .wait_event = f_wait_event,
    .query = f_query, .reg = f_reg, .key = f_key, .dereg = f_dereg, .map = f_map,
    .unmap = f_unmap, .destroy = f_destroy,
};

#endif
