#!/usr/bin/env bash
# Builds, without an image registry, local stand-ins for the upstream images
# that the Dockerfile and docker-compose.yml name, under exactly those names,
# so that the same two files work unchanged with `docker-compose up --build`
# on an engine that cannot pull (`make deploy-test` runs this first):
#
#   debian:bookworm                            debootstrap (minbase, plus ca-certificates and tzdata), docker import
#   gcr.io/distroless/static-debian12[:latest] its files taken from that Debian, docker import
#   gcr.io/distroless/static-debian12:nonroot  the same, USER 65532
#   golang:1.26-bookworm                       Debian + this machine's Go 1.26 toolchain + a module proxy on disk, docker import
#   gcr.io/etcd-development/etcd:<version>     etcd, etcdctl, etcdutl built from the Go modules (deploy/etcd)
#   postgres:15-bookworm                       Debian's postgresql-15 and the official image's entrypoint contract
#
# An image of one of these names that is not a stand-in (pulled from a
# registry) is left alone and used as it is. A stand-in is rebuilt only when
# the hash of its inputs (its recipe, its base's inputs, the Go toolchain,
# the module lists) differs from the one in its label, so a second run costs
# seconds. A replaced stand-in is removed, so no untagged image is left.
#
# Needs root for debootstrap (uses sudo otherwise), and network access to
# the Debian mirror (DEBIAN_MIRROR, default http://deb.debian.org/debian) and
# to the Go module proxy, from this machine and, for apt, from containers.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The engine's own (legacy) builder: this machine's docker CLI has no buildx.
export DOCKER_BUILDKIT=0

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
RECIPES=deploy/standins
LABEL=org.shardrun.standin
DEBIAN=debian:$SUITE
DISTROLESS=gcr.io/distroless/static-debian12

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

log() { echo "standins: $*" >&2; }
die() {
	log "$*"
	exit 1
}

# hash prints a short digest of its arguments: strings, and for arguments
# naming files, their names and contents.
hash() {
	local a
	for a in "$@"; do
		if [ -f "$a" ]; then
			printf 'file %s %s\n' "$a" "$(sha256sum <"$a" | cut -c1-64)"
		else
			printf 'str %s\n' "$a"
		fi
	done | sha256sum | cut -c1-24
}

label() { docker image inspect -f "{{index .Config.Labels \"$2\"}}" "$1" 2>/dev/null || true; }
image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null || true; }

# need NAME HASH: whether NAME must be (re)built. An existing image that is
# not a stand-in is kept.
need() {
	local name=$1 want=$2
	if [ -z "$(image_id "$name")" ]; then
		return 0
	fi
	if [ "$(label "$name" "$LABEL")" != "$name" ]; then
		log "$name: exists and is not a stand-in (pulled from a registry?); using it"
		return 1
	fi
	if [ "$(label "$name" "$LABEL.inputs")" = "$want" ]; then
		log "$name: up to date"
		return 1
	fi
	return 0
}

# retire OLD_ID NAME: removes the image NAME pointed to before it was
# rebuilt, unless something still uses it.
retire() {
	local old=$1 name=$2
	if [ -n "$old" ] && [ "$old" != "$(image_id "$name")" ]; then
		# A build stage of the shardrun image (shardrun:build-cache) may
		# still use it: the deploy test removes both when it replaces that.
		docker rmi "$old" >/dev/null 2>&1 || log "$name: the previous image ${old:7:12} is still in use; left"
	fi
}

# quiet runs a command (a build), showing its output only when it fails.
quiet() {
	local out
	out=$(mktemp "$work/quiet-XXXXXX")
	"$@" >"$out" 2>&1 || die "$* failed: $(tail -n 40 "$out")"
}

# timed NAME FUNCTION: runs a recipe, replaces the previous image, and says
# how long it took.
timed() {
	local name=$1 fn=$2 old start
	old=$(image_id "$name")
	start=$SECONDS
	"$fn"
	retire "$old" "$name"
	log "$name: built in $((SECONDS - start))s"
}

