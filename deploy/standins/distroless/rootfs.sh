#!/bin/sh
# Runs inside the debian:bookworm image (deploy/standins/build.sh pipes it
# in) and writes to stdout a tar of the files gcr.io/distroless/static-debian12
# holds: CA certificates, time zones, os-release, and the users root, nobody
# and nonroot (65532) with their directories. No shell and no package
# manager, as in the real image.
set -eu
out=$(mktemp -d)
cd "$out"
mkdir -p etc/ssl/certs usr/share usr/lib tmp root home/nonroot var/lib
cp /etc/ssl/certs/ca-certificates.crt etc/ssl/certs/
cp -a /usr/share/zoneinfo usr/share/
cp -L /etc/os-release usr/lib/os-release
ln -s ../usr/lib/os-release etc/os-release
cat >etc/passwd <<'EOT'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
EOT
cat >etc/group <<'EOT'
root:x:0:
nobody:x:65534:
tty:x:5:
staff:x:50:
nonroot:x:65532:
EOT
echo 'hosts: files dns' >etc/nsswitch.conf
chmod 1777 tmp
chmod 700 root home/nonroot
chown 65532:65532 home/nonroot
tar --numeric-owner -C "$out" -c .
