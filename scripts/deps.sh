#!/usr/bin/env bash
# deps.sh makes sure this machine has what the named make targets need,
# before anything is compiled. What is missing it installs from Debian's
# packages when it can (as root, or through sudo without a password); when
# it cannot, it stops and prints the one command that would install it.
# Every make target runs it first, and .ci/run runs it for all of them:
# needs() below is the project's one list of what it depends on.
#
#   scripts/deps.sh demo test      check and install for these targets
#   scripts/deps.sh --report ci    also check that each tool runs, and print its version
#
# SHARDRUN_DEPS=check reports what is missing without installing it;
# SHARDRUN_DEPS=skip checks nothing (tools installed some other way).
set -euo pipefail

# staticcheck's own release names (2026.2.2) are not module versions the
# proxy serves; this is the module version of that release.
STATICCHECK_VERSION=v0.8.2

die() {
	echo "deps: $*" >&2
	exit 1
}

# needs prints what target needs: Debian package names, and staticcheck
# (from the Go module proxy, pinned above).
#   git              every build: the go command stamps binaries with the
#                    commit, and make lint lists the files it checks
#   ca-certificates  downloading modules from the Go module proxy
#   postgresql       each test binary, the demo and the benchmarks start a
#                    throwaway server from its binaries
#   gcc, libc6-dev   the race detector (cgo), and spin's verifiers
#   chromium         the status page test renders the page headlessly
#   docker-compose   the tests check docker-compose.yml with it; the deploy
#                    test runs it, on the Docker engine (docker.io)
#   make             the demo test runs `make demo`; the model has its own Makefile
needs() {
	case $1 in
	build) echo git ca-certificates ;;
	demo | bench | fuzz) echo git ca-certificates postgresql ;;
	test)
		echo make git ca-certificates postgresql gcc libc6-dev docker-compose
		# The browser test skips, knowingly, with SHARDRUN_SKIP_BROWSER=1
		# (never in CI).
		[ "${SHARDRUN_SKIP_BROWSER:-}" = 1 ] && [ -z "${CI:-}" ] || echo chromium
		;;
	lint) echo git ca-certificates staticcheck ;;
	model | model-bounds) echo make spin gcc libc6-dev ;;
	deploy-test) echo git ca-certificates gcc libc6-dev debootstrap docker-compose docker.io ;;
	ci) for t in lint test fuzz model deploy-test; do needs "$t"; done ;;
	*) die "unknown target $1 (build demo test fuzz lint model model-bounds bench deploy-test ci)" ;;
	esac
}

pg_bindir() {
	local d
	d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
	if [ -n "$d" ] && [ -x "$d/postgres" ] && [ -x "$d/initdb" ]; then
		echo "$d"
	elif command -v postgres >/dev/null && command -v initdb >/dev/null; then
		dirname "$(command -v postgres)"
	fi
}

chromium_bin() { command -v chromium || command -v chromium-browser || command -v google-chrome; }

gobin() {
	local b
	b=$(go env GOBIN)
	echo "${b:-$(go env GOPATH)/bin}"
}

# have says whether what package provides is here.
have() {
	case $1 in
	ca-certificates) [ -s /etc/ssl/certs/ca-certificates.crt ] ;;
	postgresql) [ -n "$(pg_bindir)" ] ;;
	libc6-dev) [ -e /usr/include/stdint.h ] ;;
	chromium) chromium_bin >/dev/null ;;
	docker.io) command -v docker >/dev/null ;;
	debootstrap) command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] ;;
	staticcheck) "$(gobin)/staticcheck" -version 2>/dev/null | grep -q "(${STATICCHECK_VERSION#v})" ;;
	*) command -v "$1" >/dev/null ;;
	esac
}

# runs prints how to run what package provides, to show that it works.
runs() {
	local pg
	case $1 in
	postgresql)
		pg=$(pg_bindir)
		check postgres "$pg/postgres" --version
		check initdb "$pg/initdb" --version
		;;
	make | git | gcc) check "$1" "$1" --version ;;
	ca-certificates) ;;
	libc6-dev) check "cgo (the race detector)" sh -c 'printf "#include <stdint.h>\n#include <grp.h>\n" | gcc -E - >/dev/null && echo "C headers present"' ;;
	chromium) check chromium "$(chromium_bin)" --version ;;
	docker-compose) check docker-compose docker-compose version ;;
	docker.io) check "docker (the engine)" docker version --format '{{.Server.Version}}' ;;
	spin) check spin spin -V ;;
	debootstrap) check debootstrap "$(command -v debootstrap || echo /usr/sbin/debootstrap)" --version ;;
	staticcheck) check staticcheck "$(gobin)/staticcheck" -version ;;
	esac
}

# check runs a tool and prints the first line of its output that carries a
# version (chromium's wrapper prints a shell warning first; make and gcc
# print their licence after it).
check() {
	local name=$1 out
	shift
	if ! out=$("$@" 2>&1); then
		die "$name does not run: $* -> $out"
	fi
	echo "deps: $name: $(echo "$out" | grep -m1 -E '[0-9]+\.[0-9]+' || echo "$out" | head -n 1)"
}

report=false
if [ "${1:-}" = --report ]; then
	report=true
	shift
fi
[ $# -gt 0 ] || die "usage: scripts/deps.sh [--report] TARGET..."
[ "${SHARDRUN_DEPS:-}" = skip ] && exit 0

command -v go >/dev/null || die "Go is not installed: install Go 1.26 from https://go.dev/dl/ (Debian's golang package is older)"

for t in "$@"; do needs "$t" >/dev/null; done # an unknown target stops here
# The packages the targets need, each once, in order.
wanted=$(for t in "$@"; do needs "$t"; done | tr ' ' '\n' | awk 'NF && !seen[$0]++')
missing=()
install_staticcheck=false
for p in $wanted; do
	have "$p" && continue
	if [ "$p" = staticcheck ]; then
		install_staticcheck=true
	else
		missing+=("$p")
	fi
done

if [ ${#missing[@]} -gt 0 ]; then
	sudo=""
	if [ "$(id -u)" -ne 0 ]; then
		sudo="sudo"
	fi
	fix="${sudo:+sudo }apt-get install -y ${missing[*]}"
	if [ "${SHARDRUN_DEPS:-}" = check ]; then
		die "make $* needs ${missing[*]}; install with: $fix"
	fi
	if ! command -v apt-get >/dev/null; then
		die "make $* needs ${missing[*]} (Debian's names; this machine has no apt-get: install them its own way)"
	fi
	if [ -n "$sudo" ] && ! sudo -n true 2>/dev/null; then
		die "make $* needs ${missing[*]}, and this user cannot install packages; run: $fix"
	fi
	echo "deps: make $* needs ${missing[*]}: installing them"
	if ! { $sudo apt-get update -qq &&
		DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"; }; then
		die "installing ${missing[*]} failed; run: $fix"
	fi
	for p in "${missing[@]}"; do
		have "$p" || die "$p was installed but is still not found"
	done
fi

if $install_staticcheck; then
	echo "deps: installing staticcheck $STATICCHECK_VERSION into $(gobin)"
	go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION" || die "installing staticcheck failed"
	have staticcheck || die "staticcheck $STATICCHECK_VERSION is still not in $(gobin)"
fi

if $report; then
	check go go version
	for p in $wanted; do
		runs "$p"
	done
fi
