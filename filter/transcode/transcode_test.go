package transcode

import (
	"errors"
	"testing"
)

type nop struct{}

func (nop) Parse(string, []byte) (*Request, error)      { return &Request{}, nil }
func (nop) Upstream(*Request, string) (Upstream, error) { return Upstream{}, nil }

func TestRegistryLookup(t *testing.T) {
	r := Registry{"openai": nop{}}
	if tr, err := r.Lookup("openai"); err != nil || tr == nil {
		t.Fatalf("%v %v", tr, err)
	}
	_, err := r.Lookup("grpc")
	var te *Error
	if !errors.As(err, &te) || te.Status != 400 || te.Type != TypeBadRequest || te.Message != `unsupported protocol "grpc"` {
		t.Fatalf("%#v", err)
	}
}

func TestErrorsAndKinds(t *testing.T) {
	if e := NotFound("no %s", "x"); e.Status != 404 || e.Type != TypeNotFound || e.Error() != "no x" {
		t.Fatalf("%#v", e)
	}
	if Chat.String() != "chat" || Completion.String() != "completion" || Kind(99).String() != "Kind(99)" || Responses.String() != "responses" {
		t.Fatal("kind names")
	}
}

func TestAppendCanonical(t *testing.T) {
	set := &Request{Canonical: []byte("abc")}
	if got := string(set.AppendCanonical([]byte("> "))); got != "> abc" {
		t.Fatalf("%q", got)
	}
	comp := &Request{Kind: Completion, Prompt: "p\x1e"}
	if got := string(comp.AppendCanonical(nil)); got != "p\x1b\x1e" {
		t.Fatalf("%q", got)
	}
}
