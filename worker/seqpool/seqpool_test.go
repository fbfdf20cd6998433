package seqpool

import (
	"errors"
	"fmt"
	"sync"
	"testing"
)

func TestNewValidatesRange(t *testing.T) {
	for _, n := range []int{0, -1, 257, 1000} {
		if _, err := New(n); err == nil {
			t.Errorf("New(%d) accepted an n_seq_max llama.cpp refuses", n)
		}
	}
	for _, n := range []int{1, 8, 256} {
		p, err := New(n)
		if err != nil {
			t.Fatalf("New(%d): %v", n, err)
		}
		if p.Size() != n || p.Free() != n || p.InUse() != 0 {
			t.Fatalf("New(%d): size %d free %d inuse %d", n, p.Size(), p.Free(), p.InUse())
		}
	}
}

func TestAcquireReleaseBindsOwners(t *testing.T) {
	p, _ := New(3)
	seen := map[int]string{}
	for _, owner := range []string{"a", "b", "c"} {
		s, err := p.Acquire(owner)
		if err != nil {
			t.Fatalf("Acquire(%s): %v", owner, err)
		}
		if s < 0 || s >= 3 {
			t.Fatalf("seq %d out of range", s)
		}
		if prev, dup := seen[s]; dup {
			t.Fatalf("seq %d handed to %s while %s holds it", s, owner, prev)
		}
		seen[s] = owner
		if got := p.Owner(s); got != owner {
			t.Fatalf("Owner(%d) = %q, want %q", s, got, owner)
		}
	}
	if _, err := p.Acquire("d"); !errors.Is(err, ErrExhausted) {
		t.Fatalf("fourth Acquire on a pool of 3: err %v, want ErrExhausted", err)
	}
	if _, err := p.Acquire("a"); err == nil {
		t.Fatal("an owner acquired a second id")
	}
	sb, _ := p.Lookup("b")
	if s, ok := p.Release("b"); !ok || s != sb {
		t.Fatalf("Release(b) = %d,%v want %d,true", s, ok, sb)
	}
	if _, ok := p.Release("b"); ok {
		t.Fatal("second Release of the same owner reported an id")
	}
	if p.Owner(sb) != "" {
		t.Fatal("released id still has an owner")
	}
	s, err := p.Acquire("d")
	if err != nil || s != sb {
		t.Fatalf("Acquire after release = %d,%v want the freed id %d", s, err, sb)
	}
}

func TestTransferKeepsTheID(t *testing.T) {
	p, _ := New(2)
	s, _ := p.Acquire("req-1")
	got, err := p.Transfer("req-1", "entry-1")
	if err != nil || got != s {
		t.Fatalf("Transfer = %d,%v want %d", got, err, s)
	}
	if _, ok := p.Lookup("req-1"); ok {
		t.Fatal("old owner still holds the id")
	}
	if p.Owner(s) != "entry-1" || p.Free() != 1 {
		t.Fatalf("owner %q free %d after transfer", p.Owner(s), p.Free())
	}
	o, _ := p.Acquire("other")
	if _, err := p.Transfer("entry-1", "other"); err == nil {
		t.Fatalf("transfer onto an owner holding seq %d succeeded", o)
	}
	if _, err := p.Transfer("nobody", "x"); err == nil {
		t.Fatal("transfer from an owner with no id succeeded")
	}
}

func TestConcurrentOwnersNeverShareAnID(t *testing.T) {
	p, _ := New(8)
	var mu sync.Mutex
	holder := map[int]string{}
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				owner := fmt.Sprintf("g%d-%d", g, i)
				s, err := p.Acquire(owner)
				if errors.Is(err, ErrExhausted) {
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if h, ok := holder[s]; ok {
					t.Errorf("seq %d given to %s while %s holds it", s, owner, h)
				}
				holder[s] = owner
				mu.Unlock()
				mu.Lock()
				delete(holder, s)
				mu.Unlock()
				p.Release(owner)
			}
		}()
	}
	wg.Wait()
	if p.InUse() != 0 || p.Free() != 8 {
		t.Fatalf("after all releases: inuse %d free %d", p.InUse(), p.Free())
	}
}
