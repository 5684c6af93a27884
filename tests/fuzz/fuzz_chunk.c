/* The data chunk header of the TCP data streams (net/wire.c
 * uccl__chunk_decode): 32 bytes, then (here) the receiver's bound as 8
 * more.  An accepted header has a known kind and 1..bound bytes, and is
 * exactly its bytes. */
#include "fuzz.h"
#include "net/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *in = fuzz_record(data, size, UCCL_CHUNK_HDR_SIZE);
    uint64_t max_len = 1 << 20;
    if (size >= UCCL_CHUNK_HDR_SIZE + 8)
        memcpy(&max_len, data + UCCL_CHUNK_HDR_SIZE, 8);
    struct uccl__chunk_hdr c;
    if (uccl__chunk_decode(in, max_len, &c) == 0) {
        CHECK(c.kind >= UCCL_DATA_SEND && c.kind <= UCCL_DATA_READ);
        CHECK(c.len >= 1 && c.len <= max_len);
        uint8_t *again = malloc(UCCL_CHUNK_HDR_SIZE);
        uccl__chunk_encode(&c, again);
        CHECK(memcmp(again, in, UCCL_CHUNK_HDR_SIZE) == 0);
        free(again);
    }
    free(in);
    return 0;
}
