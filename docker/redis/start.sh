#!/bin/sh
# Start the stack's Redis from docker/redis/redis.conf (or $1) with its users' passwords filled
# in: each rule's password:VARIABLE becomes #<SHA-256 of the password>, the password taken from
# $VARIABLE or from the file $VARIABLE_FILE names (compose secrets). A missing password, or
# .env.example's change-me- placeholder, stops Redis with one line. The passwords travel in the
# environment or files only, never on a command line (`docker inspect`, `ps`); the filled-in
# configuration is written where only this user reads it. Arguments after the file go to
# redis-server (e.g. --port, --dir in tests).
set -euf   # -f: the rules hold glob patterns (~dflash:*), never expand them
template=${1:-/etc/dflash/redis.conf}
[ $# -gt 0 ] && shift
out=${REDIS_CONF_OUT:-/tmp/dflash-redis.conf}
umask 077

fail() { echo "error: $*" >&2; exit 2; }

password_of() {   # VARIABLE: the password, from $VARIABLE or the file $VARIABLE_FILE
  eval "value=\${$1:-} file=\${$1_FILE:-}"
  if [ -z "$value" ] && [ -n "$file" ]; then
    [ -r "$file" ] || fail "$1_FILE=$file cannot be read"
    value=$(cat "$file")
  fi
  [ -n "$value" ] || fail "$1 is not set (in .env, or a file named by $1_FILE)"
  case $value in
    change-me-*) fail "$1 is still .env.example's placeholder ($value): set a password of your own in .env" ;;
  esac
  printf %s "$value"
}

: > "$out"
while IFS= read -r line || [ -n "$line" ]; do
  case $line in
    "user "*password:*)
      filled=
      for word in $line; do
        case $word in
          password:*)
            secret=$(password_of "${word#password:}") || exit 2
            hash=$(printf %s "$secret" | sha256sum) || fail "sha256sum failed"
            word="#${hash%% *}" ;;
        esac
        filled="$filled${filled:+ }$word"
      done
      printf '%s\n' "$filled" >> "$out" ;;
    *) printf '%s\n' "$line" >> "$out" ;;
  esac
done < "$template"
exec redis-server "$out" "$@"
