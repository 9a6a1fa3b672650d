/* cfg.c: table-driven flags, environment variables and help. */
#include "common/cfg.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

void kvf_cfg_env_name(const char *flag, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "KVFLEET_");
    for (const char *p = flag; *p && n + 1 < cap; p++)
        buf[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    buf[n < cap ? n : cap - 1] = '\0';
}

kvf_status kvf_cfg_parse_int64(const char *s, int64_t *out)
{
    if (!s || !*s)
        return KVF_ERR_INVALID;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno || *end)
        return KVF_ERR_INVALID;
    *out = v;
    return KVF_OK;
}

kvf_status kvf_cfg_parse_double(const char *s, double *out)
{
    if (!s || !*s)
        return KVF_ERR_INVALID;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v))
        return KVF_ERR_INVALID;
    *out = v;
    return KVF_OK;
}

kvf_status kvf_cfg_parse_bool(const char *s, int *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; s && i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0)
            return *out = 1, KVF_OK;
        if (strcasecmp(s, no[i]) == 0)
            return *out = 0, KVF_OK;
    }
    return KVF_ERR_INVALID;
}

kvf_status kvf_cfg_parse_size(const char *s, int64_t *out)
{
    if (!s || !*s)
        return KVF_ERR_INVALID;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v < 0)
        return KVF_ERR_INVALID;
    double mult = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mult = 1024.0; end++; break;
    case 'M': mult = 1024.0 * 1024; end++; break;
    case 'G': mult = 1024.0 * 1024 * 1024; end++; break;
    case 'T': mult = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (mult > 1 && (*end == 'i' || *end == 'I'))
        end++;
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end || v * mult > 9.2e18)
        return KVF_ERR_INVALID;
    *out = (int64_t)llround(v * mult);
    return KVF_OK;
}

static const char *type_hint(kvf_cfg_type t)
{
    switch (t) {
    case KVF_CFG_RENAMED: return "nothing: it was renamed";
    case KVF_CFG_INT:
    case KVF_CFG_INT64: return "an integer";
    case KVF_CFG_SIZE: return "a size such as 512M or 40G";
    case KVF_CFG_DOUBLE: return "a number";
    case KVF_CFG_STR: return "a string";
    case KVF_CFG_BOOL: return "true or false";
    }
    return "?";
}

/* Walks every flag of a spec: the program's own table, then each of spec->tables. */
typedef struct opt_iter {
    const kvf_cfg_spec *spec;
    int table;            /* -1: the program's own; i >= 0: spec->tables[i]; start at -2 */
    const kvf_cfg_opt *o; /* the current flag */
    size_t base;          /* where its struct sits in the program's cfg */
} opt_iter;

static opt_iter opt_first(const kvf_cfg_spec *spec)
{
    return (opt_iter){.spec = spec, .table = -2};
}

static bool opt_next(opt_iter *it)
{
    if (it->o && it->o[1].name) {
        it->o++;
        return true;
    }
    for (;;) {
        it->table++;
        const kvf_cfg_opt *first;
        if (it->table == -1) {
            first = it->spec->opts;
            it->base = 0;
        } else if (it->spec->tables && it->spec->tables[it->table].opts) {
            first = it->spec->tables[it->table].opts;
            it->base = it->spec->tables[it->table].base;
        } else {
            return false;
        }
        if (first && first->name) {
            it->o = first;
            return true;
        }
    }
}

static kvf_status set_value(const kvf_cfg_spec *spec, const kvf_cfg_opt *o, void *cfg,
                            const char *val, const char *source, kvf_err *err)
{
    if (o->type == KVF_CFG_RENAMED) {
        char env[128];
        kvf_cfg_env_name(o->def, env, sizeof env);
        if (strcmp(source, "flag") == 0)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: --%s was renamed: use --%s", spec->prog,
                               o->name, o->def);
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: %s (--%s) was renamed: use %s (--%s)",
                           spec->prog, source, o->name, env, o->def);
    }
    char *field = (char *)cfg + o->offset;
    kvf_status st = KVF_OK;
    int64_t i64 = 0;
    double d = 0;
    int b = 0;
    switch (o->type) {
    case KVF_CFG_INT:
        st = kvf_cfg_parse_int64(val, &i64);
        if (st == KVF_OK && (i64 < INT32_MIN || i64 > INT32_MAX))
            st = KVF_ERR_INVALID;
        if (st == KVF_OK)
            *(int32_t *)field = (int32_t)i64;
        break;
    case KVF_CFG_INT64:
        st = kvf_cfg_parse_int64(val, &i64);
        if (st == KVF_OK)
            *(int64_t *)field = i64;
        break;
    case KVF_CFG_SIZE:
        st = kvf_cfg_parse_size(val, &i64);
        if (st == KVF_OK)
            *(int64_t *)field = i64;
        break;
    case KVF_CFG_DOUBLE:
        st = kvf_cfg_parse_double(val, &d);
        if (st == KVF_OK)
            *(double *)field = d;
        break;
    case KVF_CFG_STR:
        *(const char **)field = val;
        break;
    case KVF_CFG_BOOL:
        st = kvf_cfg_parse_bool(val, &b);
        if (st == KVF_OK)
            *(bool *)field = b != 0;
        break;
    case KVF_CFG_RENAMED:
        break;
    }
    if (st != KVF_OK)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: %s --%s='%s' is not valid (expected %s)",
                           spec->prog, source, o->name, val ? val : "", type_hint(o->type));
    return KVF_OK;
}

