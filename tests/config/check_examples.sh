#!/bin/sh
# Fails when config/examples/*.json differ from what `stepq mkmap` writes now.
#   check_examples.sh STEPQ_EXE SOURCE_ROOT
set -eu
stepq=$1
root=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/config/examples/regen.sh" "$stepq" "$tmp"
status=0
for f in "$tmp"/*.json; do
    name=$(basename "$f")
    if ! cmp -s "$f" "$root/config/examples/$name"; then
        echo "config/examples/$name differs from stepq mkmap output (run config/examples/regen.sh)"
        status=1
    fi
done
for f in "$root"/config/examples/*.json; do
    name=$(basename "$f")
    if [ ! -e "$tmp/$name" ]; then
        echo "config/examples/$name is not made by regen.sh"
        status=1
    fi
done
[ $status -eq 0 ] && echo "$(ls "$tmp" | wc -l) example maps match stepq mkmap"
exit $status
