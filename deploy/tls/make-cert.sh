#!/bin/sh
# Make a local CA and a server certificate signed by it, unless $CERT_DIR already holds one.
#
#   CERT_DIR   where to write ca.crt, ca.key, server.crt, server.key (default ./certs)
#   CERT_HOSTS comma-separated DNS names and IP addresses for subjectAltName
#              (default localhost,127.0.0.1,::1)
#   CERT_DAYS  validity in days (default 825)
#
# Clients trust ca.crt (curl --cacert, SSL_CERT_FILE, httpx verify=...). Used by the compose `certs`
# step and by `make run-https`; a mounted certificate (server.crt + server.key) is left as it is.
set -eu

CERT_DIR=${CERT_DIR:-./certs}
CERT_HOSTS=${CERT_HOSTS:-localhost,127.0.0.1,::1}
CERT_DAYS=${CERT_DAYS:-825}

if [ -s "$CERT_DIR/server.crt" ] && [ -s "$CERT_DIR/server.key" ]; then
    echo "make-cert: $CERT_DIR/server.crt exists; keeping it"
    exit 0
fi
mkdir -p "$CERT_DIR"
umask 077

san=""
old_ifs=$IFS
IFS=,
for host in $CERT_HOSTS; do
    case "$host" in
        *:*) kind=IP ;;            # IPv6
        "" | *[!0-9.]*) kind=DNS ;;
        *) kind=IP ;;              # IPv4
    esac
    san="${san:+$san,}$kind:$host"
done
IFS=$old_ifs

openssl req -x509 -new -newkey rsa:2048 -nodes -sha256 -days "$CERT_DAYS" \
    -keyout "$CERT_DIR/ca.key" -out "$CERT_DIR/ca.crt" -subj "/CN=tokenline local CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

openssl req -new -newkey rsa:2048 -nodes -sha256 \
    -keyout "$CERT_DIR/server.key" -out "$CERT_DIR/server.csr" -subj "/CN=${CERT_HOSTS%%,*}" 2>/dev/null

cat > "$CERT_DIR/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EXT
openssl x509 -req -sha256 -days "$CERT_DAYS" -in "$CERT_DIR/server.csr" -CA "$CERT_DIR/ca.crt" \
    -CAkey "$CERT_DIR/ca.key" -CAcreateserial -out "$CERT_DIR/server.crt" -extfile "$CERT_DIR/server.ext" 2>/dev/null
rm -f "$CERT_DIR/server.csr" "$CERT_DIR/server.ext" "$CERT_DIR/ca.srl"
chmod 644 "$CERT_DIR/ca.crt" "$CERT_DIR/server.crt"
echo "make-cert: wrote $CERT_DIR/server.crt for $san; clients trust $CERT_DIR/ca.crt"