/* The flag called name[0..len) (its iterator: the entry and its struct's base), or false. */
static bool find_opt(const kvf_cfg_spec *spec, const char *name, size_t len, opt_iter *out)
{
    for (opt_iter it = opt_first(spec); opt_next(&it);)
        if (strlen(it.o->name) == len && strncmp(it.o->name, name, len) == 0) {
            *out = it;
            return true;
        }
    return false;
}

kvf_status kvf_cfg_parse(const kvf_cfg_spec *spec, void *cfg, int argc, char **argv,
                         int *n_pos_out, kvf_err *err)
{
    /* 1. defaults, 2. environment */
    for (opt_iter it = opt_first(spec); opt_next(&it);) {
        const kvf_cfg_opt *o = it.o;
        char *base = (char *)cfg + it.base;
        if (o->def && o->type != KVF_CFG_RENAMED) {
            kvf_status st = set_value(spec, o, base, o->def, "default", err);
            if (st != KVF_OK)
                return st;
        }
        char env[128];
        kvf_cfg_env_name(o->name, env, sizeof env);
        const char *v = getenv(env);
        if (v) {
            kvf_status st = set_value(spec, o, base, v, env, err);
            if (st != KVF_OK)
                return st;
        }
    }
    /* 3. the command line */
    int n_pos = 0;
    bool flags_done = false;
    for (int i = 1; i < argc; i++) {
        char *a = argv[i];
        if (flags_done || a[0] != '-' || a[1] == '\0') {
            argv[1 + n_pos++] = a;
            continue;
        }
        if (strcmp(a, "--") == 0) {
            flags_done = true;
            continue;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            kvf_cfg_help(spec, stdout);
            return KVF_HELP;
        }
        const char *name = a + (a[1] == '-' ? 2 : 1);
        const char *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        opt_iter it;
        const kvf_cfg_opt *o = find_opt(spec, name, len, &it) ? it.o : NULL;
        const char *val = eq ? eq + 1 : NULL;
        if (!o && !eq && strncmp(name, "no-", 3) == 0) {
            o = find_opt(spec, name + 3, len - 3, &it) ? it.o : NULL;
            if (o && o->type == KVF_CFG_BOOL)
                val = "false";
            else
                o = NULL;
        }
        if (!o)
            return kvf_err_set(err, KVF_ERR_INVALID, "%s: unknown flag '%s' (see %s --help)",
                               spec->prog, a, spec->prog);
        if (!val && o->type == KVF_CFG_RENAMED)
            val = "";
        if (!val) {
            if (o->type == KVF_CFG_BOOL)
                val = "true";
            else if (i + 1 < argc)
                val = argv[++i];
            else
                return kvf_err_set(err, KVF_ERR_INVALID, "%s: flag --%s needs a value (%s)",
                                   spec->prog, o->name, type_hint(o->type));
        }
        kvf_status st = set_value(spec, o, (char *)cfg + it.base, val, "flag", err);
        if (st != KVF_OK)
            return st;
    }
    if (n_pos_out)
        *n_pos_out = n_pos;
    else if (n_pos > 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "%s: unexpected argument '%s'", spec->prog,
                           argv[1]);
    return KVF_OK;
}

void kvf_cfg_help(const kvf_cfg_spec *spec, FILE *out)
{
    fprintf(out, "usage: %s [flags]%s%s\n\n", spec->prog, spec->args ? " " : "",
            spec->args ? spec->args : "");
    if (spec->summary)
        fprintf(out, "%s\n\n", spec->summary);
    fprintf(out, "flags (each also read from KVFLEET_<FLAG>, e.g. --block-size as "
                 "KVFLEET_BLOCK_SIZE):\n");
    for (opt_iter it = opt_first(spec); opt_next(&it);) {
        const kvf_cfg_opt *o = it.o;
        if (o->type == KVF_CFG_RENAMED)
            continue;
        char left[64];
        snprintf(left, sizeof left, "--%s%s", o->name,
                 o->type == KVF_CFG_BOOL ? "" : "=VALUE");
        fprintf(out, "  %-28s %s", left, o->help ? o->help : "");
        if (o->def && *o->def)
            fprintf(out, " (default %s)", o->def);
        fputc('\n', out);
    }
    fprintf(out, "  %-28s %s\n", "--help", "show this help");
}
