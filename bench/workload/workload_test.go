package workload

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestGenerateShapes(t *testing.T) {
	cases := []struct {
		spec     Spec
		sessions int
		turns    int
		groups   int
	}{
		{Spec{Kind: "shared-prefix", Systems: 2, Users: 3, Questions: 4}, 24, 1, 6},
		{Spec{Kind: "multi-turn", Sessions: 5, Turns: 3}, 5, 3, 5},
		{Spec{Kind: "no-sharing", Requests: 7}, 7, 1, 1},
		{Spec{Kind: "hot-prompt", Requests: 9}, 9, 1, 1},
		{Spec{Kind: "kv-pressure", Systems: 4, Users: 3, Turns: 5}, 12, 5, 4},
		{Spec{Kind: "kv-pressure"}, 36, 6, 12},
	}
	for _, c := range cases {
		t.Run(c.spec.Kind, func(t *testing.T) {
			got, err := Generate(c.spec)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != c.sessions {
				t.Fatalf("sessions = %d, want %d", len(got), c.sessions)
			}
			groups := map[string]bool{}
			ids := map[string]bool{}
			for _, s := range got {
				if len(s.Turns) != c.turns {
					t.Fatalf("session %s has %d turns, want %d", s.ID, len(s.Turns), c.turns)
				}
				if ids[s.ID] {
					t.Fatalf("duplicate session id %s", s.ID)
				}
				ids[s.ID] = true
				groups[s.Group] = true
			}
			if len(groups) != c.groups {
				t.Fatalf("groups = %d, want %d", len(groups), c.groups)
			}
		})
	}
}

func TestSharedPrefixSharesSystemAndUser(t *testing.T) {
	got, err := Generate(Spec{Kind: "shared-prefix", Systems: 2, Users: 2, Questions: 3, SystemBytes: 200, UserBytes: 100})
	if err != nil {
		t.Fatal(err)
	}
	prefix := map[string]string{}
	for _, s := range got {
		p := s.System + "\x00" + strings.SplitN(s.Turns[0].User, "\n", 2)[0]
		if old, ok := prefix[s.Group]; ok && old != p {
			t.Fatalf("group %s has two different prefixes", s.Group)
		}
		prefix[s.Group] = p
	}
	seen := map[string]bool{}
	for _, p := range prefix {
		if seen[p] {
			t.Fatal("two groups share one prefix")
		}
		seen[p] = true
	}
}

func TestNoSharingIsDistinctAndHotIsShared(t *testing.T) {
	ns, _ := Generate(Spec{Kind: "no-sharing", Requests: 20})
	sys := map[string]bool{}
	for _, s := range ns {
		sys[s.System] = true
	}
	if len(sys) != 20 {
		t.Fatalf("no-sharing: %d distinct system prompts of 20", len(sys))
	}
	hp, _ := Generate(Spec{Kind: "hot-prompt", Requests: 20})
	for _, s := range hp[1:] {
		if s.System != hp[0].System {
			t.Fatal("hot-prompt: system prompts differ")
		}
	}
}

func TestDeterministicAndSized(t *testing.T) {
	spec := Spec{Kind: "multi-turn", Seed: 42, Sessions: 3, Turns: 2, SystemBytes: 300, UserBytes: 70}
	a, _ := Generate(spec)
	b, _ := Generate(spec)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same seed gave different sessions")
	}
	c, _ := Generate(Spec{Kind: "multi-turn", Seed: 43, Sessions: 3, Turns: 2, SystemBytes: 300, UserBytes: 70})
	if reflect.DeepEqual(a, c) {
		t.Fatal("different seeds gave the same sessions")
	}
	for _, s := range a {
		if len(s.System) != 300 || len(s.Turns[0].User) != 70 {
			t.Fatalf("sizes %d/%d, want 300/70", len(s.System), len(s.Turns[0].User))
		}
	}
	if _, err := Generate(Spec{Kind: "nope"}); err == nil || !strings.Contains(err.Error(), "unknown kind") {
		t.Fatalf("unknown kind error = %v", err)
	}
}

