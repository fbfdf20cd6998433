#!/usr/bin/env bash
# Runs every go fuzz target of the module briefly, on top of its checked-in
# seed corpus (testdata/fuzz/). `make test` runs it after the unit tests; a
# longer local hunt: FUZZTIME=5m ./scripts/fuzz.sh. The default, FUZZTIME
# 5000x, is a count of inputs, not a duration: a duration that runs out while
# an input is running on a loaded machine fails with "context deadline
# exceeded".
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cgo-env.sh
fuzztime="${FUZZTIME:-5000x}"
n=0
for file in $(git ls-files '*_test.go'); do
  for target in $(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$file"); do
    pkg="./$(dirname "$file")"
    n=$((n + 1))
    echo "fuzz: $pkg $target ($fuzztime)"
    go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg" >/tmp/fuzz.$$.log 2>&1 || {
      cat /tmp/fuzz.$$.log; rm -f /tmp/fuzz.$$.log
      echo "fuzz: $pkg $target FAILED (the failing input is under $pkg/testdata/fuzz/$target)" >&2
      exit 1
    }
  done
done
rm -f /tmp/fuzz.$$.log
echo "fuzz: $n targets passed"
