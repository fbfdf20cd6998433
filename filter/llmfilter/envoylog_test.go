package llmfilter

import (
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

func TestEnvoyLogHandler(t *testing.T) {
	type line struct {
		level api.LogType
		msg   string
	}
	var mu sync.Mutex
	var got []line
	sink := func(l api.LogType, m string) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, line{l, m})
	}
	envoyLevel := api.Info
	log := slog.New(NewEnvoyLogHandler(sink, func() api.LogType { return envoyLevel }))
	log.Debug("hidden")
	log.Info("completed", "trace_id", "t1", "status", 200)
	log.With("component", "filter").WithGroup("req").Warn("slow", "ms", 12)
	log.Error("boom")
	if len(got) != 3 {
		t.Fatalf("got %d lines, want 3 (debug is below Envoy's level): %v", len(got), got)
	}
	want := []line{
		{api.Info, `msg=completed trace_id=t1 status=200`},
		{api.Warn, `msg=slow component=filter req.ms=12`},
		{api.Error, `msg=boom`},
	}
	for i, w := range want {
		if got[i].level != w.level || got[i].msg != w.msg {
			t.Errorf("line %d = %v %q, want %v %q", i, got[i].level, got[i].msg, w.level, w.msg)
		}
		if strings.Contains(got[i].msg, "time=") || strings.Contains(got[i].msg, "level=") {
			t.Errorf("Envoy prints time and level itself: %q", got[i].msg)
		}
	}
	envoyLevel = api.Debug
	log.Debug("now visible")
	if len(got) != 4 || got[3].level != api.Debug {
		t.Fatal("the handler must follow Envoy's level at run time")
	}
}
