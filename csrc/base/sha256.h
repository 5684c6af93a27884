/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the handshake's
 * proofs (tp/handshake.c): the engine links no crypto library, and these
 * two are all it needs.  Incremental (init, update, final) and one-shot
 * forms; the known-answer tests (FIPS 180-4's examples, RFC 4231's HMAC
 * cases) run through the module's _sha256 and _hmac_sha256
 * (tests/test_handshake_crypto.py). */
#ifndef UCCL_SHA256_H
#define UCCL_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define UCCL_SHA256_BYTES 32

struct uccl__sha256 {
    uint32_t h[8];
    uint64_t bytes;     /* hashed so far */
    uint8_t buf[64];    /* a partial block */
    size_t n;           /* bytes in buf */
};

void uccl__sha256_init(struct uccl__sha256 *s);
void uccl__sha256_update(struct uccl__sha256 *s, const void *data, size_t len);
void uccl__sha256_final(struct uccl__sha256 *s, uint8_t out[UCCL_SHA256_BYTES]);
void uccl__sha256(const void *data, size_t len, uint8_t out[UCCL_SHA256_BYTES]);

struct uccl__hmac {
    struct uccl__sha256 inner, outer;
};

/* Any key length (0 included: an endpoint without a secret). */
void uccl__hmac_init(struct uccl__hmac *m, const void *key, size_t key_len);
void uccl__hmac_update(struct uccl__hmac *m, const void *data, size_t len);
void uccl__hmac_final(struct uccl__hmac *m, uint8_t out[UCCL_SHA256_BYTES]);
void uccl__hmac_sha256(const void *key, size_t key_len, const void *data, size_t len,
                       uint8_t out[UCCL_SHA256_BYTES]);

/* 1 if a and b hold the same n bytes; the time does not depend on where
 * they differ (a proof compared byte by byte must not tell how much of a
 * guess was right). */
int uccl__ct_equal(const void *a, const void *b, size_t n);

#endif