# --- the recipes ---------------------------------------------------------------

build_debian() {
	local root=$work/rootfs
	log "$DEBIAN: debootstrap $SUITE from $MIRROR"
	$SUDO debootstrap --variant=minbase --include=ca-certificates,tzdata "$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 ||
		die "debootstrap failed: $(tail -n 20 "$work/debootstrap.log")"
	# As in the official image: package lists and caches emptied, the suite
	# with its updates and security archives in deb822 form.
	$SUDO rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root/etc/apt/sources.list"
	$SUDO tee "$root/etc/apt/sources.list.d/debian.sources" >/dev/null <<-EOF
		Types: deb
		URIs: ${MIRROR}
		Suites: ${SUITE} ${SUITE}-updates
		Components: main
		Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

		Types: deb
		URIs: ${MIRROR%/debian}/debian-security
		Suites: ${SUITE}-security
		Components: main
		Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
	EOF
	$SUDO tar --numeric-owner -C "$root" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . |
		docker import \
			--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
			--change 'CMD ["bash"]' \
			--change "LABEL $LABEL=$DEBIAN $LABEL.inputs=$h_debian" \
			- "$DEBIAN" >/dev/null
	$SUDO rm -rf "$root"
}

# The distroless files come out of the Debian stand-in through a container
# without network; no build stage, so no intermediate image is left.
build_distroless() {
	docker run --rm -i --network none "$DEBIAN" sh -s <$RECIPES/distroless/rootfs.sh |
		docker import \
			--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
			--change "LABEL $LABEL=$DISTROLESS:latest $LABEL.inputs=$h_distroless" \
			- "$DISTROLESS:latest" >/dev/null
}

build_nonroot() {
	printf 'FROM %s:latest\nUSER 65532:65532\nWORKDIR /home/nonroot\n' "$DISTROLESS" |
		quiet docker build --label "$LABEL=$DISTROLESS:nonroot" --label "$LABEL.inputs=$h_nonroot" -t "$DISTROLESS:nonroot" -
}

# The Debian stand-in's files, the Go toolchain that runs this script (a
# release of the version the tag names) in /usr/local/go, and in
# /usr/local/share/goproxy a module proxy on disk holding what `go mod
# download` fetches for the product, filled from this machine's module
# cache (or the network proxy for what it lacks): containers here cannot
# reach proxy.golang.org (HTTPS leaves this machine through a proxy whose
# certificate authority only the machine trusts), so the image points
# GOPROXY there, and the Dockerfile that uses it stays the standard one.
# One docker import of the whole tree: it writes the layer straight into
# the storage driver, where a Dockerfile's COPY goes through the build
# container's fuse-overlayfs mount and took six times as long (62s).
build_golang() {
	local cache=$work/modcache root=$work/golang host_cache proxy c goroot base
	host_cache=$(go env GOMODCACHE)
	proxy=$(go env GOPROXY)
	log "$GOLANG: collecting the product's modules"
	GOFLAGS="$(go env GOFLAGS) -modcacherw" GOMODCACHE="$cache" GOPROXY="file://$host_cache/cache/download,$proxy" \
		go mod download
	mkdir -p "$root"
	c=$(docker create "$DEBIAN")
	docker export "$c" | $SUDO tar -x --numeric-owner -C "$root"
	docker rm "$c" >/dev/null
	$SUDO cp -r "$cache/cache/download" "$root/usr/local/share/goproxy"
	$SUDO rm -rf "$root/usr/local/share/goproxy/sumdb" "$cache"
	$SUDO install -d -m 1777 "$root/go" "$root/go/src" "$root/go/bin"
	# GOROOT joins the stream under its new name rather than being copied.
	goroot=$(go env GOROOT)
	base=$(basename "$goroot" | sed 's/[][\.*^$|]/\\&/g')
	$SUDO tar --numeric-owner --transform="flags=rh;s|^$base|usr/local/go|" \
		-C "$root" -c . -C "$(dirname "$goroot")" "$(basename "$goroot")" |
		docker import \
			--change "ENV GOLANG_VERSION=${go_version#go} GOTOOLCHAIN=local GOPATH=/go PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin GOPROXY=file:///usr/local/share/goproxy" \
			--change 'WORKDIR /go' \
			--change 'CMD ["bash"]' \
			--change "LABEL $LABEL=$GOLANG $LABEL.inputs=$h_golang" \
			- "$GOLANG" >/dev/null
	$SUDO rm -rf "$root"
}

