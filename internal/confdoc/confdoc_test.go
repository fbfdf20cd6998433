package confdoc

import (
	"flag"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"
)

// The -h output of a real flag set, printed by the flag package itself.
func TestParseHelpReadsTheFlagPackagesOutput(t *testing.T) {
	fs := flag.NewFlagSet("prog", flag.ContinueOnError)
	fs.String("listen", "127.0.0.1:9001", "HTTP listen address")
	fs.Bool("kv-compact", true, "move cells down | into holes")
	fs.Bool("strict", false, "answer 404")
	fs.Duration("queue-timeout", 30*time.Second, "longest wait (0: no bound)")
	fs.Int("n-ctx", 0, "KV cells")
	fs.String("auth-token", "", "bearer token (default $TOKEN; empty: none)")
	fs.Float64("x", 0.8, "one letter")
	var b strings.Builder
	fs.SetOutput(&b)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)

	got, err := ParseHelp("Usage of prog:\n" + b.String())
	if err != nil {
		t.Fatal(err)
	}
	want := []Flag{
		{Name: "auth-token", Type: "string", Usage: "bearer token (default $TOKEN; empty: none)"},
		{Name: "kv-compact", Type: "bool", Default: "true", Usage: "move cells down | into holes"},
		{Name: "listen", Type: "string", Default: "127.0.0.1:9001", Usage: "HTTP listen address"},
		{Name: "n-ctx", Type: "int", Usage: "KV cells"},
		{Name: "queue-timeout", Type: "duration", Default: "30s", Usage: "longest wait (0: no bound)"},
		{Name: "strict", Type: "bool", Usage: "answer 404"},
		{Name: "x", Type: "float", Default: "0.8", Usage: "one letter"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseHelp:\n got %+v\nwant %+v", got, want)
	}
	table := FlagTable(got)
	if !strings.Contains(table, "| `--kv-compact` | bool | `true` | move cells down \\| into holes |\n") {
		t.Errorf("the table does not escape a | in the usage:\n%s", table)
	}
}

func TestSpliceRewritesOnlyBetweenItsMarkers(t *testing.T) {
	doc := "a\n<!-- BEGIN GENERATED s -->\nold\n<!-- END GENERATED s -->\nb\n"
	got, err := Splice(doc, "s", "new\n")
	if err != nil {
		t.Fatal(err)
	}
	if want := "a\n<!-- BEGIN GENERATED s -->\nnew\n<!-- END GENERATED s -->\nb\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if _, err := Splice(doc, "other", "x"); err == nil {
		t.Error("a missing section was not reported")
	}
}
