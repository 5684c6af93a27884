/* A stream-ordered group's point-to-point messages (sg/sg_p2p.c): what this
 * rank reads of a channel's slot in the shared page, written by the peer's
 * host (the slot's state: message number and arrival bits; the peer's
 * descriptor: key, address, length), on a device that checks every range
 * it is handed (sgfake.h).
 *
 * Input: n = 2 + b0 % 3 ranks, this rank b1 % n, the peer b2 (another
 * rank), flags b3 (bit 0: send, else receive; bit 1: a staging arena for
 * sends to that peer; bit 2: two messages), the length (u16 at 4, at most
 * 4096); then the channel's slots of messages 1 and 2 (64 bytes each).
 *
 * Promises: the peer's buffer is mapped only as the peer described it, and
 * only for a message of the same length; copies and word writes stay
 * inside this rank's memory and the mapped ranges; a post that fails says
 * why; a group closed cleanly has let go of every mapping. */
#include "sgfake.h"
#include "sg/sg_page.h"

static uint8_t *page;
static int nranks, me, peer, sending;
static size_t msg_len;

static struct p2p_chan *chan(void)
{
    int src = sending ? me : peer, dst = sending ? peer : me;
    return (struct p2p_chan *)(page + PAGE + (size_t)nranks * RANK_BYTES) +
           (src * nranks + dst);
}

static int sgfake_allowed(int r, uint64_t key, uint64_t addr, size_t len)
{
    if (r != peer || len != msg_len)
        return 0;
    for (int k = 1; k <= 2; k++) { /* the peer's side of message 1 or 2 */
        const struct p2p_desc *d = &chan()->slot[k].d[sending ? P2P_DST : P2P_SRC];
        if (d->key == key && d->addr == addr && d->len == len)
            return 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t hd[6] = {0};
    memcpy(hd, data, size < sizeof(hd) ? size : sizeof(hd));
    nranks = 2 + hd[0] % 3;
    me = hd[1] % nranks;
    peer = (me + 1 + hd[2] % (nranks - 1)) % nranks;
    sending = hd[3] & 1;
    int staging = hd[3] & 2, nmsg = hd[3] & 4 ? 2 : 1;
    msg_len = (size_t)(hd[4] | hd[5] << 8) % 4097;

    size_t bytes = uccl_sg_page_bytes(nranks);
    page = aligned_alloc(PAGE, bytes);
    memset(page, 0, bytes);
    if (size > sizeof(hd)) {
        size_t n = size - sizeof(hd) < 2 * sizeof(struct p2p_slot) ? size - sizeof(hd)
                                                                    : 2 * sizeof(struct p2p_slot);
        memcpy(&chan()->slot[1], data + sizeof(hd), n);
    }
    sgfake_reset();
    sgfake_own((uintptr_t)page + PAGE + (size_t)me * RANK_BYTES, RANK_BYTES);
    sgfake_own((uintptr_t)page + PAGE + (size_t)nranks * RANK_BYTES,
               bytes - PAGE - (size_t)nranks * RANK_BYTES);
    uint8_t *buf = malloc(msg_len + 1), *arena = malloc(16 * 4096);
    sgfake_own((uintptr_t)buf, msg_len + 1);
    sgfake_own((uintptr_t)arena, 16 * 4096);
    uccl_sg_t *sg = NULL;
    if (uccl_sg_new(page, bytes, me, nranks, 0.005, 1, &sgfake_ops, NULL, &sg))
        abort();
    if (staging)
        CHECK(uccl_sg_p2p_arena(sg, peer, (uintptr_t)arena, 16 * 4096) == 0);
    struct uccl_sg_p2p_op ops[2];
    for (int i = 0; i < 2; i++)
        ops[i] = (struct uccl_sg_p2p_op){peer, sending, (uintptr_t)buf, msg_len, 2};
    uint64_t codes[2] = {0, 0};
    int rc = uccl_sg_p2p(sg, ops, nmsg, 1, NULL, NULL, codes);
    FUZZ_SAY(rc);
    if (rc) {
        CHECK(uccl_last_error()[0] != '\0');
    } else {
        for (int i = 0; i < nmsg; i++) {
            CHECK(uccl_sg_p2p_passed(sg, codes[i]) >= 0);
            CHECK(uccl_sg_p2p_wait(sg, codes[i], 3) == 0 || uccl_sg_error(sg));
        }
    }
    const char *why = uccl_sg_error(sg);
    CHECK(!why || memchr(why, 0, REASON));
    if (uccl_sg_close(sg))
        CHECK(live_maps == 0);
    free(buf);
    free(arena);
    free(page);
    return 0;
}
