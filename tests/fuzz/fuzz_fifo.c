/* One-sided descriptors: the 64-byte fifo item a peer hands out
 * (net/wire.c uccl_fifo_read, uccl__fifo_decode; any length), and what a
 * peer may then ask of this process's windows (mem/mem.c
 * uccl__mem_window_check, the target's check of a write or read request).
 *
 * Input: the descriptor (its first 64 bytes; the whole input goes to the
 * decoder), then a request: a byte of flags, the window, token, offset and
 * length (8 bytes each), the connection (1 byte).  Flags bit 0: the request names
 * the decoded descriptor's window, offset and length (an honest initiator);
 * bit 1: it carries the window's true token (a fuzzer cannot guess a
 * random one; a peer that was given the descriptor knows it).
 *
 * Promises: an accepted descriptor's range lies past its window's start
 * without overflow; an accepted request lies inside the window advertised
 * to that connection, inside its registered region. */
#include "fuzz.h"
#include "mem/mem.h"
#include "net/wire.h"

#define REGION 4096
static struct uccl__mem mem;
static uint8_t *region;
static uint64_t mr_id;
/* windows 1..3: the whole region to connection 1, a part of it to
 * connection 1, a part to connection 2 */
static struct uccl__fifo_item win[3];
static const uint64_t win_conn[3] = {1, 1, 2};
static const size_t win_off[3] = {0, 1000, 3000}, win_len[3] = {REGION, 500, 96};

static int no_reg(struct uccl__mem *m, struct uccl__mr *mr) { (void)m, (void)mr; return 0; }
static void no_dereg(struct uccl__mem *m, struct uccl__mr *mr) { (void)m, (void)mr; }
static const struct uccl__mem_hooks hooks = {no_reg, no_dereg};

static void setup(void)
{
    if (region)
        return;
    region = malloc(REGION);
    uccl__mem_init(&mem, &hooks);
    if (uccl__mem_reg(&mem, (uintptr_t)region, REGION, &mr_id))
        abort();
    for (int i = 0; i < 3; i++)
        if (uccl__mem_advertise(&mem, win_conn[i], mr_id, (uintptr_t)region + win_off[i],
                                win_len[i], &win[i]))
            abort();
}

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    uint8_t *in = malloc(size ? size : 1); /* exactly size bytes: an overread is seen */
    memcpy(in, data, size);
    uint64_t fields[5];
    struct uccl__fifo_item f = {0};
    int ok = uccl_fifo_read(in, size, fields) == 0;
    if (ok) {
        CHECK(size == UCCL_FIFO_ITEM_SIZE);
        CHECK(uccl__fifo_decode(in, size, &f) == 0);
        CHECK(f.window == fields[0] && f.token == fields[1] && f.addr == fields[2] &&
              f.len == fields[3] && f.base == fields[4]);
        CHECK(!f.base || (f.addr >= f.base && uccl__fifo_offset(&f) + f.len >= f.len));
        uint8_t *again = malloc(UCCL_FIFO_ITEM_SIZE);
        uccl_fifo_make(f.window, f.token, f.addr, f.len, f.base, again);
        CHECK(uccl__fifo_decode(again, UCCL_FIFO_ITEM_SIZE, &f) == 0);
        free(again);
    }
    /* the request a peer sends for it (as a WREQ/RREQ), checked by the target */
    uint8_t req[34] = {0};
    if (size > UCCL_FIFO_ITEM_SIZE)
        memcpy(req, data + UCCL_FIFO_ITEM_SIZE,
               size - UCCL_FIFO_ITEM_SIZE < sizeof(req) ? size - UCCL_FIFO_ITEM_SIZE : sizeof(req));
    uint64_t window = rd64(req + 1), token = rd64(req + 9), offset = rd64(req + 17);
    uint64_t len = rd64(req + 25), conn = req[33] % 4;
    if ((req[0] & 1) && ok) {
        window = f.window;
        token = f.token;
        offset = uccl__fifo_offset(&f);
        len = f.len;
    }
    if ((req[0] & 2) && window >= 1 && window <= 3)
        token = win[window - 1].token;
    int st = 0;
    struct uccl__window *w = uccl__mem_window_check(&mem, conn, window, token, offset, len, &st);
    if (w) {
        CHECK(window >= 1 && window <= 3);
        int i = (int)window - 1;
        CHECK(conn == win_conn[i] && token == win[i].token);
        CHECK(offset <= win_len[i] && len <= win_len[i] - offset);
        uintptr_t lo = w->addr + offset;
        CHECK(lo >= (uintptr_t)region + win_off[i]);
        CHECK(lo + len <= (uintptr_t)region + win_off[i] + win_len[i]);
        CHECK(lo + len <= (uintptr_t)region + REGION);
        CHECK(w->mr != NULL);
        uccl__mem_release_hold(&mem, w->mr);
        free(w);
    } else {
        CHECK(st < 0);
    }
    free(in);
    return 0;
}
