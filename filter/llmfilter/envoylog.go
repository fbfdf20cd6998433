package llmfilter

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// EnvoyLogSink writes one message to Envoy's log (api.LogInfo and friends in
// the .so; they are unusable outside Envoy, hence the indirection).
type EnvoyLogSink func(level api.LogType, msg string)

// NewEnvoyLogHandler renders records as slog text and hands them to sink at
// the matching Envoy level, so the filter's logs land in Envoy's own log with
// Envoy's level filtering. minLevel reports Envoy's current level.
func NewEnvoyLogHandler(sink EnvoyLogSink, minLevel func() api.LogType) slog.Handler {
	st := &envoyLogState{sink: sink}
	inner := slog.NewTextHandler(st, &slog.HandlerOptions{
		Level: slog.LevelDebug - 4,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) == 0 && (a.Key == slog.TimeKey || a.Key == slog.LevelKey) {
				return slog.Attr{} // Envoy prints both itself
			}
			return a
		},
	})
	return &envoyLogHandler{inner: inner, st: st, minLevel: minLevel}
}

type envoyLogState struct {
	mu    sync.Mutex
	sink  EnvoyLogSink
	level api.LogType
}

func (s *envoyLogState) Write(p []byte) (int, error) {
	s.sink(s.level, strings.TrimRight(string(bytes.Clone(p)), "\n"))
	return len(p), nil
}

type envoyLogHandler struct {
	inner    slog.Handler
	st       *envoyLogState
	minLevel func() api.LogType
}

func envoyLevel(l slog.Level) api.LogType {
	switch {
	case l < slog.LevelDebug:
		return api.Trace
	case l < slog.LevelInfo:
		return api.Debug
	case l < slog.LevelWarn:
		return api.Info
	case l < slog.LevelError:
		return api.Warn
	default:
		return api.Error
	}
}

func (h *envoyLogHandler) Enabled(_ context.Context, l slog.Level) bool {
	return h.minLevel == nil || envoyLevel(l) >= h.minLevel()
}

func (h *envoyLogHandler) Handle(ctx context.Context, r slog.Record) error {
	h.st.mu.Lock()
	defer h.st.mu.Unlock()
	h.st.level = envoyLevel(r.Level)
	return h.inner.Handle(ctx, r)
}

func (h *envoyLogHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &envoyLogHandler{inner: h.inner.WithAttrs(as), st: h.st, minLevel: h.minLevel}
}

func (h *envoyLogHandler) WithGroup(name string) slog.Handler {
	return &envoyLogHandler{inner: h.inner.WithGroup(name), st: h.st, minLevel: h.minLevel}
}
