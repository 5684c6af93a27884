#include "base/idmap.h"

#include <stdlib.h>

#include "base/status.h"

#define TOMB UINT64_MAX

static size_t slot_of(uint64_t key, size_t cap)
{
    key ^= key >> 33; /* ids are sequential: mix so they spread */
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return (size_t)key & (cap - 1);
}

void *uccl__idmap_get(const struct uccl__idmap *m, uint64_t key)
{
    if (!m->cap || key == 0 || key == TOMB)
        return NULL;
    for (size_t i = slot_of(key, m->cap), n = 0; n < m->cap; i = (i + 1) & (m->cap - 1), n++) {
        if (m->keys[i] == key)
            return m->vals[i];
        if (m->keys[i] == 0)
            return NULL;
    }
    return NULL;
}

static int grow(struct uccl__idmap *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 64;
    if (m->live * 4 < m->cap)
        ncap = m->cap; /* mostly tombstones: rehash in place size */
    uint64_t *nk = calloc(ncap, sizeof(*nk));
    void **nv = calloc(ncap, sizeof(*nv));
    if (!nk || !nv) {
        free(nk);
        free(nv);
        return uccl__err(UCCL_ERR_NOMEM, "id map: out of memory growing to %zu", ncap);
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == 0 || m->keys[i] == TOMB)
            continue;
        size_t j = slot_of(m->keys[i], ncap);
        while (nk[j])
            j = (j + 1) & (ncap - 1);
        nk[j] = m->keys[i];
        nv[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = nk;
    m->vals = nv;
    m->cap = ncap;
    m->used = m->live;
    return UCCL_OK;
}

int uccl__idmap_put(struct uccl__idmap *m, uint64_t key, void *val)
{
    if (key == 0 || key == TOMB)
        return uccl__err(UCCL_ERR_INVALID, "id map: reserved key");
    if ((m->used + 1) * 4 >= m->cap * 3) {
        int rc = grow(m);
        if (rc)
            return rc;
    }
    size_t i = slot_of(key, m->cap), tomb = (size_t)-1;
    for (;; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) {
            m->vals[i] = val;
            return UCCL_OK;
        }
        if (m->keys[i] == TOMB && tomb == (size_t)-1)
            tomb = i;
        if (m->keys[i] == 0)
            break;
    }
    if (tomb != (size_t)-1)
        i = tomb;
    else
        m->used++;
    m->keys[i] = key;
    m->vals[i] = val;
    m->live++;
    return UCCL_OK;
}

void *uccl__idmap_del(struct uccl__idmap *m, uint64_t key)
{
    if (!m->cap || key == 0 || key == TOMB)
        return NULL;
    for (size_t i = slot_of(key, m->cap), n = 0; n < m->cap; i = (i + 1) & (m->cap - 1), n++) {
        if (m->keys[i] == key) {
            void *v = m->vals[i];
            m->keys[i] = TOMB;
            m->vals[i] = NULL;
            m->live--;
            return v;
        }
        if (m->keys[i] == 0)
            return NULL;
    }
    return NULL;
}

void uccl__idmap_each(const struct uccl__idmap *m, void (*fn)(uint64_t, void *, void *), void *arg)
{
    for (size_t i = 0; i < m->cap; i++)
        if (m->keys[i] && m->keys[i] != TOMB)
            fn(m->keys[i], m->vals[i], arg);
}

void uccl__idmap_free(struct uccl__idmap *m)
{
    free(m->keys);
    free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
    m->cap = m->used = m->live = 0;
}
