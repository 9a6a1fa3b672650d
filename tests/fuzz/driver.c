/* driver.c: a standalone stand-in for libFuzzer, so every fuzz target also builds with gcc and
 * runs for a few seconds under ctest. It runs each seed file (arguments may be files or
 * folders), then mutates seeds (bit flips, byte edits, inserts, deletes, splices) with a fixed
 * PRNG seed until -max_total_time=S or -runs=N. A crash or hang is the failure; it prints the
 * number of inputs run. Accepts libFuzzer's -flag=value style and ignores flags it does not know. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_SEEDS 1024
#define MAX_LEN (64 * 1024)

static uint8_t *seeds[MAX_SEEDS];
static size_t seed_len[MAX_SEEDS];
static size_t n_seeds;

static void add_seed(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f || n_seeds == MAX_SEEDS) {
        if (f)
            fclose(f);
        return;
    }
    uint8_t *buf = malloc(MAX_LEN);
    size_t n = buf ? fread(buf, 1, MAX_LEN, f) : 0;
    fclose(f);
    if (!buf)
        return;
    seeds[n_seeds] = buf;
    seed_len[n_seeds++] = n;
}

static void add_path(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return;
    if (!S_ISDIR(st.st_mode)) {
        add_seed(path);
        return;
    }
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char full[4096];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        add_path(full);
    }
    if (d)
        closedir(d);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static size_t mutate(uint8_t *buf, size_t len, size_t cap)
{
    static const uint8_t interesting[] = {0, 1, 0x7f, 0x80, 0xff, '"', '{', '}', '[', ']', ':',
                                          ',', '\\', '0', '9', '-', '%', '{', '#', ' '};
    int n_edits = 1 + (int)(next() % 4);
    for (int k = 0; k < n_edits; k++) {
        size_t pos = len ? next() % len : 0;
        switch (next() % 6) {
        case 0: if (len) buf[pos] ^= (uint8_t)(1u << (next() % 8)); break;
        case 1: if (len) buf[pos] = interesting[next() % sizeof interesting]; break;
        case 2: if (len) buf[pos] = (uint8_t)next(); break;
        case 3: /* insert */
            if (len < cap) {
                memmove(buf + pos + 1, buf + pos, len - pos);
                buf[pos] = interesting[next() % sizeof interesting];
                len++;
            }
            break;
        case 4: /* delete a run */
            if (len) {
                size_t n = 1 + next() % 8;
                if (n > len - pos)
                    n = len - pos;
                memmove(buf + pos, buf + pos + n, len - pos - n);
                len -= n;
            }
            break;
        case 5: /* splice a piece of another seed */
            if (n_seeds) {
                size_t s = next() % n_seeds;
                if (seed_len[s]) {
                    size_t from = next() % seed_len[s];
                    size_t n = 1 + next() % 64;
                    if (n > seed_len[s] - from)
                        n = seed_len[s] - from;
                    if (n > cap - pos)
                        n = cap - pos;
                    memcpy(buf + pos, seeds[s] + from, n);
                    if (pos + n > len)
                        len = pos + n;
                }
            }
            break;
        }
    }
    return len;
}

int main(int argc, char **argv)
{
    double max_time = 5;
    long long max_runs = -1;
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "-max_total_time=", 16) == 0)
            max_time = atof(argv[i] + 16);
        else if (strncmp(argv[i], "-runs=", 6) == 0)
            max_runs = atoll(argv[i] + 6);
        else if (argv[i][0] != '-')
            add_path(argv[i]);
    }
    long long runs = 0;
    for (size_t i = 0; i < n_seeds; i++, runs++)
        LLVMFuzzerTestOneInput(seeds[i], seed_len[i]);
    static uint8_t buf[MAX_LEN];
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (max_runs >= 0 && runs >= max_runs)
            break;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) * 1e-9 >= max_time)
            break;
        size_t len = 0;
        if (n_seeds) {
            size_t s = next() % n_seeds;
            len = seed_len[s];
            memcpy(buf, seeds[s], len);
        }
        len = mutate(buf, len, sizeof buf);
        /* Hand the target an exact-size heap copy so overreads are visible to ASan. */
        uint8_t *copy = malloc(len ? len : 1);
        memcpy(copy, buf, len);
        LLVMFuzzerTestOneInput(copy, len);
        free(copy);
        runs++;
    }
    printf("fuzz: %lld inputs (%zu seeds), no crash\n", runs, n_seeds);
    for (size_t i = 0; i < n_seeds; i++)
        free(seeds[i]);
    return 0;
}
