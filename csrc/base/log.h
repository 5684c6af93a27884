/* Levelled logging to stderr.  UCCL_P2P_LOG_LEVEL=INFO|WARNING|ERROR|FATAL
 * (default WARNING) is read once. */
#ifndef UCCL_LOG_H
#define UCCL_LOG_H

enum { UCCL_LOG_INFO = 0, UCCL_LOG_WARNING = 1, UCCL_LOG_ERROR = 2, UCCL_LOG_FATAL = 3 };

int uccl__log_enabled(int level);
void uccl__log(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define UCCL_LOG(level, ...)                                                  \
    do {                                                                      \
        if (uccl__log_enabled(level))                                         \
            uccl__log(level, __FILE__, __LINE__, __VA_ARGS__);                \
    } while (0)
#define LOG_INFO(...)  UCCL_LOG(UCCL_LOG_INFO, __VA_ARGS__)
#define LOG_WARN(...)  UCCL_LOG(UCCL_LOG_WARNING, __VA_ARGS__)
#define LOG_ERROR(...) UCCL_LOG(UCCL_LOG_ERROR, __VA_ARGS__)

#endif
