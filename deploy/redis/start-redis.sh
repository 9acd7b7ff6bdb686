#!/bin/sh
# Redis for tokenline: persistence off, the default user off, one ACL user per role.
#
#   REDIS_API_PASSWORD, REDIS_WORKER_PASSWORD, REDIS_DASHBOARD_PASSWORD   (required)
#   REDIS_ACL_FILE   where to write the ACL file (default /tmp/tokenline-users.acl)
#   TOKENLINE_DEV_MODE=1   accept compose's development passwords (tokenline-*-dev); refused otherwise
#   extra arguments go to redis-server (the tests add --port and --bind)
#
# Passwords are stored as SHA-256 in the ACL file, never on redis-server's command line. Every role
# reaches only RQ's and tokenline's keys and channels, and none may run @admin or @dangerous
# commands (FLUSHALL, CONFIG, KEYS, DEBUG, CLIENT LIST ...), except INFO (RQ reads the server version)
# and CLIENT SETNAME (RQ names its connections).
set -eu
: "${REDIS_API_PASSWORD:?}" "${REDIS_WORKER_PASSWORD:?}" "${REDIS_DASHBOARD_PASSWORD:?}"
acl_file=${REDIS_ACL_FILE:-/tmp/tokenline-users.acl}

if [ "${TOKENLINE_DEV_MODE:-0}" != 1 ]; then
  for password in "$REDIS_API_PASSWORD" "$REDIS_WORKER_PASSWORD" "$REDIS_DASHBOARD_PASSWORD"; do
    case "$password" in
      tokenline-*-dev)
        echo "start-redis: refusing the development password '$password': set REDIS_API_PASSWORD," \
          "REDIS_WORKER_PASSWORD and REDIS_DASHBOARD_PASSWORD, or TOKENLINE_DEV_MODE=1 for a development stack" >&2
        exit 2
        ;;
    esac
  done
fi

hash() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
scope='~rq:* ~tokenline:* resetchannels &rq:* &tokenline:* +@all -@admin -@dangerous +info +client|setname'

umask 077
cat > "$acl_file" <<ACL
user default off
user api on #$(hash "$REDIS_API_PASSWORD") $scope
user worker on #$(hash "$REDIS_WORKER_PASSWORD") $scope
user dashboard on #$(hash "$REDIS_DASHBOARD_PASSWORD") $scope
ACL
exec redis-server --save "" --appendonly no --aclfile "$acl_file" "$@"
