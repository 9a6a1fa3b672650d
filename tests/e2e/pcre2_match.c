/* pcre2_match: the independent check of guided_regex outputs (tests/e2e/structured.sh). Usage:
 * pcre2_match REGEX FILE COUNT, FILE holding COUNT outputs, each ended by a NUL byte (an empty
 * output too); each must match REGEX as a whole under PCRE2 (UTF, anchored at both ends). Prints
 * "N of M match" and each output that does not; exit 0 when all COUNT match, 1 when one does not
 * or FILE holds another number of outputs, 2 on a usage or regex error. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    if (argc != 4 || atoi(argv[3]) < 1) {
        fprintf(stderr, "usage: pcre2_match REGEX FILE COUNT\n");
        return 2;
    }
    int want = atoi(argv[3]);
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)argv[1], PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_ANCHORED | PCRE2_ENDANCHORED, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        fprintf(stderr, "pcre2_match: %s at offset %zu of %s\n", (char *)msg, (size_t)eo, argv[1]);
        return 2;
    }
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        fprintf(stderr, "pcre2_match: cannot open %s\n", argv[2]);
        return 2;
    }
    size_t cap = 1 << 16, len = 0, got;
    char *buf = malloc(cap);
    while (buf && (got = fread(buf + len, 1, cap - len, f)) > 0)
        if ((len += got) == cap)
            buf = realloc(buf, cap *= 2);
    fclose(f);
    if (!buf)
        return 2;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int n = 0, ok = 0;
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && buf[j])
            j++;
        n++;
        int rc = pcre2_match(re, (PCRE2_SPTR)buf + i, j - i, 0, 0, md, NULL);
        if (rc >= 0)
            ok++;
        else
            printf("no match: \"%.*s\"\n", (int)(j - i), buf + i);
        i = j + 1;
    }
    printf("%d of %d match %s%s\n", ok, n, argv[1], n == want ? "" : " (the file holds another number of outputs)");
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    free(buf);
    return ok == n && n == want ? 0 : 1;
}
