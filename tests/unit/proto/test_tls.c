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
static char client_pem[300], client_key[300], rogue_pem[300], rogue_key[300];
static char new_pem[300], new_key[300], live_pem[300], live_key[300];

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
        /* a fleet member's client certificate, one from another CA, and a second server
         * certificate from ca2 for the reload case */
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr "
        "-subj /CN=member",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 2",
        "openssl req -newkey rsa:2048 -nodes -keyout rogue.key -out rogue.csr -subj /CN=rogue",
        "openssl x509 -req -in rogue.csr -CA ca2.pem -CAkey ca2.key -CAcreateserial "
        "-out rogue.pem -days 2",
        "openssl req -newkey rsa:2048 -nodes -keyout new.key -out new.csr -subj /CN=localhost",
        "openssl x509 -req -in new.csr -CA ca2.pem -CAkey ca2.key -CAcreateserial "
        "-out new.pem -days 2 -extfile ext.cnf",
        "cp server.pem live.pem && cp server.key live.key",
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
    snprintf(client_pem, sizeof client_pem, "%s/client.pem", dir);
    snprintf(client_key, sizeof client_key, "%s/client.key", dir);
    snprintf(rogue_pem, sizeof rogue_pem, "%s/rogue.pem", dir);
    snprintf(rogue_key, sizeof rogue_key, "%s/rogue.key", dir);
    snprintf(new_pem, sizeof new_pem, "%s/new.pem", dir);
    snprintf(new_key, sizeof new_key, "%s/new.key", dir);
    snprintf(live_pem, sizeof live_pem, "%s/live.pem", dir);
    snprintf(live_key, sizeof live_key, "%s/live.key", dir);
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

/* A started TLS server with the echo method on an ephemeral port; its address in target. */
static kvf_rpc_server *echo_server(const kvf_rpc_tls *stls, char *target, size_t cap)
{
    kvf_err e;
    kvf_rpc_server_opts o = {.address = "127.0.0.1:0", .n_threads = 1, .tls = stls};
    kvf_rpc_server *srv;
    if (kvf_rpc_server_create(&o, &srv, &e) != KVF_OK)
        fail_msg("TLS server: %s", e.msg);
    assert_int_equal(kvf_rpc_server_add_unary(srv, "/t.T/Echo", h_echo, NULL, &e), KVF_OK);
    assert_int_equal(kvf_rpc_server_start(srv, &e), KVF_OK);
    snprintf(target, cap, "127.0.0.1:%d", kvf_rpc_server_port(srv));
    return srv;
}

/* One call on a fresh channel to target with tls (NULL: plaintext); its status. */
static kvf_status call_once(const char *target, const kvf_rpc_tls *tls, kvf_err *e)
{
    kvf_rpc_channel_opts co = {.tls = tls};
    kvf_rpc_channel *ch;
    kvf_rpc_buf r = {0};
    kvf_status st = kvf_rpc_channel_create(target, tls ? &co : NULL, &ch, e);
    if (st != KVF_OK)
        return st;
    st = kvf_rpc_unary(ch, "/t.T/Echo", "member", 6, 5000, &r, e);
    if (st == KVF_OK && (r.len != 6 || memcmp(r.data, "member", 6) != 0))
        st = KVF_ERR_INTERNAL;
    kvf_rpc_buf_free(&r);
    kvf_rpc_channel_destroy(ch);
    return st;
}

/* The worker plane: a server with a CA admits only clients presenting a certificate that CA
 * signed. The attacks: a plaintext client, a TLS client without a certificate, a client with a
 * certificate from another CA. */
static void test_mtls(void **state)
{
    if (!ca_pem[0])
        skip();
    kvf_err e;
    kvf_rpc_tls stls = {.cert_file = cert_pem, .key_file = key_pem, .ca_file = ca_pem};
    char target[64];
    kvf_rpc_server *srv = echo_server(&stls, target, sizeof target);

    kvf_rpc_tls member = {.cert_file = client_pem, .key_file = client_key, .ca_file = ca_pem,
                          .server_name = "localhost"};
    kvf_status st = call_once(target, &member, &e);
    if (st != KVF_OK)
        fail_msg("a fleet member: %s", e.msg);

    assert_int_not_equal(call_once(target, NULL, &e), KVF_OK);
    kvf_rpc_tls anonymous = {.ca_file = ca_pem, .server_name = "localhost"};
    assert_int_not_equal(call_once(target, &anonymous, &e), KVF_OK);
    kvf_rpc_tls rogue = {.cert_file = rogue_pem, .key_file = rogue_key, .ca_file = ca_pem,
                         .server_name = "localhost"};
    assert_int_not_equal(call_once(target, &rogue, &e), KVF_OK);

    /* the member still gets in after the refusals */
    assert_int_equal(call_once(target, &member, &e), KVF_OK);
    kvf_rpc_server_destroy(srv);
}

/* SIGHUP's path: the files under the same names change, kvf_rpc_tls_reload, and later
 * handshakes use the new certificate (signed by ca2 here, so a client trusting only ca2 gets
 * through after, not before). A reload whose files do not parse keeps the old ones. */
static void test_mtls_reload(void **state)
{
    if (!ca_pem[0])
        skip();
    kvf_err e;
    kvf_rpc_tls stls = {.cert_file = live_pem, .key_file = live_key, .ca_file = ca_pem};
    char target[64];
    kvf_rpc_server *srv = echo_server(&stls, target, sizeof target);
    kvf_rpc_tls old_ca = {.cert_file = client_pem, .key_file = client_key, .ca_file = ca_pem,
                          .server_name = "localhost"};
    kvf_rpc_tls new_ca = old_ca;
    new_ca.ca_file = ca2_pem;
    assert_int_equal(call_once(target, &old_ca, &e), KVF_OK);
    assert_int_not_equal(call_once(target, &new_ca, &e), KVF_OK);

    /* a broken file: the reload fails, the old certificate stays */
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", not_pem, live_pem);
    assert_int_equal(system(cmd), 0);
    kvf_rpc_tls_reload();
    assert_int_equal(call_once(target, &old_ca, &e), KVF_OK);

    snprintf(cmd, sizeof cmd, "cp '%s' '%s' && cp '%s' '%s'", new_pem, live_pem, new_key,
             live_key);
    assert_int_equal(system(cmd), 0);
    kvf_rpc_tls_reload();
    kvf_status st = call_once(target, &new_ca, &e);
    if (st != KVF_OK)
        fail_msg("after the reload: %s", e.msg);
    assert_int_not_equal(call_once(target, &old_ca, &e), KVF_OK);
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
        cmocka_unit_test(test_mtls),
        cmocka_unit_test(test_mtls_reload),
        cmocka_unit_test(test_tls_bad_files),
    };
    return cmocka_run_group_tests(tests, make_certs, remove_certs);
}
