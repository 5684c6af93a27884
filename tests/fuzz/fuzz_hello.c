/* The handshake record (net/wire.c uccl__hello_decode): the first bytes an
 * unauthenticated peer sends.  A record the decoder accepts keeps its
 * promises (lengths and counts in range, strings terminated), and encoding
 * it again gives a record the decoder reads back to the same bytes. */
#include "fuzz.h"
#include "net/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *in = fuzz_record(data, size, UCCL_HELLO_SIZE);
    struct uccl__hello h, h2;
    if (uccl__hello_decode(in, &h) == 0) {
        CHECK(h.type >= UCCL_HELLO_CONN && h.type <= UCCL_HELLO_ACK);
        CHECK(h.secret_len <= UCCL_SECRET_MAX);
        CHECK(fuzz_terminated(h.host_id, sizeof(h.host_id)));
        CHECK(fuzz_terminated(h.shm_name, sizeof(h.shm_name)));
        CHECK(h.transport < UCCL_TP_COUNT);
        CHECK(h.num_streams >= 1 && h.num_streams <= UCCL_MAX_STREAMS);
        CHECK(h.stream_index < h.num_streams);
        uint8_t *again = malloc(UCCL_HELLO_SIZE), *third = malloc(UCCL_HELLO_SIZE);
        uccl__hello_encode(&h, again);
        CHECK(uccl__hello_decode(again, &h2) == 0);
        uccl__hello_encode(&h2, third);
        CHECK(memcmp(again, third, UCCL_HELLO_SIZE) == 0);
        free(again);
        free(third);
    }
    free(in);
    return 0;
}