# The binaries are compiled on this machine, with its Go build cache, in
# the background while Debian downloads (start_etcd); this waits for them.
start_etcd() {
	mkdir -p "$work/etcd"
	(
		cd deploy/etcd
		for tool in server etcdctl etcdutl; do
			out=$tool
			[ "$tool" = server ] && out=etcd
			CGO_ENABLED=0 go build -trimpath \
				-ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module" \
				-o "$work/etcd/$out" "go.etcd.io/etcd/$tool/v3"
		done
	) >"$work/etcd.log" 2>&1 &
	etcd_pid=$!
	log "$ETCD: compiling etcd $etcd_product from its Go modules (in the background)"
}

build_etcd() {
	wait "$etcd_pid" || die "building etcd failed: $(cat "$work/etcd.log")"
	cp $RECIPES/etcd/Dockerfile "$work/etcd/"
	quiet docker build --label "$LABEL=$ETCD" --label "$LABEL.inputs=$h_etcd" -t "$ETCD" "$work/etcd"
	log "$ETCD: $("$work/etcd/etcd" --version | head -n 1)"
}

build_postgres() {
	quiet docker build --label "$LABEL=$POSTGRES" --label "$LABEL.inputs=$h_postgres" -t "$POSTGRES" $RECIPES/postgres
}

# --- the names the deployment uses ----------------------------------------------

GOLANG=$(awk 'toupper($1) == "FROM" && toupper($3) == "AS" && $4 == "build" { print $2 }' Dockerfile)
RUNTIME=$(awk 'toupper($1) == "FROM" { last = $2 } END { print last }' Dockerfile)
ETCD=$(awk '$1 == "image:" && $2 ~ /etcd/ { print $2; exit }' docker-compose.yml)
POSTGRES=$(awk '$1 == "image:" && $2 ~ /^postgres:/ { print $2; exit }' docker-compose.yml)
BUILT=$(awk '$1 == "build:" { b = 1 } b && $1 == "image:" { print $2; exit }' docker-compose.yml)

# Every image the two files reference must be one this script builds (or
# the one compose builds itself): a base added to either file without a
# recipe here fails now, not as a failed pull in the middle of the test.
while read -r ref; do
	case "$ref" in
	"$GOLANG" | "$RUNTIME" | "$ETCD" | "$POSTGRES" | "$BUILT") ;;
	*) die "no stand-in recipe for $ref (referenced by the Dockerfile or docker-compose.yml); add one to $0" ;;
	esac
done < <(
	awk 'toupper($1) == "FROM" { print $2 }' Dockerfile
	awk '$1 == "image:" { print $2 }' docker-compose.yml
)
[ "$RUNTIME" = "$DISTROLESS:nonroot" ] || die "the Dockerfile's runtime base is $RUNTIME; this script builds $DISTROLESS:nonroot"
[ "$POSTGRES" = "postgres:15-$SUITE" ] || die "docker-compose.yml uses $POSTGRES; $SUITE has PostgreSQL 15, so the stand-in is postgres:15-$SUITE"
[[ "$GOLANG" == golang:*-"$SUITE" ]] || die "the Dockerfile builds with $GOLANG; this script builds golang:<version>-$SUITE"

