#!/usr/bin/env bash
# Builds the filter .so the way Envoy loads it (make filter-so) and checks that
# every entry point Envoy v1.36's golang HTTP filter dlsym()s is exported.
# The list is HttpFilterDsoImpl's in contrib/golang/common/dso/dso.cc: Envoy
# refuses the library if any one of them is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

so="${1:-bin/llm-filter.so}"
if [ $# -eq 0 ]; then
  make -s filter-so
fi
[ -f "$so" ] || { echo "check-filter-so: $so not found" >&2; exit 1; }

required=(
  envoyGoFilterNewHttpPluginConfig
  envoyGoFilterMergeHttpPluginConfig
  envoyGoFilterDestroyHttpPluginConfig
  envoyGoFilterOnHttpHeader
  envoyGoFilterOnHttpData
  envoyGoFilterOnHttpLog
  envoyGoFilterOnHttpStreamComplete
  envoyGoFilterOnHttpDestroy
  envoyGoRequestSemaDec
  envoyGoFilterCleanUp
)

exported=$(nm -D --defined-only "$so" | awk '$2 == "T" { print $3 }')
missing=0
for sym in "${required[@]}"; do
  if ! grep -qx "$sym" <<<"$exported"; then
    echo "check-filter-so: $so does not export $sym" >&2
    missing=1
  fi
done
[ "$missing" -eq 0 ] || exit 1
echo "check-filter-so: $so exports all ${#required[@]} envoyGo* entry points ($(du -h "$so" | cut -f1))"
