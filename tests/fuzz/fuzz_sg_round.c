/* A stream-ordered group's round (sg/sg_round.c, sg_call.c above it): what
 * this rank reads of its peers' slots in the shared page (the header:
 * count, kind, argument, phases, name; the entries: tag, key, address,
 * length) and of the page's header (a failed flag and its reason), on a
 * device that checks every range it is handed (sgfake.h).
 *
 * Input: n = 2 + b0 % 3 ranks, this rank b1 % n, the call b2 % 6
 * (all_reduce, reduce_scatter, allgather, broadcast, reduce, allgather as
 * a one-launch round over an arena), element type b3, operator b4, root
 * b5 % n, count (u16 at 6, at most 1024), flags b8 (bit 0: the peers'
 * round words as they come, else set to the round, so the host does not
 * wait out the timeout; bit 1: the page's failed flag set, with a reason
 * from the input); then per peer, in rank order, a u16 length and that
 * many bytes of its slot of round 1; then the reason.
 *
 * Promises: every range mapped is inside an entry the peer published
 * under that key; copies, reductions and word writes stay inside this
 * rank's memory and the mapped ranges; a round that fails says why; a
 * group closed cleanly has let go of every mapping. */
#include "sgfake.h"
#include "sg/sg_page.h"

static uint8_t *page;
static int nranks, me;

static int sgfake_allowed(int peer, uint64_t key, uint64_t addr, size_t len)
{
    if (peer < 0 || peer >= nranks || peer == me)
        return 0;
    const uint8_t *s = page + PAGE + (size_t)peer * RANK_BYTES + OFF_SLOTS; /* round 1: slot 1 */
    s += (size_t)(1 % NSLOT) * SLOT_BYTES;
    const struct slot_head *h = (const struct slot_head *)s;
    const struct entry *e = (const struct entry *)(s + sizeof(*h));
    for (uint32_t i = 0; i < h->count && i < (uint32_t)MAX_ENTRIES; i++)
        if (e[i].key == key && addr >= e[i].addr && addr - e[i].addr <= e[i].len &&
            len <= e[i].len - (addr - e[i].addr))
            return 1;
    return 0;
}

static size_t take(const uint8_t **p, size_t *left, void *out, size_t want)
{
    size_t n = *left < want ? *left : want;
    if (out)
        memcpy(out, *p, n);
    *p += n;
    *left -= n;
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t hd[9] = {0};
    const uint8_t *p = data;
    size_t left = size;
    take(&p, &left, hd, sizeof(hd));
    nranks = 2 + hd[0] % 3;
    me = hd[1] % nranks;
    int op = hd[2] % 6, dtype = hd[3] % UCCL_DT_COUNT, red = hd[4] % UCCL_RED_COUNT;
    int root = hd[5] % nranks, flags = hd[8];
    size_t count = (size_t)(hd[6] | hd[7] << 8) % 1025;
    size_t esz = uccl_dtype_size(dtype), nb = count * esz;

    size_t bytes = uccl_sg_page_bytes(nranks);
    page = aligned_alloc(PAGE, bytes);
    memset(page, 0, bytes);
    for (int r = 0; r < nranks; r++) {
        if (r == me)
            continue;
        uint8_t l2[2] = {0};
        take(&p, &left, l2, 2);
        size_t l = (size_t)(l2[0] | l2[1] << 8) % (SLOT_BYTES + 1);
        uint8_t *s = page + PAGE + (size_t)r * RANK_BYTES + OFF_SLOTS + (1 % NSLOT) * SLOT_BYTES;
        take(&p, &left, s, l);
        if (!(flags & 1))
            ((struct slot_head *)s)->round = 1;
    }
    if (flags & 2) {
        take(&p, &left, page + 8, REASON);
        *(uint32_t *)page = FLAG_FAILED;
    }

    sgfake_reset();
    sgfake_own((uintptr_t)page + PAGE + (size_t)me * RANK_BYTES, RANK_BYTES);
    sgfake_own((uintptr_t)page + PAGE + (size_t)nranks * RANK_BYTES,
               bytes - PAGE - (size_t)nranks * RANK_BYTES); /* the channels (this side's words) */
    /* this rank's buffers: in (n x nb where the call takes that many), out */
    size_t in_len = (op == 1 || op == 2 || op == 5 ? (size_t)nranks : 1) * nb + 1;
    uint8_t *in = malloc(in_len), *out = malloc(nb + 1), *arena = NULL;
    sgfake_own((uintptr_t)in, in_len);
    sgfake_own((uintptr_t)out, nb + 1);
    uccl_sg_t *sg = NULL;
    if (uccl_sg_new(page, bytes, me, nranks, 0.005, 1, &sgfake_ops, NULL, &sg))
        abort();
    int rc = 0;
    if (op == 5) { /* slots of 1 KiB: counts up to 1024 bytes go as one launch */
        size_t alen = 2 * 1024 + UCCL_SG_FUSED_TAIL;
        arena = aligned_alloc(16, alen);
        memset(arena, 0, alen);
        sgfake_own((uintptr_t)arena, alen);
        rc = uccl_sg_fused_arena(sg, (uintptr_t)arena, alen, 1024);
        CHECK(rc == 0);
    }
    struct uccl_sg_opts o = {.caller = 1};
    uint32_t k = 0;
    switch (op) {
    case 0: rc = uccl_sg_allreduce(sg, &o, (uintptr_t)in, count, dtype, red, &k); break;
    case 1: rc = uccl_sg_reduce_scatter(sg, &o, (uintptr_t)out, (uintptr_t)in, count, dtype, red,
                                        &k); break;
    case 2: case 5: rc = uccl_sg_allgather(sg, &o, (uintptr_t)out, count, (uintptr_t)in, &k); break;
    case 3: rc = uccl_sg_broadcast(sg, &o, (uintptr_t)in, count, root, &k); break;
    default: rc = uccl_sg_reduce(sg, &o, (uintptr_t)in, count, dtype, red, root, &k); break;
    }
    FUZZ_SAY(rc);
    if (rc) {
        CHECK(uccl_last_error()[0] != '\0');
    } else {
        CHECK(k == 1);
    }
    const char *why = uccl_sg_error(sg);
    CHECK(!why || memchr(why, 0, REASON));
    if (uccl_sg_close(sg))
        CHECK(live_maps == 0); /* closed cleanly: every mapping let go */
    free(in);
    free(out);
    free(arena);
    free(page);
    return 0;
}