// kv-pressure: the users of one system prompt share it word for word, and
// their conversations differ from the first turn on.
func TestKVPressureSharesSystemsOnly(t *testing.T) {
	got, err := Generate(Spec{Kind: "kv-pressure", Systems: 2, Users: 3, Turns: 2})
	if err != nil {
		t.Fatal(err)
	}
	bySystem := map[string][]Session{}
	for _, s := range got {
		bySystem[s.Group] = append(bySystem[s.Group], s)
	}
	for g, ss := range bySystem {
		if len(ss) != 3 || len(ss[0].System) < 1024 {
			t.Fatalf("group %s: %d sessions, system %d bytes", g, len(ss), len(ss[0].System))
		}
		for _, s := range ss[1:] {
			if s.System != ss[0].System || s.Turns[0].User == ss[0].Turns[0].User {
				t.Fatalf("group %s: sessions should share only the system prompt", g)
			}
		}
	}
	if bySystem["s0"][0].System == bySystem["s1"][0].System {
		t.Fatal("two groups share a system prompt")
	}
}

// The field's standard shapes: SGLang's generated-shared-prefix defaults
// (64 groups × 16 prompts, 2,048 / 128 tokens, 256 out) sized in tokens of
// the engine's vocabulary; every prompt of a group shares its system
// prompt and nothing else.
func TestGeneratedSharedPrefixIsSGLangsShapeInTokens(t *testing.T) {
	got, err := Generate(Spec{Kind: "generated-shared-prefix", BytesPerToken: 3.5})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 64*16 {
		t.Fatalf("%d sessions, want 1024", len(got))
	}
	systems := map[string]string{}
	questions := map[string]bool{}
	for _, s := range got {
		if len(s.Turns) != 1 || s.Turns[0].MaxTokens != 256 || s.Turns[0].Think != 0 {
			t.Fatalf("session %s: %+v, want one turn of 256 tokens out", s.ID, s.Turns)
		}
		if n := len(s.System); n < 7168 || n > 7168+32 {
			t.Fatalf("system prompt %d bytes, want 2048 tokens × 3.5 bytes (plus its label)", n)
		}
		if len(s.Turns[0].User) != 448 {
			t.Fatalf("question %d bytes, want 128 × 3.5", len(s.Turns[0].User))
		}
		if old, ok := systems[s.Group]; ok && old != s.System {
			t.Fatalf("group %s has two system prompts", s.Group)
		}
		systems[s.Group] = s.System
		if questions[s.Turns[0].User] {
			t.Fatalf("question repeated: %.30q", s.Turns[0].User)
		}
		questions[s.Turns[0].User] = true
	}
	if len(systems) != 64 {
		t.Fatalf("%d groups, want 64", len(systems))
	}
	ladder, err := Generate(Spec{Kind: Ladder, Systems: 3, Questions: 2, OutputTokens: 64})
	if err != nil || len(ladder) != 6 || ladder[0].Turns[0].MaxTokens != 64 {
		t.Fatalf("ladder: %d sessions, err %v", len(ladder), err)
	}
}

// multi-turn-think: answers of 128–512 tokens, users pausing between turns
// (never before the first), the same draw for the same seed.
func TestMultiTurnThinkPausesAndVariesOutputs(t *testing.T) {
	a, err := Generate(Spec{Kind: "multi-turn-think", Seed: 4})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Generate(Spec{Kind: "multi-turn-think", Seed: 4})
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave two workloads")
	}
	lengths := map[int]bool{}
	var think time.Duration
	for _, s := range a {
		for i, turn := range s.Turns {
			if turn.MaxTokens < 128 || turn.MaxTokens > 512 {
				t.Fatalf("output %d tokens", turn.MaxTokens)
			}
			lengths[turn.MaxTokens] = true
			if i == 0 && turn.Think != 0 || i > 0 && (turn.Think <= 0 || turn.Think > 12*time.Second) {
				t.Fatalf("turn %d thinks %v", i, turn.Think)
			}
			think += turn.Think
		}
	}
	if mean := think / time.Duration(32*7); len(lengths) < 50 || mean < 2*time.Second || mean > 4*time.Second {
		t.Fatalf("%d distinct lengths, mean think %v (want ~3s)", len(lengths), mean)
	}
}
