#!/usr/bin/env bash
# gen_certs.sh: `kvfleet gen-certs` makes a CA and member certificates that OpenSSL verifies,
# good for both ends of mutual TLS and carrying the fleet's name; a second run reuses the CA;
# keys are private; bad input is refused with a message naming it.
. "$(dirname "$0")/lib.sh"
command -v openssl >/dev/null || { echo "SKIP: no openssl"; exit 0; }
d=$(mktemp -d /tmp/kvf_certs_XXXXXX)
trap 'rm -rf "$d"' EXIT

out=$("$KVF_BIN" gen-certs --out "$d/c" --members router,prefill,decode --san DNS:decode.kv.svc,IP:10.0.0.3)
expect_contains "summary" "$out" "3 member certificates"
for m in router prefill decode; do
  v=$(openssl verify -CAfile "$d/c/ca.pem" -purpose sslserver "$d/c/$m.pem" 2>&1)
  expect_contains "$m verifies as a server" "$v" "OK"
  v=$(openssl verify -CAfile "$d/c/ca.pem" -purpose sslclient "$d/c/$m.pem" 2>&1)
  expect_contains "$m verifies as a client" "$v" "OK"
  expect_eq "$m key mode" "$(stat -c %a "$d/c/$m.key")" 600
  # the key belongs to the certificate
  expect_eq "$m key matches" "$(openssl pkey -in "$d/c/$m.key" -pubout)" "$(openssl x509 -in "$d/c/$m.pem" -pubkey -noout)"
done
txt=$(openssl x509 -in "$d/c/decode.pem" -noout -text)
expect_contains "fleet name SAN" "$txt" "DNS:kvfleet"
expect_contains "extra SAN" "$txt" "DNS:decode.kv.svc"
expect_contains "extra IP SAN" "$txt" "IP Address:10.0.0.3"
expect_eq "ca key mode" "$(stat -c %a "$d/c/ca.key")" 600
expect_eq "dir mode" "$(stat -c %a "$d/c")" 700

# a second run signs new members with the same CA
ca_before=$(sha256sum < "$d/c/ca.pem")
"$KVF_BIN" gen-certs --out "$d/c" --members extra --tls-name myfleet >/dev/null
expect_eq "CA reused" "$(sha256sum < "$d/c/ca.pem")" "$ca_before"
v=$(openssl verify -CAfile "$d/c/ca.pem" "$d/c/extra.pem" 2>&1)
expect_contains "new member verifies" "$v" "OK"
expect_contains "new fleet name" "$(openssl x509 -in "$d/c/extra.pem" -noout -text)" "DNS:myfleet"

# bad input
set +e
err=$("$KVF_BIN" gen-certs 2>&1 >/dev/null); rc=$?
expect_eq "no --out exit code" "$rc" 2
expect_contains "no --out message" "$err" "--out DIR is required"
err=$("$KVF_BIN" gen-certs --out "$d/c" --members ../evil 2>&1 >/dev/null); rc=$?
expect_eq "bad member exit code" "$rc" 2
expect_contains "bad member message" "$err" "must not contain '/'"
rm -f "$d/c/ca.key"
err=$("$KVF_BIN" gen-certs --out "$d/c" --members x 2>&1 >/dev/null); rc=$?
expect_eq "half a CA exit code" "$rc" 2
expect_contains "half a CA message" "$err" "ca.key"
set -e
finish
