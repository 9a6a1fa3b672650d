/* test_tls.c: the RPC layer over TLS with a certificate this test makes with openssl in a temp
 * folder: a client with the CA gets through; a plaintext client, a client trusting another CA,
 * a client expecting another name, and a server given bad files are refused with messages that
 * say so. Skips without openssl. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "common/log.h"
#include "proto/rpc.h"

static char dir[256];
static char ca_pem[300], ca2_pem[300], cert_pem[300], key_pem[300], not_pem[300];

static int run(const char *cmd)
{
    char full[2048];
    snprintf(full, sizeof full, "cd '%s' && %s >/dev/null 2>&1", dir, cmd);
    return system(full);
}

/* A CA, a server certificate for localhost/127.0.0.1 signed by it, and a second unrelated CA. */
static int make_certs(void **state)
{
    kvf_log_set_level(KVF_LOG_ERROR);
    snprintf(dir, sizeof dir, "/tmp/kvf_tls_XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    if (system("command -v openssl >/dev/null 2>&1") != 0)
        return 0; /* the cases skip */
    const char *cmds[] = {
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
        "-subj /CN=kvfleet-test-ca",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca2.key -out ca2.pem -days 2 "
        "-subj /CN=other-ca",
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr "
        "-subj /CN=localhost",
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > ext.cnf",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile ext.cnf",
        "echo 'hello' > not.pem",
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (run(cmds[i]) != 0) {
            fprintf(stderr, "tls test: failed: %s\n", cmds[i]);
            return -1;
        }
    snprintf(ca_pem, sizeof ca_pem, "%s/ca.pem", dir);
    snprintf(ca2_pem, sizeof ca2_pem, "%s/ca2.pem", dir);
    snprintf(cert_pem, sizeof cert_pem, "%s/server.pem", dir);
    snprintf(key_pem, sizeof key_pem, "%s/server.key", dir);
    snprintf(not_pem, sizeof not_pem, "%s/not.pem", dir);
    return 0;
}

static int remove_certs(void **state)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

static kvf_status h_echo(void *ctx, kvf_rpc_call *call, const uint8_t *req, size_t len,
                         kvf_rpc_buf *resp_out, kvf_err *err)
{
    resp_out->data = malloc(len + 1);
    memcpy(resp_out->data, req, len);
    resp_out->len = len;
    return KVF_OK;
}

static void test_tls_calls(void **state)
{
    if (!ca_pem[0])
        skip();
    kvf_err e;
    kvf_rpc_tls stls = {.cert_file = cert_pem, .key_file = key_pem};
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 1, .tls = &stls};
    kvf_rpc_server *srv;
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_add_unary(srv, "/t.T/Echo", h_echo, NULL, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_start(srv, &e), KVF_OK);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", kvf_rpc_server_port(srv));

    /* The right CA, and the name the certificate carries (gRPC 1.51 does not match the IP
     * address entry, so a client dialling an address names the host with server_name). */
    kvf_rpc_tls ctls = {.ca_file = ca_pem, .server_name = "localhost"};
    kvf_rpc_channel_opts co = {.tls = &ctls};
    kvf_rpc_channel *ch;
    kvf_rpc_buf r = {0};
    assert_int_equal(kvf_rpc_channel_create(target, &co, &ch, &e), KVF_OK);
    kvf_status st0 = kvf_rpc_unary(ch, "/t.T/Echo", "secret", 6, 10000, &r, &e);
    if (st0 != KVF_OK)
        fail_msg("with the CA: %s", e.msg);
    assert_int_equal(r.len, 6);
    assert_memory_equal(r.data, "secret", 6);
    kvf_rpc_buf_free(&r);
    kvf_rpc_channel_destroy(ch);

    /* Dialling by the certificate's host name needs no override. */
    char by_name[64];
    snprintf(by_name, sizeof by_name, "localhost:%d", kvf_rpc_server_port(srv));
    ctls.server_name = NULL;
    assert_int_equal(kvf_rpc_channel_create(by_name, &co, &ch, &e), KVF_OK);
    kvf_status st = kvf_rpc_unary(ch, "/t.T/Echo", "x", 1, 10000, &r, &e);
    if (st != KVF_OK)
        fail_msg("by name: %s", e.msg);
    kvf_rpc_buf_free(&r);
    kvf_rpc_channel_destroy(ch);

    /* A name the certificate does not carry: refused. */
    ctls.server_name = "other.example";
    assert_int_equal(kvf_rpc_channel_create(target, &co, &ch, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, "/t.T/Echo", "x", 1, 3000, &r, &e), KVF_ERR_PEER_LOST);
    kvf_rpc_channel_destroy(ch);
    ctls.server_name = "localhost";

    /* Plaintext to a TLS server: refused. */
    assert_int_equal(kvf_rpc_channel_create(target, NULL, &ch, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, "/t.T/Echo", "x", 1, 3000, &r, &e), KVF_ERR_PEER_LOST);
    assert_null(r.data);
    kvf_rpc_channel_destroy(ch);

    /* A CA that did not sign the server's certificate: refused. */
    ctls.ca_file = ca2_pem;
    assert_int_equal(kvf_rpc_channel_create(target, &co, &ch, &e), KVF_OK);
    assert_int_equal(kvf_rpc_unary(ch, "/t.T/Echo", "x", 1, 3000, &r, &e), KVF_ERR_PEER_LOST);
    kvf_rpc_channel_destroy(ch);

    kvf_rpc_server_destroy(srv);
}

static void test_tls_bad_files(void **state)
{
    if (!ca_pem[0])
        skip();
    kvf_err e;
    kvf_rpc_server *srv;
    kvf_rpc_tls stls = {.cert_file = cert_pem};
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .tls = &stls};
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_ERR_INVALID);
    assert_non_null(strstr(e.msg, "--tls-cert given without --tls-key"));

    stls.key_file = "/nonexistent/server.key";
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_ERR_IO);
    assert_non_null(strstr(e.msg, "--tls-key /nonexistent/server.key: cannot open"));

    stls.key_file = not_pem;
    assert_int_equal(kvf_rpc_server_create(&o, &srv, &e), KVF_ERR_PARSE);
    assert_non_null(strstr(e.msg, "not a PEM file"));

    kvf_rpc_tls ctls = {.ca_file = "/nonexistent/ca.pem"};
    kvf_rpc_channel_opts co = {.tls = &ctls};
    kvf_rpc_channel *ch;
    assert_int_equal(kvf_rpc_channel_create("127.0.0.1:1", &co, &ch, &e), KVF_ERR_IO);
    assert_non_null(strstr(e.msg, "--tls-ca /nonexistent/ca.pem"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tls_calls),
        cmocka_unit_test(test_tls_bad_files),
    };
    return cmocka_run_group_tests(tests, make_certs, remove_certs);
}
