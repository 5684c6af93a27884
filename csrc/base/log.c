#define _GNU_SOURCE
#include "base/log.h"

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
    const char *env = getenv("UCCL_P2P_LOG_LEVEL");
    if (!env || !*env)
        return;
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(env, level_names[i]) == 0) {
            log_level = i;
            return;
        }
    }
    if (strcasecmp(env, "WARN") == 0)
        log_level = UCCL_LOG_WARNING;
    else if (strcasecmp(env, "DEBUG") == 0 || strcasecmp(env, "TRACE") == 0)
        log_level = UCCL_LOG_INFO;
    else
        fprintf(stderr, "[uccl WARNING] UCCL_P2P_LOG_LEVEL=%s not understood "
                        "(use INFO, WARNING, ERROR or FATAL); keeping WARNING\n", env);
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
