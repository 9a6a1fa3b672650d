/* certs.c: a fleet's certificates with OpenSSL's library (no shell-out): a CA, and certificates
 * it signs for fleet members, each good for both serving and calling (mTLS) and carrying the
 * fleet's name as a subjectAltName, which every member checks instead of a host name (DESIGN.md
 * 9a). For `kvfleet gen-certs` (operators: Kubernetes Secrets) and `kvfleet up --tls`. */
#include "cli/certs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

/* OpenSSL's first queued error as text (or what failed when it queued none). */
static kvf_status ssl_fail(kvf_err *err, const char *what)
{
    unsigned long e = ERR_get_error();
    char buf[256] = "";
    if (e)
        ERR_error_string_n(e, buf, sizeof buf);
    ERR_clear_error();
    return kvf_err_set(err, KVF_ERR_INTERNAL, "certs: %s failed%s%s", what, buf[0] ? ": " : "",
                       buf);
}

static EVP_PKEY *new_key(void)
{
    return EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
}

static bool add_ext(X509 *cert, X509 *issuer, int nid, const char *value)
{
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, cert, NULL, NULL, 0);
    X509_EXTENSION *ext = X509V3_EXT_conf_nid(NULL, &ctx, nid, value);
    if (!ext)
        return false;
    bool ok = X509_add_ext(cert, ext, -1) == 1;
    X509_EXTENSION_free(ext);
    return ok;
}

/* A certificate for key, named cn, valid `days` from an hour ago, signed by (issuer,
 * issuer_key) or by itself when issuer is NULL. */
static X509 *make_cert(EVP_PKEY *key, const char *cn, int days, X509 *issuer, EVP_PKEY *issuer_key,
                       bool ca, const char *san)
{
    X509 *c = X509_new();
    BIGNUM *serial = BN_new();
    bool ok = c && serial && X509_set_version(c, 2) == 1 && BN_rand(serial, 120, 0, 0) == 1 &&
              BN_to_ASN1_INTEGER(serial, X509_get_serialNumber(c)) &&
              X509_gmtime_adj(X509_getm_notBefore(c), -3600) &&
              X509_gmtime_adj(X509_getm_notAfter(c), (long)days * 86400) &&
              X509_set_pubkey(c, key) == 1;
    X509_NAME *name = ok ? X509_get_subject_name(c) : NULL;
    ok = ok && X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, (const unsigned char *)"kvfleet",
                                          -1, -1, 0) == 1 &&
         X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1,
                                    0) == 1 &&
         X509_set_issuer_name(c, issuer ? X509_get_subject_name(issuer) : name) == 1;
    X509 *iss = issuer ? issuer : c;
    if (ca)
        ok = ok && add_ext(c, iss, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") &&
             add_ext(c, iss, NID_key_usage, "critical,keyCertSign,cRLSign") &&
             add_ext(c, iss, NID_subject_key_identifier, "hash");
    else
        ok = ok && add_ext(c, iss, NID_basic_constraints, "critical,CA:FALSE") &&
             add_ext(c, iss, NID_key_usage, "critical,digitalSignature,keyEncipherment") &&
             add_ext(c, iss, NID_ext_key_usage, "serverAuth,clientAuth") &&
             add_ext(c, iss, NID_subject_alt_name, san) &&
             add_ext(c, iss, NID_authority_key_identifier, "keyid:always");
    ok = ok && X509_sign(c, issuer_key ? issuer_key : key, EVP_sha256()) > 0;
    BN_free(serial);
    if (!ok) {
        X509_free(c);
        return NULL;
    }
    return c;
}

