#!/usr/bin/env bash
# Entrypoint of the postgres stand-in: the official image's contract, in
# short. On a first start (no PG_VERSION in PGDATA) it runs initdb with
# POSTGRES_USER as superuser and POSTGRES_PASSWORD as its password, creates
# POSTGRES_DB, runs /docker-entrypoint-initdb.d/*.sql and *.sh, and allows
# password logins (POSTGRES_HOST_AUTH_METHOD, default scram-sha-256) from
# any address. Started as root, it fixes the ownership of the data
# directory and re-executes itself as user postgres.
set -Eeuo pipefail

if [ "${1:0:1}" = '-' ]; then
	set -- postgres "$@"
fi

if [ "$1" != 'postgres' ]; then
	exec "$@"
fi

if [ "$(id -u)" = '0' ]; then
	install -d -o postgres -g postgres -m 700 "$PGDATA"
	install -d -o postgres -g postgres -m 3777 /var/run/postgresql
	exec setpriv --reuid=postgres --regid=postgres --init-groups "${BASH_SOURCE[0]}" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
	: "${POSTGRES_USER:=postgres}"
	: "${POSTGRES_DB:=$POSTGRES_USER}"
	: "${POSTGRES_HOST_AUTH_METHOD:=scram-sha-256}"
	if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$POSTGRES_HOST_AUTH_METHOD" != 'trust' ]; then
		echo >&2 'error: the database is uninitialized and POSTGRES_PASSWORD is not set'
		echo >&2 '       (set it, or POSTGRES_HOST_AUTH_METHOD=trust to allow every connection without one)'
		exit 1
	fi
	# shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS is a list of arguments
	initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "${POSTGRES_PASSWORD:-}") ${POSTGRES_INITDB_ARGS:-}
	printf '\nhost all all all %s\n' "$POSTGRES_HOST_AUTH_METHOD" >>"$PGDATA/pg_hba.conf"
	echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"

	# The setup server listens on a private socket only, so that nothing
	# (a health check either) sees the database before it is set up.
	sock=$(mktemp -d)
	pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -c unix_socket_directories=$sock" -w start
	psql=(psql -v ON_ERROR_STOP=1 --no-psqlrc -h "$sock" --username "$POSTGRES_USER")
	if [ "$POSTGRES_DB" != 'postgres' ]; then
		"${psql[@]}" --dbname postgres --set db="$POSTGRES_DB" <<<'CREATE DATABASE :"db";'
	fi
	shopt -s nullglob
	for f in /docker-entrypoint-initdb.d/*; do
		case "$f" in
		*.sql) echo "running $f"; "${psql[@]}" --dbname "$POSTGRES_DB" -f "$f" ;;
		*.sh) echo "running $f"; PGHOST=$sock PGUSER=$POSTGRES_USER PGDATABASE=$POSTGRES_DB bash "$f" ;;
		*) echo "ignoring $f" ;;
		esac
	done
	pg_ctl -D "$PGDATA" -m fast -w stop
	rmdir "$sock"
	echo 'PostgreSQL init process complete; ready for start up.'
fi

exec "$@"
