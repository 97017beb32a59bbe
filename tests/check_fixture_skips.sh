#!/bin/sh
# check_fixture_skips.sh - a test program without its fixtures is SKIPPED,
# and under CI it FAILS (test_util.h).
#
# Usage: check_fixture_skips.sh TEST_BINARY
#
# Runs TEST_BINARY (a fixture-dependent cmocka program) twice with
# EMBER_FIXTURES pointing at an empty directory: without CI it must exit 77
# (CTest's SKIP_RETURN_CODE), with CI=1 it must exit with a failure (neither
# 0 nor 77) and name the missing fixture.
set -u
bin=${1:?usage: check_fixture_skips.sh TEST_BINARY}
empty=$(mktemp -d /tmp/ember-no-fixtures-XXXXXX) || exit 1
out=$(mktemp /tmp/ember-fixture-skips-XXXXXX) || exit 1
trap 'rm -rf "$empty" "$out"' EXIT
fail=0

env -u CI EMBER_FIXTURES="$empty" "$bin" >"$out" 2>&1
rc=$?
if [ $rc -ne 77 ]; then
    echo "without CI: $bin exited $rc with no fixtures, expected 77 (skipped):"
    cat "$out"
    fail=1
else
    echo "without CI: exit 77 (skipped), $(grep -c 'skipping: fixture' "$out") missing-fixture notes"
fi

CI=1 EMBER_FIXTURES="$empty" "$bin" >"$out" 2>&1
rc=$?
if [ $rc -eq 0 ] || [ $rc -eq 77 ]; then
    echo "with CI=1: $bin exited $rc with no fixtures, expected a failure:"
    cat "$out"
    fail=1
elif ! grep -q "not found, and CI is set" "$out"; then
    echo "with CI=1: $bin failed (exit $rc) but did not name the missing fixture:"
    cat "$out"
    fail=1
else
    echo "with CI=1: exit $rc (failed), $(grep -c 'not found, and CI is set' "$out") missing-fixture failures"
fi
exit $fail
