/* A small open-addressing hash map from non-zero 64-bit ids to pointers.
 * Not thread-safe: the owner's mutex protects it. */
#ifndef UCCL_IDMAP_H
#define UCCL_IDMAP_H

#include <stddef.h>
#include <stdint.h>

struct uccl__idmap {
    uint64_t *keys;   /* 0 = empty, UINT64_MAX = deleted */
    void **vals;
    size_t cap, used, live;
};

void *uccl__idmap_get(const struct uccl__idmap *m, uint64_t key);
int uccl__idmap_put(struct uccl__idmap *m, uint64_t key, void *val);
void *uccl__idmap_del(struct uccl__idmap *m, uint64_t key);
/* Calls fn on every live entry; fn may not modify the map. */
void uccl__idmap_each(const struct uccl__idmap *m, void (*fn)(uint64_t, void *, void *), void *arg);
void uccl__idmap_free(struct uccl__idmap *m);

#endif
