#!/usr/bin/env bash
# test.sh: the README's test command: installs dependencies, configures, builds and runs the
# whole ctest suite. BUILD_DIR (default build) and CTEST_ARGS may be set by the caller.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
./scripts/install-deps.sh
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j"$(nproc)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" ${CTEST_ARGS:-} -LE fault
# Fault tests kill peers mid-transfer. Debian's UCX 1.13 occasionally trips an internal assertion
# in the surviving process when its tcp peer dies (about 1 run in 10 or more; see docs/NOTES.md),
# so they get up to three tries; every other test must pass the first time.
ctest --test-dir "$BUILD_DIR" --output-on-failure ${CTEST_ARGS:-} -L fault --repeat until-pass:3