/* Writes PEM through fn to path (created with mode; replaced whole). */
static kvf_status write_pem(const char *path, int mode, X509 *cert, EVP_PKEY *key, kvf_err *err)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, mode);
    if (fd < 0)
        return kvf_err_set(err, KVF_ERR_IO, "certs: cannot create %s: %s", tmp, strerror(errno));
    FILE *f = fdopen(fd, "w");
    if (!f) {
        close(fd);
        return kvf_err_set(err, KVF_ERR_IO, "certs: %s: %s", tmp, strerror(errno));
    }
    int ok = cert ? PEM_write_X509(f, cert) : PEM_write_PrivateKey(f, key, NULL, NULL, 0, NULL, NULL);
    if (fclose(f) != 0 || !ok) {
        unlink(tmp);
        return ok ? kvf_err_set(err, KVF_ERR_IO, "certs: writing %s: %s", tmp, strerror(errno))
                  : ssl_fail(err, "writing a PEM file");
    }
    if (rename(tmp, path) != 0) {
        unlink(tmp);
        return kvf_err_set(err, KVF_ERR_IO, "certs: cannot rename %s to %s: %s", tmp, path,
                           strerror(errno));
    }
    return KVF_OK;
}

static X509 *read_cert(const char *path)
{
    FILE *f = fopen(path, "r");
    X509 *c = f ? PEM_read_X509(f, NULL, NULL, NULL) : NULL;
    if (f)
        fclose(f);
    return c;
}

static EVP_PKEY *read_key(const char *path)
{
    FILE *f = fopen(path, "r");
    EVP_PKEY *k = f ? PEM_read_PrivateKey(f, NULL, NULL, NULL) : NULL;
    if (f)
        fclose(f);
    return k;
}

kvf_status kvf_cli_certs_make(const char *dir, const char *fleet_name, const char *const *members,
                              size_t n_members, const char *extra_san, int days, kvf_err *err)
{
    if (!fleet_name || !*fleet_name || strchr(fleet_name, ',') || days < 1)
        return kvf_err_set(err, KVF_ERR_INVALID, "certs: the fleet name \"%s\" must be non-empty "
                           "without commas, and days (%d) at least 1", fleet_name ? fleet_name : "",
                           days);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return kvf_err_set(err, KVF_ERR_IO, "certs: cannot create %s: %s", dir, strerror(errno));
    char ca_pem[4096], ca_key[4096];
    snprintf(ca_pem, sizeof ca_pem, "%s/ca.pem", dir);
    snprintf(ca_key, sizeof ca_key, "%s/ca.key", dir);
    kvf_status st = KVF_OK;
    /* the CA: kept when both files are there (more members for the same fleet), made otherwise */
    X509 *ca = NULL;
    EVP_PKEY *cak = NULL;
    if (access(ca_pem, F_OK) == 0 || access(ca_key, F_OK) == 0) {
        ca = read_cert(ca_pem);
        cak = read_key(ca_key);
        if (!ca || !cak) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "certs: %s and %s must both be a PEM CA "
                             "certificate and its key (or both absent, to make a new CA)", ca_pem,
                             ca_key);
            goto out;
        }
    } else {
        char cn[300];
        snprintf(cn, sizeof cn, "%s fleet CA", fleet_name);
        if (!(cak = new_key()) || !(ca = make_cert(cak, cn, days, NULL, NULL, true, NULL))) {
            st = ssl_fail(err, "making the CA");
            goto out;
        }
        if ((st = write_pem(ca_key, 0600, NULL, cak, err)) != KVF_OK ||
            (st = write_pem(ca_pem, 0644, ca, NULL, err)) != KVF_OK)
            goto out;
    }
    /* one certificate per member, each carrying the fleet's name (what peers check) */
    char san[2048];
    snprintf(san, sizeof san, "DNS:%s,DNS:localhost,IP:127.0.0.1%s%s", fleet_name,
             extra_san && *extra_san ? "," : "", extra_san ? extra_san : "");
    for (size_t i = 0; i < n_members && st == KVF_OK; i++) {
        char pem[4096], key[4096];
        snprintf(pem, sizeof pem, "%s/%s.pem", dir, members[i]);
        snprintf(key, sizeof key, "%s/%s.key", dir, members[i]);
        EVP_PKEY *k = new_key();
        X509 *c = k ? make_cert(k, members[i], days, ca, cak, false, san) : NULL;
        if (!c)
            st = ssl_fail(err, "making a member certificate");
        else if ((st = write_pem(key, 0600, NULL, k, err)) == KVF_OK)
            st = write_pem(pem, 0644, c, NULL, err);
        X509_free(c);
        EVP_PKEY_free(k);
    }
out:
    X509_free(ca);
    EVP_PKEY_free(cak);
    return st;
}
