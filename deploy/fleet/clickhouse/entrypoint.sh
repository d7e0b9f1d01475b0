#!/bin/bash
# The clickhouse-server container's entrypoint in docker-compose.yml: reads the two Compose secrets and hands the
# image's own /entrypoint.sh (ClickHouse docker/server/entrypoint.sh) what users.xml and fleet.xml read with from_env:
# the SHA-256 of the `stepline` user's password and the cluster's inter-server secret. The password itself reaches
# no environment and no file ClickHouse writes. The image's entrypoint creates a user only from CLICKHOUSE_USER and
# CLICKHOUSE_PASSWORD, which are not set here: users.d/stepline.xml is the whole user setup.
set -euo pipefail

# A secret file's content without surrounding whitespace, as stepline's collector reads STEPLINE_STORE_PASSWORD_FILE
# (stepline.config.settings._read_secret), so that both sides agree on the password. Empty: refuse to start.
secret() {
    local value
    value="$(<"$1")"
    value="${value#"${value%%[![:space:]]*}"}"
    value="${value%"${value##*[![:space:]]}"}"
    if [[ -z "$value" ]]; then
        echo "$0: $1 is empty: set it in deploy/fleet/.env" >&2
        exit 1
    fi
    printf '%s' "$value"
}

CLICKHOUSE_STEPLINE_PASSWORD_SHA256="$(secret /run/secrets/clickhouse_password | sha256sum | cut -d ' ' -f 1)"
CLICKHOUSE_CLUSTER_SECRET="$(secret /run/secrets/clickhouse_cluster_secret)"
export CLICKHOUSE_STEPLINE_PASSWORD_SHA256 CLICKHOUSE_CLUSTER_SECRET
exec /entrypoint.sh "$@"
