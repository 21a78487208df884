#!/bin/sh
# Runs once, when the Postgres image initialises an empty data dir (docker-entrypoint-initdb.d):
# the databases of deploy/local_stack.py DATABASES, each owned by a login role of the same name that
# only its services get (what `fleet up` provisions). fleet_data's role may create roles: the SQL MCP
# server creates its own read-only tool role and the tenant roles. The CONNECTION LIMITs are those of
# deploy/local_stack.py (DATABASE_CONNECTION_LIMITS, OWNER_CONNECTION_LIMITS; the server runs with
# max_connections=PG_MAX_CONNECTIONS); tests/deploy checks that they agree.
# The passwords come from files (compose: the keygen volume; Kubernetes: the fleet-postgres Secret).
set -eu

secret() {
    tr -d '\n' < "$1"
}

FLEET_PW="$(secret "$PG_FLEET_PASSWORD_FILE")"
DATA_PW="$(secret "$PG_FLEET_DATA_PASSWORD_FILE")"

psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
    -v fleet_pw="$FLEET_PW" -v data_pw="$DATA_PW" <<'SQL'
CREATE ROLE fleet LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEROLE CONNECTION LIMIT 80 PASSWORD :'fleet_pw';
CREATE ROLE fleet_data LOGIN NOSUPERUSER NOBYPASSRLS CREATEROLE CONNECTION LIMIT 10 PASSWORD :'data_pw';
CREATE DATABASE fleet OWNER fleet CONNECTION LIMIT 80;
CREATE DATABASE fleet_data OWNER fleet_data CONNECTION LIMIT 100;
SQL