# The Go toolchain that runs this script goes into the golang stand-in, so
# it must be the release the tag names.
go_version=$(go env GOVERSION)
golang_release=${GOLANG#golang:}
golang_release=${golang_release%-"$SUITE"}
[[ "$go_version" == "go$golang_release" || "$go_version" == "go$golang_release".* ]] ||
	die "the Dockerfile builds with $GOLANG, but this machine's Go is $go_version"

# etcd: the image's tag, the product's go.mod and the helper module agree.
etcd_product=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
etcd_helper=$(cd deploy/etcd && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
[ "$etcd_product" = "$etcd_helper" ] ||
	die "go.mod has etcd $etcd_product but deploy/etcd builds $etcd_helper: in deploy/etcd run go get -tool go.etcd.io/etcd/{server,etcdctl,etcdutl}/v3@$etcd_product"
[ "${ETCD##*:}" = "$etcd_product" ] || die "docker-compose.yml runs $ETCD but go.mod has etcd $etcd_product"

# --- build what is missing or stale -----------------------------------------

# Each stand-in's inputs include its base's, so a changed base rebuilds
# everything above it.
h_debian=$(hash "$(declare -f build_debian)" "$SUITE" "$MIRROR")
h_distroless=$(hash "$h_debian" "$(declare -f build_distroless)" $RECIPES/distroless/rootfs.sh)
h_nonroot=$(hash "$h_distroless" "$(declare -f build_nonroot)")
h_golang=$(hash "$h_debian" "$(declare -f build_golang)" "$go_version" "$(go env GOROOT)" go.mod go.sum)
h_etcd=$(hash "$h_distroless" "$(declare -f start_etcd build_etcd)" "$go_version" $RECIPES/etcd/Dockerfile deploy/etcd/go.mod deploy/etcd/go.sum)
h_postgres=$(hash "$h_debian" "$(declare -f build_postgres)" $RECIPES/postgres/Dockerfile $RECIPES/postgres/docker-entrypoint.sh)

work=$(mktemp -d "${TMPDIR:-/tmp}/shardrun-standins-XXXXXX")
cleanup() {
	[ -z "${etcd_pid:-}" ] || kill "$etcd_pid" 2>/dev/null || true
	[ -z "${postgres_pid:-}" ] || kill "$postgres_pid" 2>/dev/null || true
	$SUDO rm -rf "$work"
}
trap cleanup EXIT

started=$SECONDS
etcd_pid=""
postgres_pid=""
if need "$ETCD" "$h_etcd"; then start_etcd; fi
if need "$DEBIAN" "$h_debian"; then timed "$DEBIAN" build_debian; fi
# The postgres stand-in mostly waits on the Debian mirror and the storage
# driver: it builds in the background while the others do.
if need "$POSTGRES" "$h_postgres"; then
	(timed "$POSTGRES" build_postgres) >"$work/postgres.log" 2>&1 &
	postgres_pid=$!
	log "$POSTGRES: installing Debian's postgresql-15 (in the background)"
fi
if need "$DISTROLESS:latest" "$h_distroless"; then timed "$DISTROLESS:latest" build_distroless; fi
if need "$DISTROLESS:nonroot" "$h_nonroot"; then timed "$DISTROLESS:nonroot" build_nonroot; fi
if need "$GOLANG" "$h_golang"; then timed "$GOLANG" build_golang; fi
if [ -n "$etcd_pid" ]; then
	timed "$ETCD" build_etcd
	etcd_pid=""
fi
if [ -n "$postgres_pid" ]; then
	wait "$postgres_pid" || die "$(cat "$work/postgres.log")"
	postgres_pid=""
	cat "$work/postgres.log" >&2
fi
log "all images present in $((SECONDS - started))s: $DEBIAN $DISTROLESS:latest $DISTROLESS:nonroot $GOLANG $ETCD $POSTGRES"

# The etcd members' and clients' TLS certificates (docker-compose.yml mounts
# deploy/certs): made here, at build time, by a small generator; kept
# across runs and never committed.
go run ./internal/cmd/certgen -out deploy/certs
