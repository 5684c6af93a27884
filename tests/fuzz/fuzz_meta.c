/* Endpoint metadata (net/wire.c uccl__meta_decode, and uccl_parse_metadata
 * above it): the bytes a peer's get_metadata() gave, passed on by whatever
 * the job exchanges them through, any length.  An accepted record has a
 * port, a secret that fits and terminated strings; this engine's own form
 * encodes back to a record that decodes to the same. */
#include "fuzz.h"
#include "ep/uccl.h"
#include "net/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *in = malloc(size ? size : 1); /* exactly size bytes: an overread is seen */
    memcpy(in, data, size);
    struct uccl__meta m, m2;
    int rc = uccl__meta_decode(in, size, &m);
    if (rc == 0) {
        CHECK(size == UCCL_META_SIZE || size == UCCL_META_UPSTREAM_SIZE);
        CHECK(m.port >= 1 && m.port <= 65535);
        CHECK(m.secret_len <= UCCL_SECRET_MAX);
        CHECK(fuzz_terminated(m.ip, sizeof(m.ip)));
        CHECK(fuzz_terminated(m.host_id, sizeof(m.host_id)));
        uint8_t *again = malloc(UCCL_META_SIZE);
        uccl__meta_encode(&m, again);
        CHECK(uccl__meta_decode(again, UCCL_META_SIZE, &m2) == 0);
        CHECK(m2.port == m.port && m2.gpu_idx == m.gpu_idx && m2.secret_len == m.secret_len);
        CHECK(memcmp(m2.secret, m.secret, m.secret_len) == 0);
        CHECK(strcmp(m2.ip, m.ip) == 0 && strcmp(m2.host_id, m.host_id) == 0);
        free(again);
    }
    char ip[46];
    int port = 0, gpu = 0;
    if (uccl_parse_metadata(in, size, ip, &port, &gpu) == 0) {
        CHECK(rc == 0 && port == (int)m.port && gpu == m.gpu_idx);
        CHECK(fuzz_terminated(ip, sizeof(ip)));
    }
    free(in);
    return 0;
}
