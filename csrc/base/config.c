/* The configuration table and its one parser (config.h). */
#include "base/config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/status.h"

static const struct uccl_cfg_entry table[UCCL_CFG_COUNT] = {
#define UCCL_X_ENTRY(name, kind, dflt, lo, hi, unit, choices, dtext, doc) \
    [UCCL_CFG_##name] = {"UCCL_" #name, UCCL_CFG_##kind, (dflt), (lo), (hi), (unit), choices,  \
                         dtext, doc},
    UCCL_CONFIG_TABLE(UCCL_X_ENTRY)
#undef UCCL_X_ENTRY
};

const struct uccl_cfg_entry *uccl__cfg_entry(int id)
{
    return id >= 0 && id < UCCL_CFG_COUNT ? &table[id] : NULL;
}

int uccl__cfg_find(const char *name)
{
    for (int i = 0; i < UCCL_CFG_COUNT; i++)
        if (strcmp(table[i].name, name) == 0)
            return i;
    return -1;
}

/* A decimal integer, the whole of s (no sign unless allow_neg). */
static int parse_int(const char *s, int allow_neg, long *v_p)
{
    char *end;
    if (!*s || isspace((unsigned char)*s) || (!allow_neg && *s == '-') || *s == '+')
        return -1;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end)
        return -1;
    *v_p = v;
    return 0;
}

/* digits, then an optional K/M/G with an optional "iB" or "B" (any case);
 * without a suffix the digits count in `unit` bytes. */
static int parse_size(const char *s, long unit, long *v_p)
{
    char *end;
    if (!isdigit((unsigned char)*s))
        return -1;
    errno = 0;
    unsigned long long n = strtoull(s, &end, 10);
    if (errno)
        return -1;
    long mult = unit;
    if (*end) {
        switch (toupper((unsigned char)*end)) {
        case 'K': mult = 1L << 10; break;
        case 'M': mult = 1L << 20; break;
        case 'G': mult = 1L << 30; break;
        default: return -1;
        }
        end++;
        if (strcasecmp(end, "") != 0 && strcasecmp(end, "B") != 0 && strcasecmp(end, "iB") != 0)
            return -1;
    }
    if (n > (unsigned long long)(LONG_MAX / mult))
        return -1;
    *v_p = (long)n * mult;
    return 0;
}

static int parse_bool(const char *s, long *v_p)
{
    static const char *const no[] = {"0", "false", "no", "off"};
    static const char *const yes[] = {"1", "true", "yes", "on"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(s, no[i]) == 0)
            return *v_p = 0, 0;
        if (strcasecmp(s, yes[i]) == 0)
            return *v_p = 1, 0;
    }
    return -1;
}

/* The index of s among choices "a|b|c" (any case), or -1. */
static int parse_choice(const char *s, const char *choices)
{
    size_t n = strlen(s);
    int idx = 0;
    for (const char *p = choices;; idx++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncasecmp(p, s, n) == 0)
            return idx;
        if (!bar)
            return -1;
        p = bar + 1;
    }
}

/* n bytes as the syntax writes them: 64M, 4K, 1500 */
static const char *size_text(long n, char *buf, size_t len)
{
    static const char units[] = "GMK";
    for (int i = 0; i < 3; i++) {
        long u = 1L << (10 * (3 - i));
        if (n >= u && n % u == 0) {
            snprintf(buf, len, "%ld%c", n / u, units[i]);
            return buf;
        }
    }
    snprintf(buf, len, "%ld", n);
    return buf;
}

