#!/bin/sh
# The bucket job (compose.yaml's createbuckets), run by MinIO's `mc` image or the stand-in's: the
# bucket, then one S3 user per role of the stack, each holding the key .env gives it
# (S3_<ROLE>_KEY / S3_<ROLE>_SECRET) and its role's policy, docs/policies/<role>.json (mounted at
# $POLICIES) with its placeholders filled in for this bucket and prefix. No secret is ever an
# argument of a process: the root's reach mc through MC_HOST_local, each role's through stdin. It runs at every
# `docker compose up` and converges: a policy or a secret changed since the last run replaces the
# old one (that is how keys are rotated: docs/getting-started/compose.md).
# Shell builtins and `mc` only: MinIO's image has no sed, grep or tr.
set -eu
POLICIES=${POLICIES:-/policies}
S3_URL=${S3_URL:-http://minio:9000}
S3_PREFIX=${S3_PREFIX-pipeline}
# role:VARIABLE (S3_<VARIABLE>_KEY / _SECRET): the roles a service of compose.yaml holds.
ROLES=${S3_ROLES:-producer:PRODUCER generate:GENERATE hidden:HIDDEN train:TRAIN reader:READER}
umask 077

fail() { echo "error: $*" >&2; exit 2; }

not_placeholder() {   # NAME VALUE: refuse .env.example's change-me- values
  case $2 in
    change-me-*) fail "$1 is still .env.example's placeholder ($2): set a secret of your own in .env" ;;
  esac
}

# ${NAME} -> its value, as Python's string.Template.substitute does with these names.
value_of() {
  case $1 in
    BUCKET) printf %s "$S3_BUCKET" ;;
    PREFIX) printf %s "${S3_PREFIX:+$S3_PREFIX/}" ;;
    ROOT) printf %s "$S3_BUCKET${S3_PREFIX:+/$S3_PREFIX}" ;;
    EXPORT_ROOT) printf %s "$S3_BUCKET/exports" ;;
    EXPORT_BUCKET) printf %s "$S3_BUCKET" ;;
    EXPORT_PREFIX) printf %s "exports/" ;;
    *) return 1 ;;
  esac
}

userinfo() {   # VALUE: percent-encoded for a URL's user or password (shell builtins only)
  rest=$1 out=
  while [ -n "$rest" ]; do
    c=${rest%"${rest#?}"} rest=${rest#?}
    case $c in
      [A-Za-z0-9._~-]) out=$out$c ;;
      *) out=$out$(printf '%%%02X' "'$c") ;;
    esac
  done
  printf %s "$out"
}

render() {   # FILE: the policy with its placeholders filled in, on stdout
  while IFS= read -r line || [ -n "$line" ]; do
    out=
    while :; do
      case $line in
        *'${'*'}'*) ;;
        *) break ;;
      esac
      rest=${line#*'${'}
      name=${rest%%'}'*}
      value=$(value_of "$name") || fail "$1: unknown placeholder \${$name}"
      out=$out${line%%'${'*}$value
      line=${rest#*'}'}
    done
    printf '%s\n' "$out$line"
  done < "$1"
}

: "${S3_BUCKET:?set S3_BUCKET}" "${MINIO_ROOT_USER:?set MINIO_ROOT_USER}"
: "${MINIO_ROOT_PASSWORD:?set MINIO_ROOT_PASSWORD in .env}"
not_placeholder MINIO_ROOT_PASSWORD "$MINIO_ROOT_PASSWORD"
if [ "${1:-}" = "--render" ]; then   # --render ROLE: print the filled-in policy (tests, docs)
  render "$POLICIES/$2.json"
  exit 0
fi
# The root's credentials reach mc through its environment (MC_HOST_<alias>), never a command
# line: the host's process list shows every argument of every process.
scheme=${S3_URL%%://*} host=${S3_URL#*://}
MC_HOST_local="$scheme://$(userinfo "$MINIO_ROOT_USER"):$(userinfo "$MINIO_ROOT_PASSWORD")@$host"
export MC_HOST_local
if [ "${1:-}" = "--remove-user" ]; then   # --remove-user KEY: an old key, after a rotation
  mc admin user rm local "${2:?--remove-user KEY}"
  exit 0
fi
# Every role's key checked before anything changes.
seen=" $MINIO_ROOT_USER "
for spec in $ROLES; do
  role=${spec%%:*} var=${spec#*:}
  eval "key=\${S3_${var}_KEY:-} secret=\${S3_${var}_SECRET:-}"
  [ -n "$key" ] || fail "S3_${var}_KEY is not set (the $role role's access key)"
  [ -n "$secret" ] || fail "S3_${var}_SECRET is not set in .env (the $role role's secret)"
  not_placeholder "S3_${var}_SECRET" "$secret"
  case $seen in
    *" $key "*) fail "S3_${var}_KEY=$key is the root's or another role's key: one key per role" ;;
  esac
  seen="$seen$key "
  [ -f "$POLICIES/$role.json" ] || fail "no policy $POLICIES/$role.json for the $role role"
done
mc mb --ignore-existing "local/$S3_BUCKET"
for spec in $ROLES; do
  role=${spec%%:*} var=${spec#*:}
  eval "key=\${S3_${var}_KEY} secret=\${S3_${var}_SECRET}"
  policy=/tmp/dflash-policy-$role.json
  render "$POLICIES/$role.json" > "$policy"
  mc admin policy create local "dflash-$role" "$policy" >/dev/null
  # The secret on mc's stdin (it reads the line when not given one), off every command line.
  printf '%s\n' "$secret" | mc admin user add local "$key" >/dev/null
  # `policy attach` fails where the policy is attached already (MinIO's own behaviour).
  if ! out=$(mc admin policy attach local "dflash-$role" --user "$key" 2>&1); then
    case $out in
      *"already in effect"*) ;;
      *) echo "$out" >&2; exit 1 ;;
    esac
  fi
  echo "role $role: user $key with policy dflash-$role"
done
