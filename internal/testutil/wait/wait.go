// Package wait is the tests' one bounded polling helper: a test waits for
// the event it needs, never for a fixed time.
package wait

import (
	"testing"
	"time"
)

// For polls cond every few milliseconds until it holds, failing t with
// "timed out waiting for <what>" after timeout.
func For(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Until(timeout, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// Until polls cond until it holds or timeout passes and reports whether it
// held; for callers that cannot fail a test (other goroutines, helpers that
// return an error).
func Until(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}