static int bad(const struct uccl_cfg_entry *e, const char *text)
{
    char lo[24], hi[24];
    switch (e->kind) {
    case UCCL_CFG_INT:
        return uccl__err(UCCL_ERR_INVALID, "%s=%s: expected an integer in %ld..%ld", e->name,
                         text, e->lo, e->hi);
    case UCCL_CFG_SIZE:
        return uccl__err(UCCL_ERR_INVALID, "%s=%s: expected a size in %s..%s (digits, "
                         "optionally with K, M or G; plain digits count %s)", e->name, text,
                         size_text(e->lo, lo, sizeof(lo)), size_text(e->hi, hi, sizeof(hi)),
                         e->unit == 1 ? "bytes" : "KiB");
    case UCCL_CFG_BOOL:
        return uccl__err(UCCL_ERR_INVALID, "%s=%s: expected 0 or 1 (or false/true, no/yes, "
                         "off/on)", e->name, text);
    default:
        return uccl__err(UCCL_ERR_INVALID, "%s=%s: expected one of %s", e->name, text,
                         e->choices);
    }
}

int uccl__cfg_parse(int id, const char *text, long *num_p)
{
    const struct uccl_cfg_entry *e = uccl__cfg_entry(id);
    long v = 0;
    int rc = 0;
    if (!e)
        return uccl__err(UCCL_ERR_INVALID, "no configuration variable number %d", id);
    /* Blanks around a value are no part of it (" 2M " is 2M). */
    char buf[128];
    size_t n = strlen(text);
    while (n && isspace((unsigned char)text[n - 1]))
        n--;
    while (n && isspace((unsigned char)*text))
        text++, n--;
    if (e->kind != UCCL_CFG_STR) {
        if (n >= sizeof(buf))
            return bad(e, text);
        memcpy(buf, text, n);
        buf[n] = '\0';
        text = buf;
    }
    switch (e->kind) {
    case UCCL_CFG_INT:
        rc = parse_int(text, e->lo < 0, &v);
        break;
    case UCCL_CFG_SIZE:
        rc = parse_size(text, e->unit, &v);
        break;
    case UCCL_CFG_BOOL:
        rc = parse_bool(text, &v);
        break;
    case UCCL_CFG_CHOICE:
        rc = (v = parse_choice(text, e->choices)) < 0 ? -1 : 0;
        break;
    default: /* STR */
        break;
    }
    if (rc || ((e->kind == UCCL_CFG_INT || e->kind == UCCL_CFG_SIZE) && (v < e->lo || v > e->hi)))
        return bad(e, text);
    *num_p = v;
    return UCCL_OK;
}

/* The variable's text, or NULL when unset or empty. */
static const char *text_of(const struct uccl_cfg_entry *e)
{
    const char *s = getenv(e->name);
    if (!s)
        return NULL;
    for (const char *c = s; *c; c++) /* blanks only: unset, as empty */
        if (!isspace((unsigned char)*c))
            return s;
    return NULL;
}

static int get_num(int id, int kind_ok, long *v_p)
{
    const struct uccl_cfg_entry *e = uccl__cfg_entry(id);
    if (!e || !kind_ok)
        return uccl__err(UCCL_ERR_INVALID, "configuration variable %s read as the wrong kind",
                         e ? e->name : "?");
    const char *s = text_of(e);
    if (!s) {
        *v_p = e->dflt;
        return UCCL_OK;
    }
    return uccl__cfg_parse(id, s, v_p);
}

int uccl__cfg_long(int id, long *v_p)
{
    const struct uccl_cfg_entry *e = uccl__cfg_entry(id);
    int k = e ? e->kind : -1;
    return get_num(id, k == UCCL_CFG_INT || k == UCCL_CFG_SIZE || k == UCCL_CFG_BOOL, v_p);
}

int uccl__cfg_choice(int id, int *idx_p)
{
    const struct uccl_cfg_entry *e = uccl__cfg_entry(id);
    long v;
    int rc = get_num(id, e && e->kind == UCCL_CFG_CHOICE, &v);
    if (rc == UCCL_OK)
        *idx_p = (int)v;
    return rc;
}

int uccl__cfg_str(int id, const char **v_p)
{
    const struct uccl_cfg_entry *e = uccl__cfg_entry(id);
    if (!e || e->kind != UCCL_CFG_STR)
        return uccl__err(UCCL_ERR_INVALID, "configuration variable %s is not text",
                         e ? e->name : "?");
    *v_p = text_of(e);
    return UCCL_OK;
}
