/* Plays inputs through a harness without libFuzzer: each argument is a file
 * or a folder of files (not recursive).  Exits 0 once every input ran; a
 * harness that finds a broken promise aborts, and a sanitizer's report
 * stops the process, so a non-zero exit names a bad input (printed before
 * it runs).  For compilers without -fsanitize=fuzzer (gcc), and for CI
 * where clang is missing: the corpus and the kept crash inputs still run,
 * under ASan and UBSan where the compiler has them. */
#define _GNU_SOURCE
#include <dirent.h>
#include <sys/stat.h>

#include "fuzz.h"

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return 1;
    }
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap)
            buf = realloc(buf, cap *= 2);
    }
    fclose(f);
    if (!buf) {
        fprintf(stderr, "%s: out of memory\n", path);
        return 1;
    }
    /* exactly n bytes on the heap, as libFuzzer hands them: an overread is seen */
    uint8_t *exact = malloc(n ? n : 1);
    memcpy(exact, buf, n);
    free(buf);
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, n);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv)
{
    int bad = 0, ran = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            perror(argv[i]);
            return 2;
        }
        if (!S_ISDIR(st.st_mode)) {
            bad |= run_file(argv[i]);
            ran++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        char **names = NULL;
        size_t nn = 0;
        for (struct dirent *e; d && (e = readdir(d));) {
            if (e->d_name[0] == '.')
                continue;
            names = realloc(names, (nn + 1) * sizeof(*names));
            if (asprintf(&names[nn++], "%s/%s", argv[i], e->d_name) < 0)
                return 2;
        }
        if (d)
            closedir(d);
        qsort(names, nn, sizeof(*names), cmp); /* the same order every run */
        for (size_t k = 0; k < nn; k++) {
            bad |= run_file(names[k]);
            ran++;
            free(names[k]);
        }
        free(names);
    }
    printf("replay: %d inputs ran%s\n", ran, bad ? ", some could not be read" : "");
    return bad ? 2 : 0;
}
