package redisstore

import (
	"context"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
)

// The store works on a Redis that speaks TLS only, as an ACL user; a
// plain-TCP client and the default user are refused.
func TestTLSOnlyRedis(t *testing.T) {
	rds := redistest.StartTLS(t)
	tc, err := secretfile.ClientTLS(rds.CAFile, "", false)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	open := func(o Options) *Store {
		o.Addr, o.KeyPrefix = rds.Addr, rds.Prefix
		st, err := New(o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return st
	}
	st := open(Options{TLS: tc, Credentials: func() (string, string) { return rds.Username, rds.Password }})
	if err := st.Ping(ctx); err != nil {
		t.Fatalf("TLS with the ACL user: %v", err)
	}
	if err := st.AddLease(ctx, "c", "10.0.0.1:1", "r", 4); err != nil {
		t.Fatal(err)
	}
	load, err := st.LoadStats(ctx, "c")
	if err != nil || load["10.0.0.1:1"].TotalReqs != 1 {
		t.Fatalf("load over TLS: %v, %v", load, err)
	}
	if err := open(Options{Username: rds.Username, Password: rds.Password}).Ping(ctx); err == nil {
		t.Fatal("a plain-TCP client talked to the TLS-only Redis")
	}
	if err := open(Options{TLS: tc, Password: rds.Password}).Ping(ctx); err == nil {
		t.Fatal("the default user, which is off, was let in")
	}
}
