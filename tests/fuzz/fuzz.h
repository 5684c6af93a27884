/* What every harness here shares.  A harness is one libFuzzer entry point,
 * LLVMFuzzerTestOneInput, over the bytes a peer controls; it returns 0 and
 * stops the process (abort, through CHECK) where a decoder accepted what it
 * must refuse.  Built with clang's -fsanitize=fuzzer (libFuzzer drives it)
 * or with any C compiler and replay.c (plays back files: the seed corpus
 * and the crash inputs kept as regression inputs).  tests/_fuzz.py builds
 * them; docs/testing.md says how to run them. */
#ifndef UCCL_FUZZ_H
#define UCCL_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A broken promise of a decoder: say which, and stop (the fuzzer keeps the input). */
#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "%s:%d: decoder accepted a record where %s is false\n",   \
                    __FILE__, __LINE__, #cond);                                       \
            abort();                                                                  \
        }                                                                             \
    } while (0)

/* Built with -DFUZZ_VERBOSE: what each input came to (the status and its
 * reason), to see which inputs of a corpus get how far. */
#ifdef FUZZ_VERBOSE
const char *uccl_last_error(void);
#define FUZZ_SAY(rc) fprintf(stderr, "  -> %d %s\n", rc, (rc) ? uccl_last_error() : "")
#else
#define FUZZ_SAY(rc) (void)(rc)
#endif

/* The first n bytes of the input (zeros past its end), in a heap block of
 * exactly n bytes: a decoder that reads past its record is caught by ASan. */
static inline uint8_t *fuzz_record(const uint8_t *data, size_t size, size_t n)
{
    uint8_t *p = calloc(1, n);
    if (!p)
        abort();
    memcpy(p, data, size < n ? size : n);
    return p;
}

/* A C string field is terminated inside its n bytes. */
static inline int fuzz_terminated(const char *s, size_t n) { return memchr(s, 0, n) != NULL; }

#endif
