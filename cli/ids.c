/* ids.c: reading token ids from the command line ("1,2,3", "1 2 3" or "[1, 2, 3]"), for every
 * subcommand that takes them. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"

static int is_sep(char c) { return c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '[' || c == ']'; }

kvf_status kvf_cli_parse_ids(const char *what, const char *s, int32_t **out, size_t *n_out, kvf_err *err)
{
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids)
        return kvf_err_set(err, KVF_ERR_NOMEM, "%s: out of memory", what);
    const char *p = s;
    for (;;) {
        while (is_sep(*p))
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && !is_sep(*end) ) || *end == '[') {
            free(ids);
            size_t len = strcspn(p, ", \t\n]");
            return kvf_err_set(err, KVF_ERR_INVALID,
                               "%s: '%.*s' is not a token id (use non-negative integers, e.g. 1,2,3)", what,
                               (int)(len > 40 ? 40 : len), p);
        }
        if (n == cap) {
            int32_t *g = realloc(ids, (cap *= 2) * sizeof *g);
            if (!g) {
                free(ids);
                return kvf_err_set(err, KVF_ERR_NOMEM, "%s: out of memory", what);
            }
            ids = g;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    *out = ids;
    *n_out = n;
    return KVF_OK;
}
