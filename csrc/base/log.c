#define _GNU_SOURCE
#include "base/log.h"

#include "base/config.h"
#include "base/status.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

/* Write-once: set under pthread_once, read-only afterwards. */
static int log_level = UCCL_LOG_WARNING;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static const char *const level_names[] = {"INFO", "WARNING", "ERROR", "FATAL"};

static void log_init(void)
{
    /* INFO|WARNING|ERROR|FATAL|WARN|DEBUG|TRACE (base/config.h), in this order */
    static const int level_of[] = {UCCL_LOG_INFO, UCCL_LOG_WARNING, UCCL_LOG_ERROR, UCCL_LOG_FATAL,
                                   UCCL_LOG_WARNING, UCCL_LOG_INFO, UCCL_LOG_INFO};
    char saved[512]; /* the caller's error message, which a bad value would replace */
    snprintf(saved, sizeof(saved), "%s", uccl_last_error());
    int idx;
    if (uccl__cfg_choice(UCCL_CFG_P2P_LOG_LEVEL, &idx) == UCCL_OK) {
        log_level = level_of[idx];
        return;
    }
    /* Logging has no caller to raise to: say so once and keep WARNING
     * (endpoint creation raises on the same value). */
    fprintf(stderr, "[uccl WARNING] %s; keeping WARNING\n", uccl_last_error());
    uccl__err(UCCL_OK, "%s", saved);
}

int uccl__log_enabled(int level)
{
    pthread_once(&log_once, log_init);
    return level >= log_level;
}

void uccl__log(int level, const char *file, int line, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* One fprintf per line so lines from several threads do not interleave. */
    fprintf(stderr, "[uccl %s %ld.%06ld pid %d %s:%d] %s\n",
            level_names[level < 0 ? 0 : level > 3 ? 3 : level],
            (long)ts.tv_sec, ts.tv_nsec / 1000L, (int)getpid(),
            base ? base + 1 : file, line, msg);
}
