/* Control messages (net/wire.c uccl__msg_decode): every record a connected
 * peer sends on the control channel.  An accepted message has a known type
 * and lengths the handlers can add without overflow, and it is exactly its
 * bytes (encoding it again gives the input back). */
#include "fuzz.h"
#include "net/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *in = fuzz_record(data, size, UCCL_MSG_SIZE);
    struct uccl__msg m;
    if (uccl__msg_decode(in, &m) == 0) {
        CHECK(m.type >= 1 && m.type <= UCCL_MSG_TYPE_MAX);
        CHECK(m.len <= (1ull << 48) && m.offset <= (1ull << 48));
        CHECK(m.offset + m.len >= m.offset); /* what a window check adds */
        uint8_t *again = malloc(UCCL_MSG_SIZE);
        uccl__msg_encode(&m, again);
        CHECK(memcmp(again, in, UCCL_MSG_SIZE) == 0);
        free(again);
    }
    free(in);
    return 0;
}
