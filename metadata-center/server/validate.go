package server

import (
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/podsignals"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Limits on identifiers; far above what Envoy cluster names and request
// ids use, low enough that one request cannot bloat the index.
const (
	MaxClusterLen   = 1024
	MaxRequestIDLen = 256
	// MaxPromptLength keeps sums exact in Redis's Lua (doubles).
	MaxPromptLength = 1 << 40
)

func validCluster(c string) (string, error) {
	switch {
	case c == "":
		return "", errors.New("cluster is required")
	case len(c) > MaxClusterLen:
		return "", fmt.Errorf("cluster is longer than %d bytes", MaxClusterLen)
	case !utf8.ValidString(c):
		return "", errors.New("cluster is not valid UTF-8")
	}
	return c, nil
}

// validHost accepts only ip:port and returns its canonical spelling
// (api.CanonicalHost).
func validHost(h string) (string, error) { return api.CanonicalHost(h) }

func validClusterHost(cluster, host string) (string, string, error) {
	c, err := validCluster(cluster)
	if err != nil {
		return "", "", err
	}
	h, err := validHost(host)
	if err != nil {
		return "", "", err
	}
	return c, h, nil
}

func validRef(cluster, host, id string) (api.RequestRef, error) {
	c, h, err := validClusterHost(cluster, host)
	if err != nil {
		return api.RequestRef{}, err
	}
	switch {
	case id == "":
		return api.RequestRef{}, errors.New("request_id is required")
	case len(id) > MaxRequestIDLen:
		return api.RequestRef{}, fmt.Errorf("request_id is longer than %d bytes", MaxRequestIDLen)
	}
	return api.RequestRef{Cluster: c, Host: h, RequestID: id}, nil
}

func validPromptLength(n int64) error {
	if n < 0 || n > MaxPromptLength {
		return fmt.Errorf("prompt_length %d is not in 0..%d", n, int64(MaxPromptLength))
	}
	return nil
}

func validHashes(in []string) ([]prefix.Hash, error) {
	if len(in) > api.MaxHashes {
		return nil, fmt.Errorf("%d hashes: at most %d are accepted", len(in), api.MaxHashes)
	}
	out := make([]prefix.Hash, len(in))
	for i, s := range in {
		h, err := prefix.ParseHash(s)
		if err != nil {
			return nil, fmt.Errorf("hashes[%d]: %v", i, err)
		}
		out[i] = h
	}
	return out, nil
}

// validQuery: hashes must be present (null or missing is a client bug) but
// may be empty (an empty prompt has no blocks; the answer is load only).
func validQuery(cluster string, hashes []string) (string, []prefix.Hash, error) {
	c, err := validCluster(cluster)
	if err != nil {
		return "", nil, err
	}
	if hashes == nil {
		return "", nil, errors.New("hashes is required")
	}
	hs, err := validHashes(hashes)
	return c, hs, err
}

// maxSignalSeconds bounds a pod's reported costs: no queue worth routing
// to takes a day to prefill.
const maxSignalSeconds = 86400

// validSignals refuses counts below zero, a utilization outside 0..1 and
// costs outside 0..maxSignalSeconds (NaN included).
func validSignals(sig api.PodSignals) error {
	switch {
	case sig.Waiting < 0:
		return fmt.Errorf("waiting must be >= 0, got %d", sig.Waiting)
	case sig.Running < 0:
		return fmt.Errorf("running must be >= 0, got %d", sig.Running)
	case sig.PrefillTokens < 0:
		return fmt.Errorf("prefill_tokens must be >= 0, got %d", sig.PrefillTokens)
	case sig.KVCapacity < 0:
		return fmt.Errorf("kv_capacity must be >= 0, got %d", sig.KVCapacity)
	case sig.MaxRunning < 0:
		return fmt.Errorf("max_running must be >= 0, got %d", sig.MaxRunning)
	case sig.HeldTokens < 0:
		return fmt.Errorf("held_tokens must be >= 0, got %d", sig.HeldTokens)
	case !(sig.KVCacheUtil >= 0 && sig.KVCacheUtil <= 1):
		return fmt.Errorf("kv_cache_util must be within 0..1, got %g", sig.KVCacheUtil)
	}
	for _, f := range []struct {
		name string
		v    float64
	}{{"token_seconds", sig.TokenSeconds}, {"attention_seconds", sig.AttentionSeconds}, {"step_seconds", sig.StepSeconds},
		{"step_left_seconds", sig.StepLeftSeconds}, {"held_step_seconds", sig.HeldStepSeconds}, {"hold_left_seconds", sig.HoldLeftSeconds}} {
		if !(f.v >= 0 && f.v <= maxSignalSeconds) {
			return fmt.Errorf("%s must be within 0..%d, got %g", f.name, maxSignalSeconds, f.v)
		}
	}
	if len(sig.PrefillQueue) > api.MaxPrefillQueue {
		return fmt.Errorf("prefill_queue has %d entries, at most %d", len(sig.PrefillQueue), api.MaxPrefillQueue)
	}
	for _, q := range sig.PrefillQueue {
		if q.Tokens < 0 || !(q.Seconds >= 0 && q.Seconds <= maxSignalSeconds) {
			return fmt.Errorf("prefill_queue entries need tokens >= 0 and seconds within 0..%d, got %d and %g", maxSignalSeconds, q.Tokens, q.Seconds)
		}
	}
	return nil
}

// validSaveID checks a save id (required for a retraction).
func validSaveID(id string, required bool) error {
	switch {
	case id == "" && required:
		return errors.New("save_id is required")
	case len(id) > MaxRequestIDLen:
		return fmt.Errorf("save_id is longer than %d bytes", MaxRequestIDLen)
	case !utf8.ValidString(id):
		return errors.New("save_id is not valid UTF-8")
	}
	return nil
}

// validRetract checks a retraction and returns it as a store op (Kind unset).
func validRetract(r api.CacheRetract) (store.Op, error) {
	cluster, host, err := validClusterHost(r.Cluster, r.Host)
	if err != nil {
		return store.Op{}, err
	}
	if len(r.Hashes) == 0 {
		return store.Op{}, errors.New("hashes is required and must not be empty")
	}
	hashes, err := validHashes(r.Hashes)
	if err != nil {
		return store.Op{}, err
	}
	if err := validSaveID(r.SaveID, true); err != nil {
		return store.Op{}, err
	}
	return store.Op{Cluster: cluster, Host: host, Hashes: hashes, SaveID: r.SaveID}, nil
}

// MaxEvictionLead is how far ahead of the metadata center's clock an
// eviction time may be: more is a broken clock, not skew.
const MaxEvictionLead = 24 * time.Hour

// validEvictedAt checks an eviction time against now.
func validEvictedAt(at int64, now time.Time) error {
	switch {
	case at < 0:
		return fmt.Errorf("evicted_at %d is negative (want Unix milliseconds, or 0 for none)", at)
	case at > now.Add(MaxEvictionLead).UnixMilli():
		return fmt.Errorf("evicted_at %d is %v ahead of the metadata center's clock: check the pod's clock (NTP)",
			at, time.UnixMilli(at).Sub(now).Round(time.Second))
	}
	return nil
}

// savedAt dates a save that waited ageMS at the gateway before the call
// carrying it was received (Unix ms; 0 when no age was given: the store
// dates it on arrival).
func savedAt(ageMS int64, received time.Time) (int64, error) {
	switch {
	case ageMS < 0:
		return 0, fmt.Errorf("age_ms %d is negative", ageMS)
	case ageMS > api.MaxSaveAgeMS:
		return 0, fmt.Errorf("age_ms %d exceeds %d: a save that old says nothing true about the pod", ageMS, api.MaxSaveAgeMS)
	case ageMS == 0:
		return 0, nil
	}
	return received.UnixMilli() - ageMS, nil
}

// validMaxEntries checks a save's bound on what its host holds (0: none).
func validMaxEntries(n int) error {
	if n < 0 {
		return fmt.Errorf("max_entries %d is negative", n)
	}
	return nil
}

// validAnnouncement checks a gateway's announcement: a cluster, a backend
// whose /metrics the scraper reads, 1..MaxAnnouncedHosts ip:port hosts
// (canonical spelling returned) and a TTL within bounds.
func validAnnouncement(a api.PodsAnnouncement) (string, []string, time.Duration, error) {
	c, err := validCluster(a.Cluster)
	if err != nil {
		return "", nil, 0, err
	}
	if !podsignals.Scrapable(a.Backend) {
		return "", nil, 0, fmt.Errorf("backend %q has no /metrics this metadata center reads (want %s, %s or %s)",
			a.Backend, podsignals.BackendVLLM, podsignals.BackendSGLang, podsignals.BackendLlamaCpp)
	}
	if len(a.Hosts) == 0 || len(a.Hosts) > api.MaxAnnouncedHosts {
		return "", nil, 0, fmt.Errorf("hosts: list 1 to %d pods", api.MaxAnnouncedHosts)
	}
	hosts := make([]string, len(a.Hosts))
	for i, h := range a.Hosts {
		if hosts[i], err = validHost(h); err != nil {
			return "", nil, 0, fmt.Errorf("hosts[%d]: %w", i, err)
		}
	}
	ttl := a.TTLMS
	if ttl == 0 {
		ttl = api.DefaultAnnouncementTTLMS
	}
	if ttl < api.MinRegistrationTTLMS || ttl > api.MaxAnnouncementTTLMS {
		return "", nil, 0, fmt.Errorf("ttl_ms must be within %d..%d", api.MinRegistrationTTLMS, api.MaxAnnouncementTTLMS)
	}
	return c, hosts, time.Duration(ttl) * time.Millisecond, nil
}
